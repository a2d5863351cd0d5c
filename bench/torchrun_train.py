"""raysft's worker run without Ray (raysft.run), started by torchrun: the baseline that shows what Ray adds to a step
(bench/throughput.py runs it side by side with raysft.train).

    torchrun --nproc-per-node N bench/torchrun_train.py CONFIG.json

CONFIG.json is a TrainConfig as a dict (TrainConfig.to_dict()). The run prepares (reuses) its store, checkpoints
into its run directory and writes <run dir>/metrics.jsonl exactly as under Ray: the same work, without Ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from raysft.config import TrainConfig
from raysft.run import init_distributed, launch


def main() -> None:
    cfg = TrainConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    ctx = init_distributed()
    try:
        launch(ctx, cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
