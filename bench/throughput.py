"""Training throughput side by side: raysft on Ray against (a) the same Trainer under plain torchrun (what Ray
adds) and (b) a FastChat-style Hugging Face Trainer + FSDP run that pads every sequence to the maximum length,
all on the same model, tokenized data and global batch, in one invocation.

    python bench/throughput.py                                  # 2 CPU workers, small LLaMA, FastChat's dummy data
    python bench/throughput.py --gpu --workers 1 --hidden 2048 --layers 16 --intermediate 8192 --vocab 128256 \\
        --seq-len 2048 --mixed-precision bf16 --micro-batch 16 --hf-micro-batch 4 --global-batch 64

Variants (--variants, the first is the baseline of the ratios):
  torchrun       raysft.trainer.Trainer under torchrun, no Ray (bench/torchrun_train.py)
  raysft         raysft.train(): Ray Train, the same Trainer; batches padded to their longest sample
  raysft-packed  the same with data.packing (each micro-batch one row, no padding)
  hf             transformers.Trainer, fsdp="full_shard auto_wrap", padded to --seq-len (bench/hf_trainer.py)

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


def run_raysft(setup: Setup, cfg) -> list[dict]:
    import raysft
    from raysft.metrics import read_metrics

    raysft.train(cfg)
    return [m for m in read_metrics(cfg.run_dir) if "tokens" in m]


def run_torchrun(setup: Setup, cfg) -> list[dict]:
    from raysft.metrics import read_metrics

    config_file = setup.work / f"{cfg.run.name}.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    torchrun([str(BENCH_DIR / "torchrun_train.py"), str(config_file)], setup.args.workers)
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
    torchrun([str(BENCH_DIR / "hf_trainer.py"), str(out / "args.json")], a.workers)
    ranks = [json.loads((out / f"hf.rank{r}.json").read_text()) for r in range(a.workers)]
    rows, previous = [], 0
    for step_rows in zip(*ranks, strict=True):
        total = sum(r["tokens"] for r in step_rows)
        rows.append({"step": step_rows[0]["step"], "time": max(r["time"] for r in step_rows),
                     "tokens": total - previous})
        previous = total
    return rows


def torchrun(args: list[str], workers: int) -> None:
    # Ray gives each worker OMP_NUM_THREADS = its CPUs (1); torchrun sets 1 only for more than one process
    env = {"OMP_NUM_THREADS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                    *args], env=env, check=True, stdout=subprocess.DEVNULL if not os.environ.get("BENCH_VERBOSE")
                    else None)


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
    parser.add_argument("--out", default="runs/bench/throughput.json")
    args = parser.parse_args(argv)

    setup = Setup(args, "throughput")
    variants = args.variants.split(",")
    common = [f"train.global_batch_size={args.global_batch}", f"train.max_steps={args.steps}",
              f"parallel.sharding={args.sharding}", f"parallel.mixed_precision={args.mixed_precision}",
              f"model.attn_implementation={args.attn}", "train.log_every_n_steps=1000",
              "checkpoint.every_n_steps=1000", "checkpoint.mode=sharded", "train.warmup_steps=2"]
    measured: dict[str, list[float]] = {v: [] for v in variants}
    final_loss: dict[str, list[float | None]] = {v: [] for v in variants}
    walls: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == args.reverse else variants[::-1]:  # ABC CBA: drift cancels
            name = f"{variant}-{repeat}"
            cfg = setup.config(*common, f"run.name={name}", f"data.packing={str(variant.endswith('packed')).lower()}")
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            rows = (run_hf(setup, name) if variant == "hf" else
                    run_torchrun(setup, cfg) if variant == "torchrun" else run_raysft(setup, cfg))
            walls[variant].append(time.perf_counter() - start)
            measured[variant].append(tokens_per_s_per_worker(rows, args.warmup, args.workers))
            final_loss[variant].append(max(rows, key=lambda r: r["step"]).get("loss"))  # None for hf
            print(f"bench: {name}: {measured[variant][-1]:.0f} tokens/s per worker", file=sys.stderr, flush=True)

    env = environment()
    peak = args.peak_tflops or next((v for k, v in DENSE_BF16_TFLOPS.items() if k in env.get("gpu", "")), 0.0)
    matmul = measured_matmul_tflops()
    fpt = flops_per_token(setup)
    base = statistics.median(measured[variants[0]])
    results = [{"variant": v, "tokens_per_s_per_worker": measured[v], "median": statistics.median(measured[v]),
                "vs_baseline": statistics.median(measured[v]) / base, "wall_s": walls[v], "final_loss": final_loss[v],
                "mfu": statistics.median(measured[v]) * fpt / (peak * 1e12) if peak else None,
                "mfu_vs_measured_matmul": statistics.median(measured[v]) * fpt / (matmul * 1e12) if matmul else None}
               for v in variants]
    save_results(args.out, args, results, report(results, args, setup, env, fpt, peak, matmul))


def report(results, args, setup, env, fpt, peak, matmul) -> str:
    device = env.get("gpu") or f"{env['cpus']} CPU cores"
    lines = [f"training throughput: {args.workers} {'GPU' if args.gpu else 'CPU'} worker(s) on {device}; LLaMA of "
             f"{setup.params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab "
             f"{setup.model_config.vocab_size}), {args.mixed_precision}, {args.sharding}; data "
             f"{Path(args.data).name}, max length {args.seq_len}; global batch {args.global_batch}, micro-batch "
             f"{args.micro_batch} (hf: {args.hf_micro_batch or args.micro_batch}); steps {args.warmup + 1}-"
             f"{args.steps} of {args.steps}, {args.repeats} runs each, interleaved; {fpt / 1e9:.2f} GFLOP per token",
             "", f"| variant | real tokens/s per worker, median | min-max | vs {results[0]['variant']} | "
             f"MFU{f' (peak {peak:g} TFLOP/s)' if peak else ''} | MFU vs measured matmul"
             f"{f' ({matmul:.0f} TFLOP/s)' if matmul else ''} | wall s per run |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        pct = lambda x: f"{100 * x:.1f}%" if x else "-"  # noqa: E731
        lines.append(f"| {r['variant']} | {r['median']:.0f} | {min(r['tokens_per_s_per_worker']):.0f}-"
                     f"{max(r['tokens_per_s_per_worker']):.0f} | {r['vs_baseline']:.3f} | {pct(r['mfu'])} | "
                     f"{pct(r['mfu_vs_measured_matmul'])} | {statistics.median(r['wall_s']):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
