"""The steps of bench/gpu/check.py, one per process: `python bench/gpu/steps.py STEP WORK`, the training steps in the
environment torchrun gives its worker (check.py sets it). Each reads WORK/plan.json, which the check writes, and
writes its results to WORK/STEP.json, rewritten as it goes, so that a step stopped at its time limit still leaves
what it measured.

Everything runs on the torchrun path (raysft.run), which imports no Ray: the GPU machine has none.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as profiler

BENCH_DIR = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]  # bench's modules, and raysft from this checkout

from common import PeakSampler, Setup, rss_bytes  # noqa: E402
from throughput import SETS, computed_per_real_token, flops_per_token  # noqa: E402
from torchrun_train import summarize, synchronized_time  # noqa: E402

from raysft.checkpoint import checkpoint_dirs, read_manifest  # noqa: E402
from raysft.data import read_store  # noqa: E402
from raysft.launch.torchrun import (  # noqa: E402
    end_distributed,
    exit_process,
    init_distributed,
    launch,
    prepare_on_rank0,
    run_trainer,
)
from raysft.model.build import build_meta_model, materialize  # noqa: E402
from raysft.training.metrics import read_metrics  # noqa: E402

# The recipes of docs/BENCHMARKS.md ("The fast recipe, command by command"; bench/throughput.py's settings), most
# telling first: the fast recipe with its token budget tuned here, the padded step (full fp32 logits), LoRA on
# the fast recipe, then the others.
# The compiled recipe comes last: its compile time is the least predictable, and a step cut at its time limit keeps
# what it measured before.
VARIANTS = {"varlen": SETS["torchrun-varlen"], "full-logits": SETS["raysft-full-logits"],
            "lora": [*SETS["torchrun-varlen"], "model.lora.r=16"], "padded": SETS["raysft"],
            "packed": SETS["raysft-packed"], "compiled": SETS["raysft-compiled"]}


class Results:
    """The step's result file, rewritten after every change."""
    def __init__(self, path: Path, write: bool = True):
        self.path, self.write, self.data = path, write, {}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def save(self) -> None:
        if self.write:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(self.path)


def setup(plan: dict, key: str, work: Path) -> Setup:
    """The model of plan[key] ("model": the throughput shape; "small": determinism and checkpoints) and the
    tokenized data, in WORK/<key>; the weights, once `prepare` has written them, come from there."""
    shape = plan[key]
    args = argparse.Namespace(workers=1, seq_len=plan["seq_len"], micro_batch=plan["micro_batch"], data=plan["data"],
                              gpu=plan["gpu"], **shape)
    s = Setup(args, key, work=work / key)
    if list((s.work / "model").glob("*.safetensors")):
        s.common.append(f"model.path={s.work / 'model'}")
    return s


# ---- prepare: the models' initial weights and the tokenized data, once for every later step


def prepare(plan: dict, work: Path, out: Results) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for key in ("model", "small"):
        start = time.perf_counter()
        s = setup(plan, key, work)
        # seeded weights written once, in bf16 with bf16 compute: every launch then loads them (model.path) instead
        # of each rank 0 initializing the model on the CPU (over a minute at the 1B shape)
        torch.manual_seed(0)
        model = build_meta_model(s.model_config, "sdpa")
        materialize(model, device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02) if p.ndim > 1 else p.fill_(1.0)
        dtype = torch.bfloat16 if plan["mixed_precision"] == "bf16" else torch.float32
        model.to(device="cpu", dtype=dtype).save_pretrained(s.work / "model")
        del model
        lengths = np.array([len(x) for x in read_store(s.store, columns=["input_ids"]).column("input_ids").to_pylist()])
        out[key] = {"params": s.params, "samples": len(lengths), "mean_tokens": float(lengths.mean()),
                    "max_tokens": int(lengths.max()), "gflop_per_token": flops_per_token(s) / 1e9,
                    "seconds": time.perf_counter() - start}


# ---- training steps (torchrun's worker: raysft.run)


def build_trainer(s: Setup, ctx, name: str, sets: list[str]):
    cfg = s.config(f"run.name={name}", *sets)
    return run_trainer(cfg, prepare_on_rank0(cfg, fresh=False), ctx)


