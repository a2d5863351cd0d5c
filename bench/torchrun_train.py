"""raysft's training loop without Ray: the same Trainer under plain torch.distributed, started by torchrun. The
baseline that shows what Ray adds to a step (bench/throughput.py runs it side by side with raysft.train).

    torchrun --nproc-per-node N bench/torchrun_train.py CONFIG.json STORE_DIR

CONFIG.json is a TrainConfig as a dict (TrainConfig.to_dict()); STORE_DIR a prepared parquet store. Rank 0 writes
<run dir>/metrics.jsonl exactly as under Ray. Checkpoints are written as under Ray (the cost is the same) but
kept nowhere: there is no Ray to collect the workers' parts, and a benchmark needs none.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.config import TrainConfig
from raysft.trainer import Trainer, WorkerContext


def main() -> None:
    cfg = TrainConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    gpu = cfg.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
    ctx = WorkerContext(dist.get_rank(), dist.get_world_size(), device, int(os.environ.get("GROUP_RANK", 0)))
    try:
        Trainer(cfg, Path(sys.argv[2]), None, lambda *report: None, ctx).train()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
