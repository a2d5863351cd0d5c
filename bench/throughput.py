"""Training throughput side by side: raysft on Ray against (a) the same Trainer under plain torchrun (what Ray
adds) and (b) a FastChat-style Hugging Face Trainer + FSDP run that pads every sequence to the maximum length,
all on the same model, tokenized data and global batch, in one invocation.

    python bench/throughput.py                                  # 2 CPU workers, small LLaMA, FastChat's dummy data
    python bench/throughput.py --gpu --workers 1 --hidden 2048 --layers 16 --intermediate 8192 --vocab 128256 \\
        --seq-len 2048 --mixed-precision bf16 --micro-batch 16 --hf-micro-batch 4 --global-batch 64

Variants (--variants, the first is the baseline of the ratios):
  torchrun            raysft.training.trainer.Trainer under torchrun, no Ray (bench/torchrun_train.py)
  raysft              raysft.train(): Ray Train, the same Trainer; batches padded to their longest sample, the
                      chunked loss (train.loss_chunk_tokens, the default)
  raysft-full-logits  the same with the loss from the model's full fp32 logits (train.loss_chunk_tokens=0)
  raysft-packed       data.packing (each micro-batch one row, no padding), SDPA with a block-causal mask
  raysft-varlen       data.packing, model.attn_implementation=varlen, micro-batches of --micro-batch-tokens
  raysft-compiled     raysft-varlen with parallel.compile
  torchrun-varlen     raysft-varlen's config under torchrun (for --profile, and Ray against torchrun)
  raysft-lora         raysft with LoRA adapters of rank --lora-r on every linear layer of the decoder (model.lora)
  torchrun-lora       raysft-lora's config under torchrun (against `torchrun`: LoRA against full fine-tuning)
  hf                  transformers.Trainer, fsdp="full_shard auto_wrap", padded to --seq-len (bench/hf_trainer.py)

Every variant reports its padding overhead: the tokens the model computed on over the real ones (1.00: none).
--profile V1,V2 (or all) runs those variants' configs once more under torchrun with torch.profiler over the
measured steps and records a summary per variant in the results (the device's busy fraction and the top kernels
or ops; bench/torchrun_train.py says how each is counted).

Throughput is real (non-padding) tokens per second per worker over the steps after --warmup, from each run's own
per-step records; each variant runs --repeats times, interleaved in alternating order, and the table shows the
median and min-max.
MFU counts 6 FLOPs per matmul parameter per token plus 12 · layers · hidden · n for attention over a sample of
n tokens (PaLM's formula; embedding lookups are free), against --peak-tflops (H100/H200 dense bf16: 989) and
against the bf16 matmul rate measured in the same run.
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

from common import BENCH_DIR, Setup, add_model_args, environment, save_results

REPO = BENCH_DIR.parent
FASTCHAT = REPO.parent / "shared" / "datasets" / "fastchat" / "dummy_conversation.json"
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


VARLEN = ["data.packing=true", "model.attn_implementation=varlen", "train.micro_batch_tokens={tokens}"]
SETS = {"torchrun": [], "raysft": [], "raysft-full-logits": ["train.loss_chunk_tokens=0"],
        "raysft-packed": ["data.packing=true"], "raysft-varlen": VARLEN, "torchrun-varlen": VARLEN,
        "raysft-compiled": [*VARLEN, "parallel.compile=true"], "hf": [],
        "raysft-lora": ["model.lora.r={lora_r}"], "torchrun-lora": ["model.lora.r={lora_r}"]}


def run_raysft(setup: Setup, cfg) -> list[dict]:
    import raysft
    from raysft.training.metrics import read_metrics

    raysft.train(cfg)
    return [m for m in read_metrics(cfg.run_dir) if "tokens" in m]


def run_torchrun(setup: Setup, cfg, profile: Path | None = None) -> list[dict]:
    from raysft.training.metrics import read_metrics

    config_file = setup.work / f"{cfg.run.name}.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    extra = ["--profile", str(profile), "--profile-from", str(setup.args.warmup + 1)] if profile else []
    def finished() -> bool:
        rows = [m for m in read_metrics(cfg.run_dir) if "tokens" in m]
        return bool(rows) and rows[-1]["step"] == cfg.train.max_steps and (profile is None or profile.is_file())

    torchrun([str(BENCH_DIR / "torchrun_train.py"), str(config_file), *extra], setup.args.workers, finished)
    return [m for m in read_metrics(cfg.run_dir) if "tokens" in m]


def run_hf(setup: Setup, name: str) -> list[dict]:
    """Per-step rows with the tokens of all ranks, like raysft's metrics."""
    a = setup.args
    out = setup.work / name
    out.mkdir()
    args = {"model_dir": str(setup.work / "model"), "store": str(setup.store), "out": str(out),
            "max_len": a.seq_len, "micro_batch": a.hf_micro_batch or a.micro_batch,
            "grad_accum": a.global_batch // ((a.hf_micro_batch or a.micro_batch) * a.workers), "steps": a.steps,
            "lr": 1e-4, "warmup": 2, "seed": 0, "mixed_precision": a.mixed_precision, "gpu": a.gpu}
    (out / "args.json").write_text(json.dumps(args))
    torchrun([str(BENCH_DIR / "hf_trainer.py"), str(out / "args.json")], a.workers,
             lambda: all((out / f"hf.rank{r}.json").is_file() for r in range(a.workers)))
    ranks = [json.loads((out / f"hf.rank{r}.json").read_text()) for r in range(a.workers)]
    rows, previous = [], 0
    for step_rows in zip(*ranks, strict=True):
        total = sum(r["tokens"] for r in step_rows)
        rows.append({"step": step_rows[0]["step"], "time": max(r["time"] for r in step_rows),
                     "tokens": total - previous, "computed_tokens": a.global_batch * a.seq_len})  # all padded
        previous = total
    return rows


