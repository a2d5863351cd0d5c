"""What the memory tier's checksum costs: a part written by the tier's own writer (raysft.checkpoint.memory.files.
write_part, the tier thread's work for each snapshot) with the checksum taken as the bytes are written, side by
side with the same writer whose digest does nothing, and the check a resume makes of a part (data_checksum),
against a plain read of the same file. All in node-local shared memory (--dir, /dev/shm by default), where the
tier writes.

    .venv/bin/python bench/memory_checksum.py --mb 1024 --out docs/bench/cpu-tier-checksum.json

The cost per step is the write's: with a snapshot every step, a step waits for nothing as long as the tier thread
writes its part within the step's time (else the next snapshot is passed over and counted).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import MiB, save_results

import raysft.checkpoint.memory.files as files


class _NoDigest:
    """The writer's digest, doing nothing: the baseline of the side by side."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


def _write_s(path: Path, buffer: torch.Tensor, slots, checksum: bool) -> float:
    real = files.xxhash.xxh3_64
    files.xxhash.xxh3_64 = real if checksum else _NoDigest
    try:
        start = time.perf_counter()
        files.write_part(path, buffer, slots, {}, {"step": 1})
        return time.perf_counter() - start
    finally:
        files.xxhash.xxh3_64 = real
        path.unlink()


def _read_s(path: Path, check: bool) -> float:
    start = time.perf_counter()
    if check:
        files.data_checksum(path)
    else:
        with open(path, "rb") as f:
            while f.read(files.WRITE_CHUNK):
                pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024,
                        help="the part's size in MiB: a rank's weights and AdamW state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default="bench/results/memory_checksum.json")
    args = parser.parse_args()

    size = args.mb * MiB
    buffer = torch.randint(0, 256, (size,), dtype=torch.uint8)
    slots = files.plan_slots({"model.w": torch.empty(size // 4, dtype=torch.float32)})
    runs = {"write": [], "write + checksum": [], "read": [], "read + check": []}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="raysft-bench-") as tmp:
        path = Path(tmp) / "rank_0.safetensors"
        for _ in range(args.repeats):  # interleaved, so that a busy moment of the machine hits both alike
            runs["write"].append(_write_s(path, buffer, slots, checksum=False))
            runs["write + checksum"].append(_write_s(path, buffer, slots, checksum=True))
        files.write_part(path, buffer, slots, {}, {"step": 1})
        for _ in range(args.repeats):
            runs["read"].append(_read_s(path, check=False))
            runs["read + check"].append(_read_s(path, check=True))

    results = []
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        base = statistics.median(runs["read" if name.startswith("read") else "write"])
        results.append({"variant": name, "seconds": seconds, "median_s": median, "gb_per_s": size / median / 1e9,
                        "vs_baseline": median / base})
    rows = [f"| {r['variant']} | {r['median_s']:.3f} | {min(r['seconds']):.3f}-{max(r['seconds']):.3f} | "
            f"{r['gb_per_s']:.2f} | {r['vs_baseline']:.2f} |" for r in results]
    table = "\n".join([f"A part of {args.mb} MiB in {args.dir}, {args.repeats} repeats, interleaved",
                       "", "| variant | median s | min-max s | GB/s | vs without |", "|---|---:|---:|---:|---:|",
                       *rows])
    save_results(args.out, args, results, table)


if __name__ == "__main__":
    main()
