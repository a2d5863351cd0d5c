"""The torchrun entry: `torchrun --nproc-per-node N -m raysft.run CONFIG.yaml [--set section.key=value ...]`.

The worker run itself lives in raysft.launch.torchrun; this module keeps the documented command short.
"""

from raysft.launch.signals import exit_process
from raysft.launch.torchrun import main

if __name__ == "__main__":
    exit_process(main())
