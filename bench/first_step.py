"""Seconds a user waits for `raysft train`, side by side for source trees (this one, and another checkout to compare):
a mistyped config key's message, and the first training step of the demo config on a local Ray of the launch's own.
The trees run in turn, `--reps` times each, so a busy machine slows them alike; each figure is the median.

    python bench/first_step.py [--tree before=/path/to/checkout] [--reps 3] [--out runs/bench/first_step]

Each launch is the command a user types, `raysft train jobs/configs/demo.yaml`, with one step, no generation
evaluation, and a run directory of its own, with the tree first on PYTHONPATH (its workers inherit it). Timed from
the command's start: its exit after a config error; the "data store" line (the driver's imports and the tokenized
store); "a local Ray of its own" (Ray started); step 1 in metrics.jsonl (the workers' start, imports, model, step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = {"driver ready (store)": "raysft: data store", "Ray started": "a local Ray of its own"}


def launch(tree: Path, argv: list[str], metrics: Path | None = None) -> dict[str, float]:
    """The command's output lines, timed as they come; the first step's time from its metrics.jsonl record."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "raysft", *argv], cwd=tree, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        for name, mark in MARKS.items():
            if mark in line and name not in seen:
                seen[name] = time.time() - start
    seen["exit"] = time.time() - start
    if proc.wait() != (2 if metrics is None else 0):
        raise SystemExit(f"{tree}: raysft {' '.join(argv)} exited {proc.returncode}:\n{''.join(lines[-30:])}")
    if metrics is not None:
        step = next(json.loads(r) for r in metrics.read_text().splitlines() if '"loss"' in r)
        seen["first step"] = step["time"] - start
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="another source tree to time beside this one (repeatable)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "first_step")
    args = parser.parse_args()
    trees = {"this tree": REPO, **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}}
    times: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(args.reps):
        for name, tree in trees.items():
            runs = args.out / f"{name.replace(' ', '_')}-{rep}"
            typo = launch(tree, ["train", "jobs/configs/demo.yaml", "--set", "train.max_stepz=1"])
            sets = ["train.max_steps=1", "eval.path=''", f"run.storage_path={runs}", "run.name=first"]
            run = launch(tree, ["train", "jobs/configs/demo.yaml", *[a for s in sets for a in ("--set", s)]],
                         runs / "first" / "metrics.jsonl")
            times[name].append({"config error": typo["exit"], **run})
            print(f"rep {rep} {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times[name][-1].items()), flush=True)
    keys = ["config error", *MARKS, "first step"]
    base = next(iter(trees))
    print("\n| tree | " + " | ".join(f"{k} (s)" for k in keys) + " |\n|---|" + "---:|" * len(keys))
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in times.items()}
    for name, m in medians.items():
        ratio = "" if name == base else " / ".join(f"{m[k] / medians[base][k]:.2f}" for k in keys)
        print(f"| {name} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |" + (f" {name}/{base}: {ratio}" if ratio
                                                                                  else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "times.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
