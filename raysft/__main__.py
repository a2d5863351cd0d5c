import sys

from raysft.cli import main

sys.exit(main())