def common_sets(plan: dict) -> list[str]:
    """bench/throughput.py's settings; metrics are reduced where `measure` says, not by the trainer's cadence."""
    return [f"train.global_batch_size={plan['global_batch']}", "train.max_steps=100000",
            f"parallel.mixed_precision={plan['mixed_precision']}", "train.log_every_n_steps=100000",
            "checkpoint.every_n_steps=100000", "checkpoint.mode=sharded", "train.warmup_steps=2"]


def measure(trainer, warmup: int, steps: int) -> dict:
    """Train warmup + steps steps; the numbers of the last `steps`, between two points where the host waited for
    the device (each a reduction of the step metrics)."""
    cuda = trainer.ctx.device.type == "cuda"
    trainer.model.train()
    for _ in range(warmup):
        trainer.train_step(reduce_metrics=False)
    trainer.reduce_metrics()
    first = trainer.state.step + 1
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(reduce_metrics=False)
    last = trainer.reduce_metrics()
    seconds = time.perf_counter() - start
    rows = [m for m in read_metrics(trainer.cfg.run_dir) if "tokens" in m and m["step"] >= first]
    return {"steps": [first, trainer.state.step], "seconds": seconds, "tokens_per_s": last["tokens_per_s"],
            "mfu": last["mfu"], "computed_per_real_token": computed_per_real_token(rows, 0),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else last["peak_mem_gb"],
            "loss": last["loss"]}


def token_budgets(plan: dict, s: Setup) -> list[int]:
    """train.micro_batch_tokens to try: max_seq_len doubled until one micro-batch holds the largest global batch
    there can be (a larger budget cuts the same micro-batches)."""
    lengths = np.sort([len(x) for x in read_store(s.store, columns=["input_ids"]).column("input_ids").to_pylist()])
    most = int(lengths[-plan["global_batch"]:].sum())
    budgets = [plan["seq_len"]]
    while budgets[-1] < most and len(budgets) < plan["max_budgets"]:
        budgets.append(2 * budgets[-1])
    return budgets


def throughput(plan: dict, work: Path, out: Results) -> None:
    """Each variant of VARIANTS in turn, in this process; a variant that fails is recorded and the next one runs.
    The varlen recipe first tries each token budget and keeps the fastest that fits; the others take it."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, "model", work)
    tokens = plan["seq_len"] * plan["micro_batch"]
    variants = {}
    for variant in plan["variants"]:
        start = time.perf_counter()
        record = {"sets": VARIANTS[variant], "status": "running"}  # what a stop at the time limit leaves
        variants[variant] = record
        out["variants"] = variants
        trainer = None
        try:
            sets = [*common_sets(plan), f"train.micro_batch_size={plan['micro_batch']}",
                    *(x.format(tokens=tokens) for x in VARIANTS[variant])]
            trainer = build_trainer(s, ctx, variant, sets)
            record["build_s"] = time.perf_counter() - start
            if variant == "varlen":
                tokens, record["budgets"] = tune_budget(plan, s, trainer)
                record.update(next(b for b in record["budgets"] if b.get("micro_batch_tokens") == tokens))
            else:
                warmup = plan["warmup"] + (plan["compile_warmup"] if "parallel.compile=true" in sets else 0)
                record.update(measure(trainer, warmup, plan["steps"]),
                              micro_batch_tokens=trainer.cfg.train.micro_batch_tokens)
            record["status"] = "ok"
            out["micro_batch_tokens"] = tokens
        except Exception as e:  # noqa: BLE001 - recorded; the next variant runs
            record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            traceback.print_exc()
        finally:
            record["seconds"] = time.perf_counter() - start
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out["variants"] = variants
        print(f"check: throughput {variant}: {record['status']} "
              f"{record.get('tokens_per_s', 0):.0f} tokens/s in {record['seconds']:.0f} s", flush=True)
    end_distributed(agreed=True)


def tune_budget(plan: dict, s: Setup, trainer) -> tuple[int, list[dict]]:
    """Measure a few steps at each token budget, ascending; stop at the first that runs out of memory. The fastest
    budget that ran is kept."""
    tried = []
    for budget in token_budgets(plan, s):
        trainer.cfg.train.micro_batch_tokens = budget  # read afresh at every step (SFTStep._micro_batches)
        try:
            tried.append({"micro_batch_tokens": budget, **measure(trainer, plan["tune_warmup"], plan["tune_steps"])})
        except torch.OutOfMemoryError as e:
            tried.append({"micro_batch_tokens": budget, "error": f"OutOfMemoryError: {str(e)[:300]}"})
            break
        print(f"check: budget {budget}: {tried[-1]['tokens_per_s']:.0f} tokens/s, "
              f"{tried[-1]['peak_mem_gib']:.2f} GiB", flush=True)
    ran = [t for t in tried if "tokens_per_s" in t]
    if not ran:
        raise RuntimeError(f"no token budget fit: {tried}")
    return max(ran, key=lambda t: t["tokens_per_s"])["micro_batch_tokens"], tried


def profile(plan: dict, work: Path, out: Results) -> None:
    """torch.profiler over a few steps of the fastest variant of the throughput step, at its token budget: the
    device's busy fraction and the top kernels (counted as bench/torchrun_train.py's profile counts them), and the
    Chrome trace in WORK/profile-trace.json."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    measured = json.loads((work / "throughput.json").read_text())
    ok = {v: r for v, r in measured["variants"].items() if r["status"] == "ok"}
    best = max(ok, key=lambda v: ok[v]["tokens_per_s"])
    tokens = measured["micro_batch_tokens"]
    out["variant"], out["micro_batch_tokens"] = best, tokens
    s = setup(plan, "model", work)
    sets = [*common_sets(plan), f"train.micro_batch_size={plan['micro_batch']}",
            *(x.format(tokens=tokens) for x in VARIANTS[best])]
    trainer = build_trainer(s, ctx, f"{best}-profile", sets)
    measure(trainer, plan["warmup"] + (plan["compile_warmup"] if best == "compiled" else 0), 1)
    cuda = ctx.device.type == "cuda"
    with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = synchronized_time(cuda)
        for _ in range(plan["profile_steps"]):
            trainer.train_step(reduce_metrics=False)
        wall_s = synchronized_time(cuda) - start
    if ctx.rank == 0:
        out["summary"] = summarize(prof, wall_s, cuda, plan["profile_steps"])
        prof.export_chrome_trace(str(work / "profile-trace.json"))
    end_distributed(agreed=True)


