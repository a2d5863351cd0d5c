"""Checkpoint speed: save and load throughput of full and sharded checkpoints against the disk's own write
bandwidth (dd, in the same run and directory), rank 0's peak memory while saving, and how long an async save
blocks training against a synchronous one.

    .venv/bin/python bench/checkpoint.py                    # 2 CPU workers, a ~75M-parameter LLaMA
    .venv/bin/python bench/checkpoint.py --gpu --workers 8 --hidden 2048 --layers 16

Per mode, every rank writes its part into a directory of its own (as under Ray), the parts are merged into one
directory (Ray's upload, not timed), and all ranks load it back. A save counts until its manifest is written:
every file hashed (sha256) and flushed to disk. Throughput is checkpoint bytes over the slowest rank's time.
Memory is the resident set's growth during the save, after handing freed heap memory back to the OS.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from common import (
    MiB,
    PeakSampler,
    Setup,
    add_model_args,
    median_span,
    rss_bytes,
    save_results,
    trim_heap,
    write_rank_result,
)

VARIANTS = [("full", False), ("full", True), ("sharded", False), ("sharded", True)]


def _measure(loop: dict) -> None:
    import torch
    import torch.distributed as dist

    from raysft.checkpoint import load, start_save
    from raysft.config import TrainConfig
    from raysft.launch import ray_worker_context
    from raysft.trainer import Trainer

    ctx = ray_worker_context()
    trainer = Trainer(TrainConfig.from_dict(loop["config"]), Path(loop["store"]), None, lambda *a: None, ctx)
    trainer.model.train()
    trainer.train_step()  # the optimizer state exists from here on

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    results: dict[str, list[dict]] = {}
    for mode, asynchronous in [v for r in range(loop["repeats"]) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]:
        name = f"{mode}{'-async' if asynchronous else ''}"
        root = Path(loop["out"]) / name
        mine, merged = root / f"rank{ctx.rank}", root / "merged"
        dist.barrier()
        trim_heap()
        before = rss_bytes()
        with PeakSampler(rss_bytes) as memory:
            start = time.perf_counter()
            pending = start_save(mine, mode, trainer.objs, trainer.state, asynchronous)
            blocking = time.perf_counter() - start
            pending.finish()
            save_s = time.perf_counter() - start
        if not asynchronous:
            blocking = save_s  # training waits for all of it
        written = torch.tensor([sum(f.stat().st_size for f in mine.rglob("*") if f.is_file())],
                               dtype=torch.float64, device=ctx.device)
        dist.all_reduce(written)
        shutil.copytree(mine, merged, dirs_exist_ok=True)  # what Ray does with every worker's directory
        dist.barrier()
        start = time.perf_counter()
        load(merged, trainer.objs)
        load_s = slowest(time.perf_counter() - start)
        results.setdefault(name, []).append({"bytes": written.item(), "save_s": slowest(save_s),
                                             "blocking_s": slowest(blocking), "load_s": load_s,
                                             "save_peak_mib": (memory.peak - before) / MiB})
        dist.barrier()
        shutil.rmtree(mine, ignore_errors=True)
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    write_rank_result(loop, ctx.rank, results)


def disk_write_gbps(directory: Path, size_mib: int) -> float:
    """dd of size_mib MiB into `directory`, flushed to disk before dd exits (conv=fdatasync)."""
    target = directory / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={size_mib}", "conv=fdatasync"],
                         capture_output=True, text=True, check=True).stderr
    target.unlink()
    seconds = float(re.search(r"copied, ([0-9.]+) s", out).group(1))
    return size_mib * MiB / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=2)
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per variant, interleaved")
    parser.add_argument("--out", default="runs/bench/checkpoint.json")
    args = parser.parse_args(argv)

    setup = Setup(args, "checkpoint")
    ranks = setup.run(_measure, "checkpoint", {"config": setup.config().to_dict(), "repeats": args.repeats})
    state_mib = ranks[0]["full"][0]["bytes"] / MiB
    disks = [disk_write_gbps(setup.work, max(256, int(state_mib))) for _ in range(args.repeats)]
    results = []
    for name in (n for n in ranks[0] if n != "rank"):
        runs = ranks[0][name]  # times are the slowest rank's already
        median = {k: statistics.median(run[k] for run in runs) for k in ("save_s", "blocking_s", "load_s")}
        results.append({"variant": name, "disk_write_gbps": statistics.median(disks), "disk_runs": disks,
                        "bytes": runs[0]["bytes"], "runs": runs, **median,
                        "rank0_save_peak_mib": max(run["save_peak_mib"] for run in runs),
                        "max_other_save_peak_mib": max((run["save_peak_mib"] for r in ranks[1:] for run in r[name]),
                                                       default=0.0)})
    save_results(args.out, args, results, report(results, args, setup.params))


def report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    disk, disks = results[0]["disk_write_gbps"], results[0]["disk_runs"]
    sync = {r["variant"]: r["save_s"] for r in results}
    lines = [f"checkpoint speed: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of {params / 1e6:.0f}M "
             f"parameters (weights + AdamW state); disk write bandwidth by dd: {disk:.2f} GB/s ({min(disks):.2f}-"
             f"{max(disks):.2f}); {args.repeats} saves and loads per variant, interleaved: median (min-max)", "",
             "| variant | size (MiB) | save (s) | save GB/s | vs disk | blocks training (s) | vs sync save "
             "| load (s) | load GB/s | rank 0 peak during save (MiB) | other ranks (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gbps = r["bytes"] / r["save_s"] / 1e9
        base = sync[r["variant"].removesuffix("-async")]
        save, blocking, load = (median_span(r["runs"], k) for k in ("save_s", "blocking_s", "load_s"))
        lines.append(f"| {r['variant']} | {r['bytes'] / MiB:.0f} | {save} | {gbps:.2f} | {gbps / disk:.2f} "
                     f"| {blocking} | {r['blocking_s'] / base:.2f} | {load} "
                     f"| {r['bytes'] / r['load_s'] / 1e9:.2f} | {r['rank0_save_peak_mib']:.0f} "
                     f"| {r['max_other_save_peak_mib']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
