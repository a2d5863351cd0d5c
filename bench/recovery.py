"""Recovery time: how long training stands still after one of its workers dies, against how long the same run took
from launch to its first step, and how many steps the failure cost.

    python bench/recovery.py                       # 2 CPU workers, a ~75M-parameter LLaMA, full and sharded
    python bench/recovery.py --modes sharded --repeats 5 --hidden 1024 --layers 16

Every run trains on one local Ray with Ray Train's own health-check interval, checkpointing every --every steps.
Two steps after its first checkpoint, one train worker gets SIGKILL mid-step; Ray Train restarts the worker group
and raysft resumes from the latest checkpoint. From each run's metrics.jsonl:
  start       raysft.train() called (Ray already up) to the end of step 1: worker group, model, first step
  recovery    the kill to the end of the first step after resuming: failure detected, workers restarted,
              model rebuilt, checkpoint loaded, one step
  steps lost  steps trained after the checkpoint it resumed from
Runs of the checkpoint modes are interleaved in alternating order, --repeats times each.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

from common import Setup, add_model_args, median_span, save_results

HEALTH_CHECK_S = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0 (Ray's default)")


def train_worker_pids() -> list[int]:
    """This driver's Ray Train workers: descendants of the local Ray it started."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("ray::RayTrainWorker"):  # Ray's process title
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


def measure(setup: Setup, mode: str, name: str, every: int) -> dict:
    import raysft
    from raysft.training.metrics import read_metrics

    # log_every_n_steps=1: a metrics row as each step ends (rows wait for a log step), which times the kill
    cfg = setup.config(f"run.name={name}", f"checkpoint.mode={mode}", f"checkpoint.every_n_steps={every}",
                       f"train.max_steps={3 * every}", "train.log_every_n_steps=1", "scaling.max_failures=1",
                       "train.warmup_steps=1")

    def steps() -> list[dict]:
        try:
            return [m for m in read_metrics(cfg.run_dir) if "loss" in m]
        except (FileNotFoundError, ValueError):
            return []

    error: list[BaseException] = []

    def run() -> None:
        try:
            raysft.train(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error.append(e)

    launched = time.time()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while max((m["step"] for m in steps()), default=0) < every + 2:
        if not thread.is_alive():
            raise RuntimeError(f"{name} ended before the fault") from (error[0] if error else None)
        time.sleep(0.05)
    victim = train_worker_pids()[-1]
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    thread.join()
    if error:
        raise error[0]

    records = read_metrics(cfg.run_dir)
    resume = next(i for i, m in enumerate(records) if m.get("event") == "resume")
    first = next(m for m in records if "loss" in m)
    before = max(m["step"] for m in records[:resume] if "loss" in m)
    after = next(m for m in records[resume:] if "loss" in m)
    return {"start_s": first["time"] - launched, "recovery_s": after["time"] - killed,
            "steps_lost": before - records[resume]["step"], "resumed_from": records[resume]["step"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=2)
    parser.add_argument("--modes", default="full,sharded")
    parser.add_argument("--every", type=int, default=4, help="checkpoint.every_n_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/recovery.json")
    args = parser.parse_args(argv)

    import ray

    setup = Setup(args, "recovery")
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            print(f"bench: {mode}-{repeat} ...", file=sys.stderr, flush=True)
            runs[mode].append(measure(setup, mode, f"{mode}-{repeat}", args.every))
            print(f"bench: {mode}-{repeat}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    ray.shutdown()

    results = []
    for mode in modes:
        start = statistics.median(r["start_s"] for r in runs[mode])
        recovery = statistics.median(r["recovery_s"] for r in runs[mode])
        results.append({"variant": mode, "runs": runs[mode], "start_s": start, "recovery_s": recovery,
                        "recovery_vs_start": recovery / start, "steps_lost": [r["steps_lost"] for r in runs[mode]]})
    save_results(args.out, args, results, report(results, args, setup.params))


def report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    lines = [f"recovery from a killed worker: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of "
             f"{params / 1e6:.0f}M parameters, checkpoint every {args.every} steps, worker killed at step "
             f"{args.every + 2}; Ray Train health check every {HEALTH_CHECK_S} s; {args.repeats} runs each, "
             "median (min-max)",
             "", "| checkpoint mode | launch to first step (s) | kill to first step after resume (s) "
             "| recovery / launch | steps lost |", "|---|---:|---:|---:|---|"]
    for r in results:
        start, recovery = (median_span(r["runs"], k, digits=1) for k in ("start_s", "recovery_s"))
        lines.append(f"| {r['variant']} | {start} | {recovery} "
                     f"| {r['recovery_vs_start']:.2f} | {', '.join(map(str, r['steps_lost']))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
