"""bench/recovery.py's live legs (--faults live): live fault tolerance (live.enabled) beside the cold restart and
the memory tier, on the same cluster and model.

- cost: an uninterrupted run with live.enabled against one without it (each worker holds the whole model in one,
  shards it in the other), --live-steps steps each: the median step time of each and their ratio;
- the fault, --repeats times: one train worker SIGKILLed once step --fault-at is logged. From metrics.jsonl, whose
  step rows name the groups that took each step (live_groups):
    survivors' next step  the fault to the end of the first step after it (the step it came in, redone by the
                          groups left, on the whole global batch)
    rejoin                the fault to the end of the first step that every group took again (Ray's replacement of
                          the one group, its start, its heal from a live group)
    heal                  the replacement's first quorum, in which it fetched and loaded the live group's state
                          (its `healed` event: the wait for the others' next quorum included)
    steps lost            steps applied before the fault and trained again (every step is logged once when none)
    samples per step      each step's loss against the uninterrupted run with live.enabled: the steps before the
                          fault equal, the redone step (the whole global batch in one group's backward instead of
                          halves summed by the all-reduce) and every later one within float summation order
    weights               the final checkpoint's largest difference from that run's
  and for the cost's uninterrupted runs, each step's loss with live.enabled against the run without it: the first
  steps agree to float rounding (the same samples, the same math, another summation order), which then compounds
  over the run's steps like any change of summation order (a different world size, say)
"""

from __future__ import annotations

import argparse
import sys

from recovery_cluster import final_losses, final_weights, median_step_s, steps_of, train


def live_legs(args: argparse.Namespace, setup, cluster, base: list[str], label: str, at_step: int) -> list[dict]:
    from raysft.errors import ConfigError

    steps = max(args.live_steps, at_step + 2)
    base = [*base, f"train.max_steps={steps}"]
    live = [*base, "live.enabled=true"]
    try:
        cfg = setup.config(*live, f"run.name={label}-live-uninterrupted")
    except ConfigError as e:
        return [{"variant": f"{label} live", "live": True, "fault": "live", "refused": str(e)}]
    plain = setup.config(*base, f"run.name={label}-live-reference")
    train(cluster, plain)
    train(cluster, cfg)
    off = final_losses(plain.run_dir)
    reference = (final_losses(cfg.run_dir), final_weights(cfg))  # the faulted runs' uninterrupted twin
    results = [{"variant": f"{label} live cost", "live": True, "steps": steps, "step_s_off": median_step_s(plain),
                "step_s_live": median_step_s(cfg), "losses_first_10": loss_difference(cfg, off, range(1, 11)),
                "losses": loss_difference(cfg, off),
                "weights_max_abs_diff": weights_difference(cfg, final_weights(plain))}]
    print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
    for repeat in range(args.repeats):
        cfg = setup.config(*live, f"run.name={label}-live-{repeat}")
        fault_time, _ = train(cluster, cfg, "worker", at_step)
        results.append({"variant": f"{label} live worker", "live": True, "fault": "worker", "steps": steps,
                        **live_row(cfg, fault_time, args.workers, reference)})
        print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
    return results


def live_row(cfg, fault_time: float, workers: int, reference: tuple[dict, dict]) -> dict:
    from raysft.training.metrics import read_metrics

    rows = sorted(steps_of(cfg.run_dir), key=lambda m: m["time"])
    after = [m for m in rows if m["time"] >= fault_time]
    every = list(range(workers))
    rejoined = next((m for m in after[1:] if m["live_groups"] == every), None)
    steps = [m["step"] for m in rows]
    healed = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "healed" and m["time"] >= fault_time]
    fault_step = after[0]["step"] - 1
    losses = final_losses(cfg.run_dir)
    return {"fault_after_step": fault_step,
            "before_fault_equal": all(losses[s] == reference[0][s] for s in range(1, fault_step + 1)),
            "redone_step_loss": loss_difference(cfg, reference[0], [fault_step + 1]),
            "survivors_next_step_s": round(after[0]["time"] - fault_time, 2),
            "survivors_next_step_groups": after[0]["live_groups"],
            "rejoin_s": round(rejoined["time"] - fault_time, 2) if rejoined else None,
            "heal_quorum_s": healed[0]["quorum_s"] if healed else None,
            "healed_after_s": round(healed[0]["time"] - fault_time, 2) if healed else None,
            "rejoined_at_step": rejoined["step"] if rejoined else None,
            "steps_alone": sum(1 for m in after if m["live_groups"] != every),
            "steps_lost": len(steps) - len(set(steps)), "steps_missing": cfg.train.max_steps - len(set(steps)),
            "losses": loss_difference(cfg, reference[0]), "weights_max_abs_diff": weights_difference(cfg, reference[1])}


def loss_difference(cfg, reference: dict[int, float], steps=None) -> float:
    """The largest relative difference of a step's loss (of `steps`, default all) from the reference run's."""
    losses = final_losses(cfg.run_dir)
    assert losses.keys() == reference.keys(), (sorted(losses), sorted(reference))
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in (steps or losses))


def weights_difference(cfg, reference: dict) -> float:
    mine = final_weights(cfg)
    return max(float((mine[k].double() - reference[k].double()).abs().max()) for k in reference)


def live_table(results: list[dict], args: argparse.Namespace) -> list[str]:
    rows = [r for r in results if r.get("live")]
    if not rows:
        return []
    lines = ["", f"live fault tolerance (live.enabled), {rows[0].get('steps')} steps, one train worker SIGKILLed "
                 f"after step {args.fault_at or args.every + 2}:", "",
             "| survivors' next step (s) | groups | rejoin (s) | heal (s) | at step | steps alone | steps lost | "
             "steps before the fault equal | redone step's loss | max relative loss difference | max weight "
             "difference |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| not run: {r['refused']} | | | | | | | | | | |")
        elif r.get("fault"):
            lines.append(f"| {r['survivors_next_step_s']} | {r['survivors_next_step_groups']} | {r['rejoin_s']} | "
                         f"{r.get('heal_quorum_s')} | "
                         f"{r['rejoined_at_step']} | {r['steps_alone']} | {r['steps_lost']} | "
                         f"{'yes' if r['before_fault_equal'] else 'NO'} | {r['redone_step_loss']:.1e} | "
                         f"{r['losses']:.1e} | {r['weights_max_abs_diff']:.1e} |")
    lines += ["", "(losses and weights against the uninterrupted run with live.enabled)"]
    for r in rows:
        if "step_s_live" in r:
            lines += ["", f"cost: median step {r['step_s_off']:.3f} s without live.enabled (the model sharded over "
                          f"the workers), {r['step_s_live']:.3f} s with it (each worker the whole model, gradients "
                          f"all-reduced by torchft) ({r['step_s_live'] / r['step_s_off'] - 1:+.1%}); its losses "
                          f"against the run without it: steps 1-10 within {r['losses_first_10']:.1e} (relative), all "
                          f"{r['steps']} within {r['losses']:.1e}; final weights within "
                          f"{r['weights_max_abs_diff']:.1e}"]
    return lines
