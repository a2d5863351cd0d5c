"""raysft's worker run without Ray (raysft.run), started by torchrun: the baseline that shows what Ray adds to a step
(bench/throughput.py runs it side by side with raysft.train).

    torchrun --nproc-per-node N bench/torchrun_train.py CONFIG.json [--profile OUT.json --profile-from S]

CONFIG.json is a TrainConfig as a dict (TrainConfig.to_dict()). The run prepares (reuses) its store, checkpoints
into its run directory and writes <run dir>/metrics.jsonl exactly as under Ray: the same work, without Ray.

--profile records steps S to the end with torch.profiler on every rank, and rank 0 writes a summary to OUT.json:
the fraction of the profiled wall time the device was busy (on CUDA: the union of kernel intervals; on CPU: the
union of the training thread's aten op intervals, i.e. not in Python, the data path or waiting for a
collective), and the top kernels or ops by their own time. The trace itself goes beside it (OUT.trace.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from raysft.config import config_from_dict
from raysft.launch.signals import exit_process
from raysft.launch.torchrun import end_distributed, init_distributed, prepare_on_rank0, run_trainer
from raysft.training.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--profile", default="")
    parser.add_argument("--profile-from", type=int, default=1)
    args = parser.parse_args()
    cfg = config_from_dict(json.loads(Path(args.config).read_text()))
    ctx = init_distributed()
    done = False
    try:
        trainer = run_trainer(cfg, prepare_on_rank0(cfg, fresh=False), ctx)
        if args.profile:
            profile(trainer, Path(args.profile), args.profile_from, ctx.rank == 0)
        else:
            trainer.train()
        done = True
    finally:
        end_distributed(agreed=done)


def profile(trainer: Trainer, out: Path, first_step: int, write: bool) -> None:
    """Train with torch.profiler recording steps first_step..max_steps; summarize on rank 0."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = trainer.ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    recorded = trainer.cfg.train.max_steps - first_step + 1
    window: list[float] = []
    with profile(activities=activities, schedule=schedule(wait=first_step - 1, warmup=0, active=recorded,
                                                          repeat=1)) as prof:
        inner = trainer.train_step

        def train_step(*args, **kwargs):  # the profiler's step boundaries are the optimizer steps
            if trainer.state.step == first_step - 1:
                window.append(synchronized_time(cuda))
            out = inner(*args, **kwargs)
            if trainer.state.step == trainer.cfg.train.max_steps:
                window.append(synchronized_time(cuda))
            prof.step()
            return out

        trainer.train_step = train_step
        trainer.train()
    if write:
        out.write_text(json.dumps(summarize(prof, window[-1] - window[0], cuda, recorded), indent=1))
        prof.export_chrome_trace(str(out.with_suffix(".trace.json")))


def synchronized_time(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def summarize(prof, wall_s: float, cuda: bool, steps: int) -> dict:
    events = prof.events()
    if cuda:
        intervals = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
    else:  # the training thread's aten ops: not Python, not the data path, not a wait for a collective
        main = max({e.thread for e in events}, key=lambda t: sum(1 for e in events if e.thread == t))
        intervals = [(e.time_range.start, e.time_range.end) for e in events
                     if e.thread == main and e.name.startswith("aten::")]
    busy_us, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):  # the union of the intervals, in microseconds
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = [a for a in prof.key_averages() if not a.key.startswith("ProfilerStep")]
    top = sorted(ops, key=lambda a: getattr(a, key), reverse=True)[:15]
    return {"device": "cuda" if cuda else "cpu", "steps": steps, "wall_s": wall_s,
            "busy_fraction": min(1.0, busy_us / 1e6 / wall_s),
            "top": [{"name": a.key, "self_ms": getattr(a, key) / 1e3, "calls": a.count} for a in top]}


if __name__ == "__main__":
    main()
    exit_process(0)  # not through interpreter finalization: see exit_process
