"""What this machine allows a checkpoint at best: the floors under bench/checkpoint.py's figures, in one run.

Each worker holds its share of the state as one flat fp32 tensor (the 75M-parameter LLaMA's weights and AdamW
state: 903 MB over 2 workers by default) and the workers do, side by side, only the unavoidable part of a save,
with nothing of DCP, FSDP or Ray around it:

- `write`: every worker writes its share into its own file and fsyncs it (the disk limit for that many writers);
- `write + sha256`: the same, hashing each chunk as it is written (what the manifest needs), and `write + crc32`
  with a cheaper, non-cryptographic checksum instead;
- `write || sha256`: the hash in a second thread beside the write, to show whether the two overlap;
- `gather to rank 0`: the whole state onto rank 0, the first half of a full (rank-0, safetensors) save, and
  `gather, rank 0 writes + sha256`: all of it, rank 0 then writing and hashing the whole state alone.

Every figure is the slowest worker's, median of `--repeats`, against `dd conv=fdatasync` of the same size in the
same run. A save of the real trainer cannot beat its floor: it does all of this and more (serialization,
planning, the manifest, the rename, Ray's registration).

    .venv/bin/python bench/checkpoint_floor.py --out docs/bench/cpu-checkpoint-floor.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import MiB, disk_write_gbps, save_results

CHUNK = 8 * MiB


def _worker(rank: int, world: int, work: str, share_bytes: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    torch.set_num_threads(1)
    share = torch.randn(share_bytes // 4)
    data = memoryview(share.numpy()).cast("B")
    path = Path(work) / f"rank{rank}.bin"
    hasher = ThreadPoolExecutor(1)

    def write(checksum: Callable[[memoryview], None] | None = None, beside: bool = False) -> None:
        pending = None
        with open(path, "wb") as f:
            for start in range(0, len(data), CHUNK):
                chunk = data[start:start + CHUNK]
                if beside:  # hashed by the other thread while this one writes (both release the GIL)
                    if pending is not None:
                        pending.result()
                    pending = hasher.submit(checksum, chunk)
                elif checksum is not None:
                    checksum(chunk)
                f.write(chunk)
            if pending is not None:
                pending.result()
            f.flush()
            os.fsync(f.fileno())

    def crc32() -> Callable[[memoryview], None]:
        running = [0]

        def update(chunk: memoryview) -> None:
            running[0] = zlib.crc32(chunk, running[0])
        return update

    def gather(then_write: bool = False) -> None:
        everything = [torch.empty_like(share) for _ in range(world)] if rank == 0 else None
        dist.gather(share, everything, dst=0)
        if then_write and rank == 0:  # one writer, as the full layout's rank 0
            sha256 = hashlib.sha256()
            with open(path, "wb") as f:
                for part in everything:
                    part_bytes = memoryview(part.numpy()).cast("B")
                    for start in range(0, len(part_bytes), CHUNK):
                        sha256.update(part_bytes[start:start + CHUNK])
                        f.write(part_bytes[start:start + CHUNK])
                f.flush()
                os.fsync(f.fileno())

    floors: dict[str, Callable[[], None]] = {
        "write": write,
        "write + sha256": lambda: write(hashlib.sha256().update),
        "write || sha256": lambda: write(hashlib.sha256().update, beside=True),
        "write + crc32": lambda: write(crc32()),
        "gather to rank 0": gather,
        "gather, rank 0 writes + sha256": lambda: gather(then_write=True),
    }
    write()  # a warm-up: the first write into a new file system area is slower than any later one
    path.unlink()
    times: dict[str, list[float]] = {}
    names = list(floors)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each floor first in turn
            fn = floors[name]
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest worker's
            times.setdefault(name, []).append(elapsed.item())
            path.unlink(missing_ok=True)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--state-mb", type=int, default=903, help="the whole state, split over the workers (MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temporary directory, where "
                        "bench/checkpoint.py writes)")
    parser.add_argument("--out", default="runs/bench/checkpoint-floor.json")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="raysft-bench-floor-", dir=args.dir))
    try:
        size = args.state_mb * 10**6
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, args.workers, str(work), size // args.workers, args.repeats,
                                                   results)) for r in range(args.workers)]
        for p in procs:
            p.start()
        times = results.get(timeout=1800)
        for p in procs:
            p.join()
        dd = [size / (disk_write_gbps(work, size // MiB) * 1e9) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    dd_s = statistics.median(dd)
    rows = [{"floor": "dd (one writer)", "seconds": dd_s, "runs": dd, "vs_dd": 1.0}]
    rows += [{"floor": name, "seconds": statistics.median(runs), "runs": runs,
              "vs_dd": dd_s / statistics.median(runs)} for name, runs in times.items()]
    lines = [f"checkpoint floors: {args.workers} workers, {args.state_mb} MB of state in all; the slowest worker, "
             f"median of {args.repeats} (min-max); vs dd: dd's time over this one (a bandwidth ratio)", "",
             "| floor | seconds | GB/s | vs dd |", "|---|---:|---:|---:|"]
    lines += [f"| {r['floor']} | {r['seconds']:.3f} ({min(r['runs']):.3f}-{max(r['runs']):.3f}) | "
              f"{size / r['seconds'] / 1e9:.2f} | {r['vs_dd']:.2f} |" for r in rows]
    save_results(args.out, args, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
