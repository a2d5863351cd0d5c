"""Generation evaluation's cost to training, and how soon a checkpoint's scores arrive, side by side in one run:

    python bench/gen_eval.py    # the demo (jobs/configs/demo.yaml) on 2 Ray workers, 100 steps, a checkpoint every 10

- none: the demo without its eval section (eval.path empty).
- async: the demo's eval section (builtin:demo-eval: 40 prompts, 32 new tokens, the base at step 0 too): each
  checkpoint scored by Ray's validation task on a CPU of its own (the CLI's local Ray gets one more CPU for it).
Each variant runs --repeats times, alternating, through `raysft train` (its own local Ray, a private RAY_TMPDIR).

Step time: the time between consecutive steps' rows in metrics.jsonl (every step logged), after --warmup steps;
the median is a step's own cost, the mean also carries the checkpoints and, with evaluation, whatever an evaluation
running beside the workers takes from them (on a machine with fewer cores than workers + 1, CPU time); the steps
are split into those that ran while an evaluation did and the others, each with its median. Registration to
scores: from the checkpoint's event in metrics.jsonl (written when the checkpoint is committed and reported to Ray)
to its record's finish time in <run>/gen_evals/; `queued` is the part before the evaluation started (Ray's task
start, the imports, an earlier evaluation still running: Ray runs one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH_DIR, save_results

REPO = BENCH_DIR.parent


def train(work: Path, name: str, args: argparse.Namespace, evaluate: bool) -> tuple[list[dict], list[dict], float]:
    """One `raysft train` of the demo: its metrics.jsonl records, its evaluation records, its wall time."""
    sets = [f"run.storage_path={work}", f"run.name={name}", f"train.max_steps={args.steps}",
            f"checkpoint.every_n_steps={args.every}", "train.log_every_n_steps=1",
            *([] if evaluate else ["eval.path="])]
    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # a Ray of its own, short socket paths
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}
    start = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "raysft", "train", "jobs/configs/demo.yaml",
                        *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env, check=True,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        sys.exit(f"bench: {name} failed:\n{e.stdout[-3000:]}\n{e.stderr[-3000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    wall = time.perf_counter() - start
    run = work / name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(p.read_text()) for p in sorted((run / "gen_evals").glob("*.json"))] if evaluate else []
    return records, evals, wall


def measure(records: list[dict], evals: list[dict], warmup: int) -> dict:
    rows = [m for m in records if "loss" in m]
    times = {m["step"]: m["time"] for m in rows}
    steps = [(s, times[s] - times[s - 1]) for s in sorted(times) if s - 1 in times and s > warmup]
    busy = [(e["started"], e["finished"]) for e in evals]
    overlaps = {s for s, _ in steps if any(a <= times[s] and times[s - 1] <= b for a, b in busy)}
    during = [d for s, d in steps if s in overlaps]
    outside = [d for s, d in steps if s not in overlaps]
    registered = {m["step"]: m["time"] for m in records if m.get("event") == "checkpoint"}
    latency = [e["finished"] - registered[e["step"]] for e in evals if e["step"] in registered]
    queued = [e["started"] - registered[e["step"]] for e in evals if e["step"] in registered]
    out = {"steps": len(steps), "median_step_ms": 1000 * statistics.median(d for _, d in steps),
           "mean_step_ms": 1000 * statistics.mean(d for _, d in steps),
           "during_eval_median_step_ms": 1000 * statistics.median(during) if during else None,
           "outside_eval_median_step_ms": 1000 * statistics.median(outside), "steps_during_eval": len(during),
           "evaluations": len(evals), "final_loss": rows[-1]["loss"]}
    if evals:
        out.update(registration_to_scores_s=sorted(round(x, 2) for x in latency),
                   queued_s=sorted(round(x, 2) for x in queued),
                   evaluation_s=sorted(round(e["seconds"], 2) for e in evals),
                   scores={e["step"]: e["metrics"] for e in sorted(evals, key=lambda e: e["step"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every_n_steps")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "cpu-gen-eval.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="raysft-bench-gen-eval-"))
    results = []
    try:
        for repeat in range(args.repeats):
            for variant in ("none", "async"):
                load = os.getloadavg()[0]
                records, evals, wall = train(work, f"{variant}-{repeat}", args, variant == "async")
                results.append({"variant": variant, "repeat": repeat, "wall_s": round(wall, 1), "load_before": load,
                                **measure(records, evals, args.warmup)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["| variant | repeat | median step ms | mean step ms | median step ms outside evaluations (steps) | "
             "median step ms during one (steps) | wall s | evaluations | registration to scores s (median, max) | "
             "of which queued s (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        during = (f"{r['during_eval_median_step_ms']:.0f} ({r['steps_during_eval']})"
                  if r["during_eval_median_step_ms"] else "-")
        outside = f"{r['outside_eval_median_step_ms']:.0f} ({r['steps'] - r['steps_during_eval']})"
        latency = (f"{statistics.median(r['registration_to_scores_s']):.1f}, {max(r['registration_to_scores_s']):.1f}"
                   if r["evaluations"] else "-")
        queued = f"{statistics.median(r['queued_s']):.1f}" if r["evaluations"] else "-"
        lines.append(f"| {r['variant']} | {r['repeat']} | {r['median_step_ms']:.0f} | {r['mean_step_ms']:.0f} | "
                     f"{outside} | {during} | {r['wall_s']} | {r['evaluations']} | {latency} | {queued} |")
    save_results(args.out, args, results, "\n".join(lines))


if __name__ == "__main__":
    main()
