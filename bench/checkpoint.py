"""Checkpoint speed, the whole path the user waits for: save and load throughput of full and sharded checkpoints
against the disk's own write bandwidth (dd, in the same run and directory), bytes written per checkpoint against
its size, rank 0's peak memory while saving, how long an async save blocks training against a synchronous one, and
goodput: the training time of steps that checkpoint every 2 steps over the same steps checkpointing only at the end.

    .venv/bin/python bench/checkpoint.py                    # 2 CPU workers, a ~75M-parameter LLaMA
    .venv/bin/python bench/checkpoint.py --gpu --workers 8 --hidden 2048 --layers 16

Saves go through the production path: the Trainer's Checkpointer with raysft.launch.ray_driver's sink, so every rank
writes straight into the run directory, rank 0 commits it, and it is registered with Ray (NO_UPLOAD). A save counts
until that registration returns: every file hashed (sha256) and flushed, the manifest written, the directory
renamed into place, Ray told. Throughput is checkpoint bytes over the slowest rank's time; bytes written are the
sum over ranks of /proc/self/io write_bytes during the save. Memory is the resident set's growth during the save,
after handing freed heap memory back to the OS.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from common import (
    MiB,
    PeakSampler,
    Setup,
    add_model_args,
    disk_write_gbps,
    median_span,
    rss_bytes,
    save_results,
    trim_heap,
    write_rank_result,
)

VARIANTS = [("full", False), ("full", True), ("sharded", False), ("sharded", True)]
GOODPUT_VARIANTS = [("full", False), ("sharded", False), ("sharded", True)]


def _measure(loop: dict) -> None:
    import torch
    import torch.distributed as dist

    from raysft.checkpoint import checkpoint_dirs
    from raysft.config import config_from_dict
    from raysft.launch.ray_worker import ray_sink, ray_worker_context
    from raysft.training.trainer import Trainer

    ctx = ray_worker_context()
    cfg = config_from_dict(loop["config"])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, Path(loop["store"]), None, ray_sink(cfg, ctx.rank, frozenset()), ctx)
    checkpointer = trainer.checkpointer
    trainer.model.train()
    trainer.train_step()  # the optimizer state exists from here on

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    def total(count: int) -> int:
        value = torch.tensor([count], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(value)
        return int(value.item())

    def latest() -> Path:
        return checkpoint_dirs(cfg.run_dir)[-1]

    results: dict[str, list[dict]] = {}
    for mode, asynchronous in [v for r in range(loop["repeats"]) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]:
        name = f"{mode}{'-async' if asynchronous else ''}"
        checkpointer.mode, checkpointer.cfg.async_save = mode, asynchronous
        trainer.state.step += 1  # each save its own step
        dist.barrier()
        trim_heap()
        before, written_before = rss_bytes(), io_write_bytes()
        with PeakSampler(rss_bytes) as memory:
            start = time.perf_counter()
            checkpointer.save(trainer.state, {})
            blocking = time.perf_counter() - start
            checkpointer.finish()  # committed and registered with Ray
            save_s = time.perf_counter() - start
        written = total(io_write_bytes() - written_before)
        ckpt = latest()
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        dist.barrier()
        start = time.perf_counter()
        checkpointer.load(ckpt)
        load_s = slowest(time.perf_counter() - start)
        results.setdefault(name, []).append({"bytes": size, "bytes_written": written, "save_s": slowest(save_s),
                                             "blocking_s": slowest(blocking), "load_s": load_s,
                                             "save_peak_mib": (memory.peak - before) / MiB})
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
    for mode, asynchronous in GOODPUT_VARIANTS:
        checkpointer.mode, checkpointer.cfg.async_save = mode, asynchronous
        for every in (2, loop["goodput_steps"]):  # every 2 steps; only at the end
            dist.barrier()
            start = time.perf_counter()
            for i in range(1, loop["goodput_steps"] + 1):
                trainer.train_step()
                if i % every == 0:
                    checkpointer.save(trainer.state, {})
                checkpointer.poll(trainer.state.step)
            checkpointer.finish()
            results.setdefault(f"goodput-{mode}{'-async' if asynchronous else ''}", []).append(
                {"every": every, "seconds": slowest(time.perf_counter() - start)})
            dist.barrier()
            if ctx.rank == 0:
                for old in checkpoint_dirs(cfg.run_dir):
                    shutil.rmtree(old, ignore_errors=True)
    write_rank_result(loop, ctx.rank, results)


def io_write_bytes() -> int:
    """What this process (all its threads) has caused to be written to storage so far."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=2)
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per variant, interleaved")
    parser.add_argument("--goodput-steps", type=int, default=8, help="steps of each goodput run")
    parser.add_argument("--out", default="runs/bench/checkpoint.json")
    args = parser.parse_args(argv)

    setup = Setup(args, "checkpoint")
    # the run directory is Ray's own for this worker group (bench/common.py's RunConfig): Ray registers only
    # checkpoints inside it, as under raysft.train
    config = setup.config("run.name=bench-checkpoint", f"run.storage_path={setup.work / 'ray'}")
    ranks = setup.run(_measure, "checkpoint", {"config": config.to_dict(),
                                               "repeats": args.repeats, "goodput_steps": args.goodput_steps})
    state_mib = ranks[0]["full"][0]["bytes"] / MiB
    disks = [disk_write_gbps(setup.work, max(256, int(state_mib))) for _ in range(args.repeats)]
    results = []
    for name in (n for n in ranks[0] if n != "rank" and not n.startswith("goodput")):
        runs = ranks[0][name]  # times are the slowest rank's already
        median = {k: statistics.median(run[k] for run in runs) for k in ("save_s", "blocking_s", "load_s")}
        results.append({"variant": name, "disk_write_gbps": statistics.median(disks), "disk_runs": disks,
                        "bytes": runs[0]["bytes"], "runs": runs, **median,
                        "rank0_save_peak_mib": max(run["save_peak_mib"] for run in runs),
                        "max_other_save_peak_mib": max((run["save_peak_mib"] for r in ranks[1:] for run in r[name]),
                                                       default=0.0)})
    goodput = [{"variant": n, "runs": runs,
                "every_2_over_end": runs[0]["seconds"] / runs[1]["seconds"]}
               for n, runs in ranks[0].items() if n.startswith("goodput")]
    save_results(args.out, args, results + goodput, report(results, args, setup.params) + "\n\n" +
                 goodput_report(goodput, args.goodput_steps))


