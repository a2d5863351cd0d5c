"""A run's curves from its metrics.jsonl: loss and throughput against step in one PNG, with resumes and checkpoints.

matplotlib is an optional dependency (`pip install 'raysft[report]'`), imported only when drawing.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from raysft.training import METRICS_FILE


@dataclass
class RunCurves:
    path: Path  # the metrics file
    steps: dict[int, dict] = field(default_factory=dict)  # step -> its row, in step order
    events: list[dict] = field(default_factory=list)
    unreadable_lines: int = 0  # a line cut short by a killed process, or a row that is not a step's or an event's

    def summary(self) -> str:
        rows = list(self.steps.values())
        resumes = sum(e["event"] == "resume" for e in self.events)
        checkpoints = sum(e["event"] == "checkpoint" for e in self.events)
        speeds = [r["tokens_per_s"] for r in rows if _number(r.get("tokens_per_s"))]
        evals = self.eval_losses()
        best = f", best eval loss {min(evals.values()):.4f} (step {min(evals, key=evals.get)})" if evals else ""
        gen = "".join(f", {name} {max(s.items())[1]:.3f} (step {max(s)})" for name, s in self.gen_scores().items())
        return (f"{len(rows)} steps (last {rows[-1]['step']}), final loss {rows[-1]['loss']:.4f}{best}{gen}, "
                f"median {statistics.median(speeds) if speeds else float('nan'):.0f} tokens/s, "
                f"checkpoints {checkpoints}, resumes {resumes}")

    def eval_losses(self) -> dict[int, float]:
        """step -> eval loss, at the steps that were validated."""
        return {s: r["eval_loss"] for s, r in self.steps.items() if _number(r.get("eval_loss"))}

    def gen_scores(self) -> dict[str, dict[int, float]]:
        """gen/<scorer> -> {checkpoint step: score}: the generation evaluations (gen_eval events), the later one of
        a step evaluated twice."""
        scores: dict[str, dict[int, float]] = {}
        for e in self.events:
            if e["event"] == "gen_eval" and isinstance(e.get("step"), int):
                for name, value in e.items():
                    if name.startswith("gen/") and _number(value):
                        scores.setdefault(name, {})[e["step"]] = value
        return {name: dict(sorted(s.items())) for name, s in scores.items()}


def read_curves(run_dir: str | os.PathLike) -> RunCurves:
    """One row per step: a resume from step s drops the rows after s that the failed attempt wrote, and a step
    written twice keeps its later row, so the curves are those of the run's surviving history."""
    curves = RunCurves(Path(run_dir).expanduser() / METRICS_FILE)
    if not curves.path.is_file():
        raise FileNotFoundError(f"{curves.path}: no metrics file (is {curves.path.parent} a raysft run directory?)")
    steps: dict[int, dict] = {}
    for line in curves.path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            curves.unreadable_lines += 1
            continue
        if row is None:
            continue
        is_event = isinstance(row, dict) and isinstance(row.get("event"), str) and \
            (row["event"] not in ("resume", "checkpoint") or isinstance(row.get("step"), int))
        if not is_event and not (isinstance(row, dict) and isinstance(row.get("step"), int) and
                                 _number(row.get("loss"))):
            curves.unreadable_lines += 1  # a row raysft did not write (no loss, say): counted, not plotted
            continue
        if is_event:
            curves.events.append(row)
            if row["event"] == "resume":
                steps = {s: r for s, r in steps.items() if s <= row["step"]}
        else:
            steps[row["step"]] = row
    if not steps:
        raise ValueError(f"{curves.path}: no training steps recorded")
    curves.steps = dict(sorted(steps.items()))
    return curves


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def draw(curves: RunCurves, out: str | os.PathLike) -> Path:
    """Loss (top: training, and eval loss where validated; the generation scores gen/<scorer> on a second axis)
    and tokens/s (bottom) against step; dashed red lines at resumes, dotted grey at checkpoints."""
    try:
        from matplotlib.figure import Figure  # a bare Figure renders with Agg: no pyplot, no display needed
    except ImportError as e:
        raise RuntimeError("drawing the report needs matplotlib: pip install 'raysft[report]'") from e
    out = Path(out).expanduser()
    steps = list(curves.steps)
    fig = Figure(figsize=(9, 6), layout="constrained")
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot(steps, [r["loss"] for r in curves.steps.values()], color="tab:blue", label="train loss")
    evals = curves.eval_losses()
    if evals:
        loss_ax.plot(list(evals), list(evals.values()), color="tab:orange", marker="o", markersize=3,
                     label="eval loss")
    loss_ax.set_ylabel("loss")
    gen = curves.gen_scores()
    if gen:  # the generation scores, 0 to 1, on an axis of their own beside the loss
        gen_ax = loss_ax.twinx()
        for name, scores in gen.items():
            gen_ax.plot(list(scores), list(scores.values()), marker="s", markersize=4, linestyle="-", label=name)
        gen_ax.set_ylim(-0.02, 1.02)
        gen_ax.set_ylabel("generation score")
        gen_ax.legend(loc="center right", fontsize=8)
    speed_ax.plot(steps, [r.get("tokens_per_s", math.nan) for r in curves.steps.values()], color="tab:green")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    marks = {"checkpoint": {"color": "grey", "linestyle": ":"}, "resume": {"color": "tab:red", "linestyle": "--"}}
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        for e in curves.events:
            if e["event"] in marks:
                ax.axvline(e["step"], linewidth=1, label=e["event"], **marks[e["event"]])
    handles = {label: h for h, label in zip(*loss_ax.get_legend_handles_labels(), strict=True)}  # one per kind
    if handles:
        loss_ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
    loss_ax.set_title(f"{curves.path.parent.name}: {curves.summary()}", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
