"""The legs of bench/gpu/check.py that train the same step with a feature and without it, side by side in one
process: `python bench/gpu/step_legs.py LEG WORK`, in the environment torchrun gives its one worker (check.py sets
it). Each writes WORK/LEG.json as it goes (steps.Results), so that a leg stopped at its time limit keeps what it
measured.

    fp8          parallel.fp8 against bf16 on the throughput shape, the same recipe, weights and data: tokens/s, and
                 every step's loss over a few hundred steps, the mean of the last 50 within FP8_TOLERANCE of bf16's.
                 Where FP8 is refused (a CPU, a GPU without FP8), the refusal is the record: no FP8 numbers
    memory_tier  the memory tier (raysft.checkpoint.memory) every step and every 10 steps against none, interleaved:
                 step time, the time each MemoryTier.snapshot call holds the step, snapshots taken and passed over,
                 and the tier's page-locked staging buffer against `raysft plan`'s count

Both run on the torchrun path (raysft.run's Trainer): no Ray. With one GPU the memory tier has no other node to copy
to: what it costs here is its path through the step (the copy into host memory beside the step, the next optimizer
step's wait for it, the file written by its thread), not the copy to another node.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from steps import VARIANTS, Results, build_trainer, common_sets, measure, setup

from raysft.config import ConfigError
from raysft.launch.torchrun import end_distributed, exit_process, init_distributed
from raysft.tools.plan import Topology, memory_tier_host, model_shape
from raysft.tools.plan import plan as memory_plan
from raysft.training.metrics import read_metrics

# The FP8 run's loss against bf16's: the mean over its last plan["fp8_window"] steps (50 of 200 on a GPU) within this
# relative difference of bf16's. FP8 rounds every converted layer's inputs and weights to 3 mantissa bits (its
# gradients to 2), so the two runs part a little at every step; a wrong scale or cast leaves them far apart, or
# diverges.
FP8_TOLERANCE = 0.05


def free_memory() -> None:
    """What a finished run held: its compiled graphs (which keep its modules), then its memory."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- memory_tier


def private_memory_dir(work: Path, need_bytes: float) -> Path:
    """A directory of this process's own (mkdtemp: 0700) for the tier's snapshots: in /dev/shm, the node-local
    memory the tier uses by default, when it has room for `need_bytes` there; else under WORK (on disk)."""
    shm = Path("/dev/shm")
    room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    return Path(tempfile.mkdtemp(prefix="raysft-tier-", dir=shm if room > need_bytes else work))


def tier_steps(trainer, steps: int, calls: list[float]) -> None:
    """`steps` steps of Trainer.train's loop with nothing else due: each step, then the tier's snapshot call with the
    steps' metrics not yet logged, as train() makes it; the duration of each call that took a snapshot into
    `calls`."""
    memory = trainer.checkpointer.memory
    for _ in range(steps):
        trainer.train_step(reduce_metrics=False)
        if memory is not None:
            start = time.perf_counter()
            if memory.snapshot(trainer.state, trainer.totals.rows):
                calls.append(time.perf_counter() - start)


def tier_run(plan: dict, s, ctx, name: str, sets: list[str]) -> dict:
    """One run: warm-up steps (the tier allocates and page-locks its buffer meanwhile), then the measured steps
    between two waits for the device."""
    trainer = build_trainer(s, ctx, name, sets)
    memory = trainer.checkpointer.memory
    calls: list[float] = []
    try:
        trainer.model.train()
        tier_steps(trainer, plan["warmup"], [])
        trainer.reduce_metrics()
        first = trainer.state.step
        start = time.perf_counter()
        tier_steps(trainer, plan["tier_steps"], calls)
        trainer.reduce_metrics()
        seconds = time.perf_counter() - start
        record = {"steps": [first + 1, trainer.state.step], "step_s": seconds / plan["tier_steps"],
                  "snapshot_calls": len(calls), "snapshot_call_s": calls,
                  "snapshot_call_median_s": statistics.median(calls) if calls else None}
        if memory is not None:
            memory.finish()  # the last snapshot's file, written by the tier's thread, before its counts
            record.update(taken=memory.taken, skipped=memory.skipped, off=memory.off,
                          skip_reasons=sorted(memory.skip_reasons), staging_bytes=memory.stager.nbytes)
        return record
    finally:
        if memory is not None:
            memory.close(remove=True)  # its snapshots and page-locked buffer, before the next run's
        del trainer, memory
        free_memory()