def determinism(plan: dict, work: Path, out: Results) -> None:
    """train.deterministic with the fast recipe: a run stopped halfway (a sharded checkpoint) and resumed, against
    the same run in one go. Every step's loss and gradient norm, and the final checkpoint's files, bit for bit: the
    first half compares the same steps run twice, the second half a resume."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, "small", work)
    n = plan["det_steps"]
    sets = [*common_sets(plan), "train.deterministic=true", "data.packing=true", "model.attn_implementation=varlen",
            f"train.micro_batch_tokens={plan['seq_len'] * 2}", f"train.max_steps={n}",
            f"checkpoint.every_n_steps={n // 2}"]
    timings = {}
    for name, extra in (("ref", []), ("det", [f"train.stop_at_step={n // 2}"]), ("det", [])):
        start = time.perf_counter()
        launch(ctx, s.config(f"run.name={name}", *sets, *extra))
        timings.setdefault(name, []).append(time.perf_counter() - start)
    out["launch_s"] = timings
    if ctx.rank != 0:
        return end_distributed(agreed=True)

    def steps(name: str) -> dict[int, tuple[float, float]]:
        return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(s.work / name) if "loss" in m}

    ref, det = steps("ref"), steps("det")
    differ = [step for step in sorted(ref) if ref[step] != det.get(step)]
    out["steps"] = {str(step): {"ref": ref[step], "resumed_run": det.get(step)} for step in sorted(ref)}
    out["first_difference"] = differ[0] if differ else None
    out["same_steps_twice"] = all(step not in differ for step in range(1, n // 2 + 1))
    out["resume_bit_identical"] = not differ and len(ref) == n
    out["same_final_checkpoint_files"] = final_hashes(s.work / "ref") == final_hashes(s.work / "det")
    end_distributed(agreed=True)


def final_hashes(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the run's newest checkpoint, from its manifest, but DCP's .metadata: it holds the
    checkpoint's path and a save_id drawn afresh by every save (torch.distributed.checkpoint's StorageMeta)."""
    return {name: entry["sha256"] for name, entry in read_manifest(checkpoint_dirs(run_dir)[-1]).items()
            if name != ".metadata"}


