"""Entrypoint for `ray job submit --working-dir . -- python jobs/sft.py CONFIG.yaml [--set k=v ...]`.

Runs on the cluster's head node, where RAY_ADDRESS points at the cluster; same options as `raysft train`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the uploaded working dir holds raysft/

from raysft.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