def memory_tier(plan: dict, work: Path, out: Results) -> None:
    """The small model's fast recipe without the tier, with it every 10 steps and every step, in alternating order
    over the rounds; the medians over the rounds, and each run."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, plan["tier_model"], work)
    sets = [*common_sets(plan), "data.packing=true", "model.attn_implementation=varlen",
            f"train.micro_batch_tokens={plan['seq_len'] * 2}"]
    every = {"none": 0, **{f"every_{n}": n for n in plan["tier_every"]}}
    cfg = s.config(*sets, f"checkpoint.memory_every_n_steps={min(plan['tier_every'])}")
    tier = memory_tier_host(cfg, memory_plan(cfg, model_shape(cfg, s.model_config), Topology(1, 1)))
    memory_dir = private_memory_dir(work, 1.5 * tier.in_memory_dir)
    out["memory_dir"], out["planned_staging_bytes"] = str(memory_dir), tier.terms["staging buffers"]
    out["model"], out["params"] = plan["tier_model"], s.params
    runs: dict[str, list[dict]] = {name: [] for name in every}
    for i in range(plan["tier_rounds"]):
        for name in (list(every) if i % 2 == 0 else list(every)[::-1]):
            extra = [f"checkpoint.memory_every_n_steps={every[name]}", f"checkpoint.memory_dir={memory_dir}"]
            try:
                runs[name].append(tier_run(plan, s, ctx, f"tier-{name}-{i}", [*sets, *extra]))
            except Exception as e:  # noqa: BLE001 - recorded; the next run goes on
                runs[name].append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
                traceback.print_exc()
            out["runs"] = runs
            print(f"check: memory_tier {name} round {i}: {runs[name][-1].get('step_s', 'failed')}", flush=True)
    shutil.rmtree(memory_dir, ignore_errors=True)
    step_s = {name: statistics.median(r["step_s"] for r in rs if "step_s" in r) for name, rs in runs.items()
              if any("step_s" in r for r in rs)}
    out["step_s"] = step_s
    if "none" in step_s:
        out["over_none"] = {name: v / step_s["none"] for name, v in step_s.items() if name != "none"}
    calls = [c for name, rs in runs.items() for r in rs for c in r.get("snapshot_call_s", [])]
    out["snapshot_call_median_s"] = statistics.median(calls) if calls else None
    staged = [r["staging_bytes"] for rs in runs.values() for r in rs if r.get("staging_bytes")]
    if staged:
        out["staging_bytes"] = max(staged)
        out["staging_over_plan"] = max(staged) / out.data["planned_staging_bytes"]
    out["ok"] = all("step_s" in r for rs in runs.values() for r in rs) and bool(calls)
    end_distributed(agreed=True)


# ---- fp8


def fp8_run(plan: dict, s, ctx, name: str, sets: list[str], record: dict) -> None:
    """One run of plan["fp8_steps"] steps into `record`: tokens/s, MFU and peak memory of the steps after the
    warm-up (compile included), and every step's loss."""
    trainer = build_trainer(s, ctx, name, sets)
    try:
        record["fp8_layers"] = sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())
        warmup = plan["warmup"] + (plan["compile_warmup"] if "parallel.compile=true" in sets else 0)
        record.update(measure(trainer, warmup, plan["fp8_steps"] - warmup))
        rows = sorted((m["step"], m["loss"]) for m in read_metrics(trainer.cfg.run_dir) if "loss" in m)
        record["losses"] = [loss for _, loss in rows]
        record["status"] = "ok"
    finally:
        del trainer
        free_memory()


