"""What bench/recovery.py reports: per fault, the steps lost, the time from the fault (or the node's return) to the
next step and where it went, stage by stage; the tables of docs/RELIABILITY.md."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import median_span
from recovery_cluster import STAGES

HEALTH_CHECK_S = __import__("os").environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0 (Ray's default)")


def recovery_row(cfg, fault_time: float, stages_dir: Path | None = None) -> dict:
    """The first resume after `fault_time`: the step it went on from, the steps lost, the seconds to the first step
    after it, and (with `stages_dir`) those seconds stage by stage (`stage_row`)."""
    from raysft.training.metrics import read_metrics

    records = read_metrics(cfg.run_dir)
    resume = next(i for i, m in enumerate(records) if m.get("event") == "resume" and m["time"] >= fault_time)
    # the last step logged before it (after a change of width, the run went on from an earlier step: not the most)
    before = [m for m in records[:resume] if "loss" in m][-1]["step"]
    after = next(m for m in records[resume:] if "loss" in m)
    not_used = [m["reason"] for m in records if m.get("event") == "memory_tier_not_used"]
    set_aside = [m["reason"] for m in records[:resume] if m.get("event") == "memory_snapshot_set_aside" and
                 m["time"] >= fault_time]
    return {"recovery_s": round(after["time"] - fault_time, 1), "resumed_from": records[resume]["step"],
            "steps_lost": before - records[resume]["step"], "tier": records[resume].get("tier", "stored"),
            "world_size_after": records[resume]["world_size"], "memory_tier_not_used": not_used,
            "set_aside": set_aside,
            **({"stages_s": stage_row(stages_dir, fault_time, records[resume]["time"])} if stages_dir else {})}


def stage_row(stages_dir: Path, since: float, resumed_at: float) -> dict:
    """Where the seconds from `since` (a fault, a node's return) to the first step after the resume went: for the
    workers started between the two, the latest of each stage's end (the slowest rank holds the others), as a
    duration from the previous stage's (bench/recovery_cluster.stage_times)."""
    workers = [json.loads(f.read_text()) for f in stages_dir.glob("*.json")]
    started = [w for w in workers if since <= w["process"] <= resumed_at]
    if not started:
        return {}
    ends = {stage: max(w[stage] for w in started) for stage in STAGES}
    out, previous = {}, since
    for stage in STAGES:
        out[stage] = round(ends[stage] - previous, 2)
        previous = ends[stage]
    return out


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


def nodes_report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    per_node = args.workers // args.nodes
    nodes = "network-namespace nodes" if args.netns else "logical Ray nodes"
    lines = [f"{args.workers} CPU workers {args.sharding} on {args.nodes} {nodes} of {per_node}, LLaMA of "
             f"{params / 1e6:.1f}M parameters, {3 * args.every} steps, a stored checkpoint every {args.every} steps, "
             f"the fault at step {args.fault_at or args.every + 2}; memory tier every {args.memory_every} step(s) "
             "when on", "", "| layout | fault | tier | resumed from (tier) | steps lost | fault to next step (s) "
             "| bit-exact |", "|---|---|---|---|---:|---:|---|"]
    for r in results:
        if "refused" in r and not r.get("live"):
            lines.append(f"| {r['sharding']} | {r['fault']} | — | not run: the layout left after the fault is "
                         f"refused by the config ({r['refused']}) | | | |")
        elif "fault" in r and not r.get("live"):  # live rows: recovery_live.live_table
            refused = f"; refused: {r['memory_tier_not_used'][0]}" if r["memory_tier_not_used"] else ""
            refused += "".join(f"; set aside: {reason}" for reason in r.get("set_aside", []))
            lines.append(f"| {r['sharding']} | {r['fault']} | {'on' if r['tier_on'] else 'off'} | "
                         f"{r['resumed_from']} ({r['tier']}"
                         f"{refused}) | {r['steps_lost']} | {r['recovery_s']} | {'yes' if r['bit_exact'] else 'NO'} |")
    for r in results:
        if r["variant"] == "cost":
            held = ", ".join(f"{v / 2**20:.1f}" for v in r["snapshot_bytes_peak_per_node"].values())
            lines += ["", f"cost ({r['sharding']}): median step {r['step_s_tier_off']:.3f} s without the tier, "
                          f"{r['step_s_tier_on']:.3f} s with it every {args.memory_every} step(s) "
                          f"(median of {len(r['runs_on'])} runs each, alternating) "
                          f"({r['step_s_tier_on'] / r['step_s_tier_off'] - 1:+.1%}), of which the snapshot call "
                          f"held the step {(r['snapshot_call_s'] or 0) * 1e3:.1f} ms (median of "
                          f"{r['snapshot_calls']}); bit-exact: {r['bit_exact']}; "
                          f"peak MiB in memory_dir per node: {held} (plan: "
                          f"{r['planned_per_node']['in_memory_dir'] / 2**20:.1f}, beside "
                          f"{r['planned_per_node']['staging'] / 2**20:.1f} staged)"]
        if r["variant"] == "verification":
            lines += ["", f"verifying a {r['gib']} GiB checkpoint before the first step: rank 0 alone "
                          f"{', '.join(f'{t:.1f}' for t in r['rank0_s'])} s; shared over {r['ranks']} ranks "
                          f"{', '.join(f'{t:.1f}' for t in r['shared_s'])} s"]
    return "\n".join(lines + stages_table(results))


def stages_table(results: list[dict]) -> list[str]:
    """The seconds from each fault (or return) to the next step, stage by stage."""
    rows = [r for r in results if r.get("stages_s")]
    if not rows:
        return []
    lines = ["", "| layout | fault | tier | " + " | ".join(STAGES) + " | total |",
             "|---|---|---|" + "---:|" * (len(STAGES) + 1)]
    for r in rows:
        s = r["stages_s"]
        lines.append(f"| {r['sharding']} | {r['fault']} | {'on' if r['tier_on'] else 'off'} | "
                     + " | ".join(f"{s[k]:.1f}" for k in STAGES) + f" | {sum(s.values()):.1f} |")
    return lines