def goodput_report(goodput: list[dict], steps: int) -> str:
    lines = [f"goodput: {steps} training steps checkpointing every 2 steps, over the same steps checkpointing only "
             "at the end", "", "| variant | every 2 steps (s) | at the end (s) | ratio |", "|---|---:|---:|---:|"]
    for g in goodput:
        lines.append(f"| {g['variant'].removeprefix('goodput-')} | {g['runs'][0]['seconds']:.2f} "
                     f"| {g['runs'][1]['seconds']:.2f} "
                     f"| {g['every_2_over_end']:.2f} |")
    return "\n".join(lines)


def report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    disk, disks = results[0]["disk_write_gbps"], results[0]["disk_runs"]
    sync = {r["variant"]: r["save_s"] for r in results}
    lines = [f"checkpoint speed: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of {params / 1e6:.0f}M "
             f"parameters (weights + AdamW state); disk write bandwidth by dd: {disk:.2f} GB/s ({min(disks):.2f}-"
             f"{max(disks):.2f}); {args.repeats} saves and loads per variant, interleaved: median (min-max)", "",
             "| variant | size (MiB) | written / size | save (s) | save GB/s | vs disk | blocks training (s) "
             "| vs sync save | load (s) | load GB/s | rank 0 peak during save (MiB) | other ranks (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gbps = r["bytes"] / r["save_s"] / 1e9
        base = sync[r["variant"].removesuffix("-async")]
        save, blocking, load = (median_span(r["runs"], k) for k in ("save_s", "blocking_s", "load_s"))
        written = statistics.median(run["bytes_written"] for run in r["runs"]) / r["bytes"]
        lines.append(f"| {r['variant']} | {r['bytes'] / MiB:.0f} | {written:.2f} | {save} | {gbps:.2f} "
                     f"| {gbps / disk:.2f} "
                     f"| {blocking} | {r['blocking_s'] / base:.2f} | {load} "
                     f"| {r['bytes'] / r['load_s'] / 1e9:.2f} | {r['rank0_save_peak_mib']:.0f} "
                     f"| {r['max_other_save_peak_mib']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