def torchrun(args: list[str], workers: int, finished=lambda: False) -> None:
    """Run the workers under torchrun. A worker that aborts (SIGABRT) only while its process exits, after `finished`
    shows that every result was written, is reported and its results kept: on this CPU build a gloo process group
    torn down at interpreter exit has been seen to end in `terminate called without an active exception`, in our
    workers and in the HF Trainer's alike."""
    # Ray gives each worker OMP_NUM_THREADS = its CPUs (1); torchrun sets 1 only for more than one process
    env = {"OMP_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={workers}", *args], env=env, text=True, stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL if not os.environ.get("BENCH_VERBOSE") else None)
    if done.returncode == 0:
        return
    if "exitcode  : -6" in done.stderr and finished():
        print(f"bench: {args[0]}: a worker aborted while exiting, after writing every result; kept",
              file=sys.stderr, flush=True)
        return
    sys.stderr.write(done.stderr)
    raise subprocess.CalledProcessError(done.returncode, args)


def computed_per_real_token(rows: list[dict], warmup: int) -> float:
    """Tokens computed on (padding included) over real tokens, over the measured steps: 1.00 means no padding."""
    window = sorted(rows, key=lambda r: r["step"])[warmup:]
    return sum(r["computed_tokens"] for r in window) / sum(r["tokens"] for r in window)


def tokens_per_s_per_worker(rows: list[dict], warmup: int, workers: int) -> float:
    """Real tokens of the steps after `warmup` over the time they took, per worker. After a resume a step is
    logged twice; none happens here."""
    rows = sorted(rows, key=lambda r: r["step"])
    start, window = rows[warmup - 1], rows[warmup:]
    return sum(r["tokens"] for r in window) / (window[-1]["time"] - start["time"]) / workers


def flops_per_token(setup: Setup) -> float:
    import numpy as np

    from raysft.data import read_store

    c = setup.model_config
    lengths = np.array([len(x) for x in read_store(setup.store, columns=["input_ids"]).column("input_ids").to_pylist()])
    matmul_params = setup.params - c.vocab_size * c.hidden_size  # the input embedding is a lookup
    mean_attended = float((lengths**2).sum() / lengths.sum())  # a token of a sample of n tokens attends over n
    return 6 * matmul_params + 12 * c.num_hidden_layers * c.hidden_size * mean_attended