def fp8(plan: dict, work: Path, out: Results) -> None:
    """bf16, then FP8, on the throughput shape with plan["fp8_recipe"] at plan["fp8_tokens"] tokens a micro-batch,
    from the same prepared weights, over the same batches, with a learning rate fit for a model of this size; then
    the comparison."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, "model", work)
    n = plan["fp8_steps"]
    sets = [*common_sets(plan), f"train.micro_batch_size={plan['micro_batch']}",
            *(x.format(tokens=plan["fp8_tokens"]) for x in VARIANTS[plan["fp8_recipe"]]),
            f"train.max_steps={n}", f"train.lr={plan['fp8_lr']}", f"train.warmup_steps={max(1, n // 10)}"]
    out["recipe"], out["steps"], out["sets"] = plan["fp8_recipe"], n, sets
    out["mfu_against"] = "the GPU's dense bf16 peak, for both"
    variants: dict[str, dict] = {}
    for name, extra in (("bf16", []), ("fp8", ["parallel.fp8=true"])):
        record = variants[name] = {"status": "running"}
        out["variants"] = variants
        start = time.perf_counter()
        try:
            fp8_run(plan, s, ctx, f"fp8-leg-{name}", [*sets, *extra], record)
        except ConfigError as e:  # FP8 refused where it cannot run: the reason is the result
            record.update(status="refused", reason=str(e))
        except Exception as e:  # noqa: BLE001 - recorded; the comparison says what is missing
            record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            traceback.print_exc()
        record["seconds"] = time.perf_counter() - start
        out["variants"] = variants
        print(f"check: fp8 {name}: {record['status']} {record.get('tokens_per_s', 0):.0f} tokens/s", flush=True)
    out["comparison"] = compare(variants["bf16"], variants["fp8"], plan["fp8_window"])
    end_distributed(agreed=True)


def compare(bf16: dict, fp8: dict, window: int) -> dict | None:
    """FP8 against bf16: throughput, and the mean loss of the last `window` steps within FP8_TOLERANCE; None when
    either did not train."""
    if bf16.get("status") != "ok" or fp8.get("status") != "ok":
        return None
    a, b = bf16["losses"], fp8["losses"]
    tail_a, tail_b = statistics.fmean(a[-window:]), statistics.fmean(b[-window:])
    relative = abs(tail_b - tail_a) / tail_a
    step_differences = [abs(y - x) / x for x, y in zip(a, b, strict=True)]
    return {"fp8_over_bf16_tokens_per_s": fp8["tokens_per_s"] / bf16["tokens_per_s"],
            "window": window, "bf16_mean_loss": tail_a, "fp8_mean_loss": tail_b, "relative_difference": relative,
            "tolerance": FP8_TOLERANCE, "loss_within_tolerance": relative <= FP8_TOLERANCE,
            "step_relative_difference_median": statistics.median(step_differences),
            "step_relative_difference_max": max(step_differences)}


LEGS = {"memory_tier": memory_tier, "fp8": fp8}


def main() -> int:
    leg, work = sys.argv[1], Path(sys.argv[2])
    plan = json.loads((work / "plan.json").read_text())
    out = Results(work / f"{leg}.json")
    LEGS[leg](plan, work, out)
    out["ray_imported"] = "ray" in sys.modules  # the GPU machine has no Ray: the torchrun path must not need it
    if leg == "memory_tier":
        return 0 if out.data.get("ok") else 1
    bf16, fp8_record = out.data["variants"]["bf16"], out.data["variants"]["fp8"]
    # on a CPU FP8 is refused, and that is the record; on a GPU it must have trained
    fp8_done = fp8_record["status"] == "ok" or (not plan["gpu"] and fp8_record["status"] == "refused")
    return 0 if bf16["status"] == "ok" and fp8_done else 1


if __name__ == "__main__":
    exit_process(main())  # not through interpreter finalization, as every torchrun worker of raysft