def checkpoint(plan: dict, work: Path, out: Results) -> None:
    """How long a sharded save blocks training, sync against async, for full fine-tuning and for LoRA (adapters
    only), on the device; then the LoRA checkpoint is loaded back. Interleaved sync, async, sync, async..."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, "small", work)
    sets = [*common_sets(plan), "data.packing=true", "model.attn_implementation=varlen",
            f"train.micro_batch_tokens={plan['seq_len'] * 2}"]
    for name, extra in (("full", []), ("lora", ["model.lora.r=16"])):
        trainer = build_trainer(s, ctx, f"checkpoint-{name}", [*sets, *extra])
        trainer.model.train()
        runs = []
        for asynchronous in [False, True] * plan["saves"]:
            trainer.train_step()  # a step before each save, as in training (the first makes the optimizer state)
            trainer.checkpointer.cfg.async_save = asynchronous
            start = time.perf_counter()
            trainer.checkpointer.save(trainer.state, {})
            blocking = time.perf_counter() - start
            trainer.checkpointer.finish(trainer.state.step)
            runs.append({"async": asynchronous, "blocking_s": blocking, "save_s": time.perf_counter() - start})
        latest = checkpoint_dirs(trainer.cfg.run_dir)[-1]
        sync = sorted(r["save_s"] for r in runs if not r["async"])
        blocking = sorted(r["blocking_s"] for r in runs if r["async"])
        out[name] = {"runs": runs, "bytes": sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()),
                     "saved_step": trainer.state.step, "loaded_step": trainer.checkpointer.load(latest).step,
                     "async_blocking_over_sync_save": blocking[len(blocking) // 2] / sync[len(sync) // 2]}
        del trainer
        gc.collect()
    end_distributed(agreed=True)


def save_memory(plan: dict, work: Path, out: Results) -> None:
    """The peak memory of each rank during a save, full (the gathered state) against sharded, at the throughput
    shape after one step: the device's allocator peak above what training held before the save, and the
    process's resident host memory (sampled) above its level before."""
    ctx = init_distributed()
    out.write = ctx.rank == 0
    s = setup(plan, "model", work)
    sets = [*common_sets(plan), f"train.micro_batch_size={plan['micro_batch']}", "data.packing=true",
            "model.attn_implementation=varlen", f"train.micro_batch_tokens={plan['seq_len'] * 2}"]
    cuda = ctx.device.type == "cuda"
    for mode in ("sharded", "full"):
        trainer = build_trainer(s, ctx, f"save-{mode}", [*sets, f"checkpoint.mode={mode}"])
        trainer.model.train()
        trainer.train_step()
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        device_before, host_before = (torch.cuda.memory_allocated() if cuda else 0), rss_bytes()
        start = time.perf_counter()
        with PeakSampler(rss_bytes) as host:
            trainer.checkpointer.save(trainer.state, {})
            trainer.checkpointer.finish(trainer.state.step)
        device_peak = torch.cuda.max_memory_allocated() if cuda else 0
        out[mode] = {"rank": ctx.rank, "seconds": time.perf_counter() - start,
                     "device_peak_over_training_gib": (device_peak - device_before) / 2**30,
                     "device_peak_gib": device_peak / 2**30,
                     "host_peak_over_training_gib": (host.peak - host_before) / 2**30,
                     "host_peak_gib": host.peak / 2**30, "params": s.params}
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    end_distributed(agreed=True)


STEPS = {"prepare": prepare, "throughput": throughput, "profile": profile,
         "determinism": determinism, "checkpoint": checkpoint, "save_memory": save_memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("work", type=Path)
    args = parser.parse_args()
    plan = json.loads((args.work / "plan.json").read_text())
    out = Results(args.work / f"{args.step}.json")
    STEPS[args.step](plan, args.work, out)
    out["ray_imported"] = "ray" in sys.modules  # the GPU machine has no Ray: the torchrun path must not need it
    failed = [v for v, r in out.data.get("variants", {}).items() if r["status"] != "ok"]
    if failed:  # the step shows as failed in the summary; each recipe's error is in its record
        out["failed_variants"] = failed
    return 1 if failed else 0


if __name__ == "__main__":
    exit_process(main())  # not through interpreter finalization, as every torchrun worker of raysft