def measured_matmul_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=2)
    parser.set_defaults(hidden=256, layers=4, micro_batch=4, seq_len=512,
                        data=str(FASTCHAT) if FASTCHAT.is_file() else "builtin:demo")
    parser.add_argument("--variants", default="torchrun,raysft,raysft-packed,hf")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--hf-micro-batch", type=int, default=0, help="the HF run's micro-batch; 0: --micro-batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reverse", type=int, default=0, choices=[0, 1],
                        help="1: the first repeat runs the variants in reverse order (to continue a series)")
    parser.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--attn", default="sdpa", help="model.attn_implementation of the raysft runs")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="0: known GPUs' dense bf16 peak")
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help="train.micro_batch_tokens of the varlen variants; 0: --micro-batch × --seq-len")
    parser.add_argument("--lora-r", type=int, default=16, help="model.lora.r of the lora variants")
    parser.add_argument("--profile", default="", help="variants (comma-separated, or 'all') whose config to profile "
                        "once more under torchrun with torch.profiler")
    parser.add_argument("--out", default="runs/bench/throughput.json")
    args = parser.parse_args(argv)

    setup = Setup(args, "throughput")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(SETS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(SETS)}")
    tokens = args.micro_batch_tokens or args.micro_batch * args.seq_len
    # metrics are reduced (the host waits for the device) at the steps where a log line is due: the last warmup
    # step and the last step, so that the measured window starts and ends when the device has finished
    common = [f"train.global_batch_size={args.global_batch}", f"train.max_steps={args.steps}",
              f"parallel.sharding={args.sharding}", f"parallel.mixed_precision={args.mixed_precision}",
              f"model.attn_implementation={args.attn}", f"train.log_every_n_steps={args.warmup}",
              "checkpoint.every_n_steps=1000", "checkpoint.mode=sharded", "train.warmup_steps=2"]

    def variant_config(name: str, variant: str):
        return setup.config(*common, name, *(s.format(tokens=tokens, lora_r=args.lora_r) for s in SETS[variant]))

    measured: dict[str, list[float]] = {v: [] for v in variants}
    padding: dict[str, list[float]] = {v: [] for v in variants}
    peak_mem: dict[str, list[float]] = {v: [] for v in variants}
    final_loss: dict[str, list[float | None]] = {v: [] for v in variants}
    walls: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == args.reverse else variants[::-1]:  # ABC CBA: drift cancels
            name = f"{variant}-{repeat}"
            cfg = variant_config(f"run.name={name}", variant)
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            rows = (run_hf(setup, name) if variant == "hf" else
                    run_torchrun(setup, cfg) if variant.startswith("torchrun") else run_raysft(setup, cfg))
            walls[variant].append(time.perf_counter() - start)
            measured[variant].append(tokens_per_s_per_worker(rows, args.warmup, args.workers))
            padding[variant].append(computed_per_real_token(rows, args.warmup))
            peak_mem[variant] += [max(r["peak_mem_gb"] for r in rows)] if "peak_mem_gb" in rows[0] else []
            final_loss[variant].append(max(rows, key=lambda r: r["step"]).get("loss"))  # None for hf
            print(f"bench: {name}: {measured[variant][-1]:.0f} tokens/s per worker", file=sys.stderr, flush=True)

    profiles = {}
    for variant in variants:
        if variant != "hf" and (args.profile == "all" or variant in args.profile.split(",")):
            cfg = variant_config(f"run.name={variant}-profile", variant)
            print(f"bench: {variant}-profile ...", file=sys.stderr, flush=True)
            run_torchrun(setup, cfg, profile=setup.work / f"{variant}-profile.json")
            profiles[variant] = json.loads((setup.work / f"{variant}-profile.json").read_text())

    env = environment()
    peak = args.peak_tflops or next((v for k, v in DENSE_BF16_TFLOPS.items() if k in env.get("gpu", "")), 0.0)
    matmul = measured_matmul_tflops()
    fpt = flops_per_token(setup)
    base = statistics.median(measured[variants[0]])
    results = [{"variant": v, "tokens_per_s_per_worker": measured[v], "median": statistics.median(measured[v]),
                "vs_baseline": statistics.median(measured[v]) / base, "wall_s": walls[v], "final_loss": final_loss[v],
                "mfu": statistics.median(measured[v]) * fpt / (peak * 1e12) if peak else None,
                "mfu_vs_measured_matmul": statistics.median(measured[v]) * fpt / (matmul * 1e12) if matmul else None,
                "computed_per_real_token": statistics.median(padding[v]),
                "peak_mem_gb": max(peak_mem[v]) if peak_mem[v] else None, **({"profile": profiles[v]}
                                                                              if v in profiles else {})}
               for v in variants]
    save_results(args.out, args, results, report(results, args, setup, env, fpt, peak, matmul))


def report(results, args, setup, env, fpt, peak, matmul) -> str:
    device = env.get("gpu") or f"{env['cpus']} CPU cores"
    profiled = any("profile" in r for r in results)
    lines = [f"training throughput: {args.workers} {'GPU' if args.gpu else 'CPU'} worker(s) on {device}; LLaMA of "
             f"{setup.params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab "
             f"{setup.model_config.vocab_size}), {args.mixed_precision}, {args.sharding}; data "
             f"{Path(args.data).name}, max length {args.seq_len}; global batch {args.global_batch}, micro-batch "
             f"{args.micro_batch} (hf: {args.hf_micro_batch or args.micro_batch}); steps {args.warmup + 1}-"
             f"{args.steps} of {args.steps}, {args.repeats} runs each, interleaved; {fpt / 1e9:.2f} GFLOP per token",
             "", f"| variant | real tokens/s per worker, median | min-max | vs {results[0]['variant']} | "
             f"MFU{f' (peak {peak:g} TFLOP/s)' if peak else ''} | MFU vs measured matmul"
             f"{f' ({matmul:.0f} TFLOP/s)' if matmul else ''} | computed / real tokens | peak memory GiB | "
             "wall s per run |"
             + (" busy (profile) |" if profiled else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if profiled else "")]
    for r in results:
        pct = lambda x: f"{100 * x:.1f}%" if x else "-"  # noqa: E731
        lines.append(f"| {r['variant']} | {r['median']:.0f} | {min(r['tokens_per_s_per_worker']):.0f}-"
                     f"{max(r['tokens_per_s_per_worker']):.0f} | {r['vs_baseline']:.3f} | {pct(r['mfu'])} | "
                     f"{pct(r['mfu_vs_measured_matmul'])} | {r['computed_per_real_token']:.2f} | "
                     f"{r['peak_mem_gb'] if r['peak_mem_gb'] is not None else '-'} | "
                     f"{statistics.median(r['wall_s']):.0f} |"
                     + (f" {pct(r['profile']['busy_fraction']) if 'profile' in r else '-'} |" if profiled else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
