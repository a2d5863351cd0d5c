"""Peak memory per worker for each sharding strategy: every strategy trains the same model for a few steps on its
own fresh Ray worker group, side by side in one run, and is reported against NO_SHARD (plain data parallel).

    python bench/memory.py                      # 4 CPU workers, a ~90M-parameter LLaMA, all four strategies
    python bench/memory.py --gpu --workers 8 --hidden 2048 --layers 16
    python bench/memory.py --strategies FULL_SHARD,FULL_SHARD:full   # strategy[:activation checkpointing]

What is measured on every worker during the training steps (the table shows the largest over workers):
  peak tensors   the most tensor memory alive at once, by torch's FSDPMemTracker (a dispatch mode that sees every
                 allocation, on CPU as on GPU), with its split at that moment: parameters (sharded + all-gathered),
                 gradients, optimizer state, activations and temporaries
  process peak   GPU: the CUDA caching allocator's peak. CPU: the resident set size sampled every 5 ms, minus the
                 size before the model was built; it also counts what the C allocator keeps after frees
Rank 0 also builds one full copy of the initial weights to broadcast them; that happens before the steps and is
written to the JSON as init_peak_mib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 2**20


class PeakSampler:
    """Samples a memory reading in a background thread and keeps the largest value seen."""

    def __init__(self, read, interval_s: float = 0.005):
        self.read, self.interval_s, self.peak = read, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(loop: dict) -> None:
    """Runs on every worker: build the Trainer, take the training steps under a memory sampler, report."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from raysft.config import TrainConfig
    from raysft.launch import ray_worker_context
    from raysft.trainer import Trainer

    ctx = ray_worker_context()
    gpu = ctx.device.type == "cuda"
    read = (lambda: torch.cuda.memory_allocated(ctx.device)) if gpu else rss_bytes
    before_model = read()
    with PeakSampler(read) as init:
        trainer = Trainer(TrainConfig.from_dict(loop["config"]), Path(loop["store"]), None, lambda *a: None, ctx)
    if gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer.model.train()
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    with PeakSampler(read) as process, tracker:
        start = time.perf_counter()
        for _ in range(loop["steps"]):
            trainer.train_step()
            tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
        elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(ctx.device) if gpu else process.peak
    tensors = {k: v / MiB for k, v in tracker.get_tracker_snapshot("peak")[ctx.device].items()}
    # each rank writes its own numbers (a Ray report keeps only rank 0's)
    out = Path(loop["out"]) / f"{loop['name']}.rank{ctx.rank}.json"
    out.write_text(json.dumps({"rank": ctx.rank, "peak_tensors_mib": tensors.pop("Total"),
                               "process_peak_mib": (peak - before_model) / MiB,
                               "init_peak_mib": (init.peak - before_model) / MiB,
                               "step_s": elapsed / loop["steps"], "breakdown_mib": tensors}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--strategies", default="NO_SHARD,FULL_SHARD,SHARD_GRAD_OP,HYBRID_SHARD",
                        help="comma-separated sharding[:activation_checkpointing]; the first is the baseline")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", default="runs/bench/memory.json")
    args = parser.parse_args(argv)

    import ray
    import torch
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raysft.config import load_config
    from raysft.data import prepare_store
    from raysft.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="raysft-bench-memory-"))
    model_dir = work / "model"
    common = [f"model.config={model_dir}", f"data.max_seq_len={args.seq_len}", f"run.storage_path={work}",
              f"scaling.num_workers={args.workers}", f"train.micro_batch_size={args.micro_batch}",
              f"train.global_batch_size={args.micro_batch * args.workers}",
              f"parallel.mixed_precision={args.mixed_precision}",
              f"parallel.cpu_offload={str(args.cpu_offload).lower()}"]
    base = load_config(None, common)
    tokenizer = load_tokenizer(base.model, base.data.chat_template)
    model_config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=len(tokenizer), tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)
    model_config.save_pretrained(model_dir)
    with torch.device("meta"):
        args.params = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
    store = prepare_store(base.data, tokenizer, base.store_dir).path

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    results = []
    for item in args.strategies.split(","):
        sharding, _, ac = item.partition(":")
        sets = [f"parallel.sharding={sharding}", f"parallel.activation_checkpointing={ac or 'none'}"]
        if sharding == "HYBRID_SHARD":  # one host: Ray sees one node, so say how big a shard group is
            sets.append(f"parallel.hsdp_shard_size={args.workers // 2}")
        cfg = load_config(None, common + sets)
        name = item.replace(":", "-ac")
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        TorchTrainer(_measure, train_loop_config={"config": cfg.to_dict(), "store": str(store), "steps": args.steps,
                                                  "out": str(work), "name": name},
                     torch_config=TorchConfig(backend="nccl" if args.gpu else "gloo"),
                     scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu,
                                                  resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(name=f"bench-{name}", storage_path=str(work / "ray"))).fit()
        ranks = [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(args.workers)]
        top = max(ranks, key=lambda r: r["peak_tensors_mib"])
        results.append({"strategy": name, "breakdown_mib": top["breakdown_mib"], "ranks": ranks,
                        **{k: max(r[k] for r in ranks) for k in ("peak_tensors_mib", "process_peak_mib",
                                                                  "init_peak_mib", "step_s")}})
    ray.shutdown()

    print(report(results, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"bench: wrote {out}", file=sys.stderr)


def report(results: list[dict], args: argparse.Namespace) -> str:
    base = results[0]
    process = "CUDA allocator peak" if args.gpu else "RSS peak"
    lines = [f"peak memory per worker: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of "
             f"{args.params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers), "
             f"{args.mixed_precision}, seq {args.seq_len} × micro-batch {args.micro_batch}, "
             f"largest value over workers, MiB", "",
             f"| strategy | peak tensors | vs {base['strategy']} | params | grads | optimizer | activations + temp "
             f"| {process} | s/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        def part(*keys: str, b: dict = r["breakdown_mib"]) -> float:
            return sum(b.get(k, 0.0) for k in keys)

        lines.append(
            f"| {r['strategy']} | {r['peak_tensors_mib']:.0f} | {r['peak_tensors_mib'] / base['peak_tensors_mib']:.2f} "
            f"| {part('Sharded Param', 'Unsharded Param', 'All Gather'):.0f} "
            f"| {part('Sharded Grad', 'Unsharded Grad', 'Reduce Scatter'):.0f} | {part('OptState'):.0f} "
            f"| {part('Activation', 'Temp', 'Inputs', 'Buffer'):.0f} | {r['process_peak_mib']:.0f} "
            f"| {r['step_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
