"""Peak memory per worker for each sharding strategy: every strategy trains the same model for a few steps on its
own fresh Ray worker group, side by side in one run, and is reported against NO_SHARD (plain data parallel).

    python bench/memory.py                      # 4 CPU workers, a ~90M-parameter LLaMA, all four strategies
    python bench/memory.py --gpu --workers 8 --hidden 2048 --layers 16
    python bench/memory.py --strategies FULL_SHARD,FULL_SHARD:full   # strategy[:activation checkpointing]
    python bench/memory.py --strategies FULL_SHARD,FULL_SHARD+lora   # +lora: LoRA adapters of rank --lora-r

What is measured on every worker during the training steps (the table shows the largest over workers):
  peak tensors   the most tensor memory alive at once, by torch's FSDPMemTracker (a dispatch mode that sees every
                 allocation, on CPU as on GPU), with its split at that moment: parameters (sharded + all-gathered),
                 gradients, optimizer state, activations and temporaries
  process peak   GPU: the CUDA caching allocator's peak. CPU: the resident set size sampled every 5 ms, minus the
                 size before the model was built; it also counts what the C allocator keeps after frees
The initial weights are built before the steps (pretrained: rank 0 loads a full copy and broadcasts it; from scratch:
each rank initializes its shards, one module at a time); that peak is written to the JSON as init_peak_mib.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import MiB, PeakSampler, Setup, add_model_args, rss_bytes, save_results, trim_heap, write_rank_result


def _measure(loop: dict) -> None:
    """Runs on every worker: build the Trainer, take the training steps under a memory sampler, report."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from raysft.checkpoint import DirectorySink
    from raysft.config import config_from_dict
    from raysft.launch.ray_worker import ray_worker_context
    from raysft.training.trainer import Trainer

    ctx = ray_worker_context()
    gpu = ctx.device.type == "cuda"
    read = (lambda: torch.cuda.memory_allocated(ctx.device)) if gpu else rss_bytes
    if not gpu:
        trim_heap()
    before_model = read()
    with PeakSampler(read) as init:
        cfg = config_from_dict(loop["config"])
        trainer = Trainer(cfg, Path(loop["store"]), None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    if gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer.model.train()
    if not gpu:
        trim_heap()
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    with PeakSampler(read) as process, tracker:
        start = time.perf_counter()
        for _ in range(loop["steps"]):
            trainer.train_step()
            tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
        elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(ctx.device) if gpu else process.peak
    tensors = {k: v / MiB for k, v in tracker.get_tracker_snapshot("peak")[ctx.device].items()}
    write_rank_result(loop, ctx.rank, {"peak_tensors_mib": tensors.pop("Total"),
                                       "process_peak_mib": (peak - before_model) / MiB,
                                       "init_peak_mib": (init.peak - before_model) / MiB,
                                       "step_s": elapsed / loop["steps"], "breakdown_mib": tensors})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=4)
    parser.add_argument("--strategies", default="NO_SHARD,FULL_SHARD,SHARD_GRAD_OP,HYBRID_SHARD",
                        help="comma-separated sharding[:activation_checkpointing]; the first is the baseline")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mixed-precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--lora-r", type=int, default=16, help="model.lora.r of the +lora strategies")
    parser.add_argument("--out", default="runs/bench/memory.json")
    args = parser.parse_args(argv)

    setup = Setup(args, "memory")
    adapters = adapter_params(setup, args.lora_r)
    results = []
    for item in args.strategies.split(","):
        item, lora = item.removesuffix("+lora"), item.endswith("+lora")
        sharding, _, ac = item.partition(":")
        sets = [f"model.lora.r={args.lora_r if lora else 0}",
                f"parallel.sharding={sharding}", f"parallel.activation_checkpointing={ac or 'none'}",
                f"parallel.mixed_precision={args.mixed_precision}",
                f"parallel.cpu_offload={str(args.cpu_offload).lower()}",
                # torch's FSDPMemTracker loses track of the root module when the LM head runs in the chunked loss
                # (KeyError in its pre-backward hook, torch 2.13): measure with the full-logits loss
                "train.loss_chunk_tokens=0"]
        if sharding == "HYBRID_SHARD":  # one host: Ray sees one node, so say how big a shard group is
            sets.append(f"parallel.hsdp_shard_size={args.workers // 2}")
        name = item.replace(":", "-ac") + ("+lora" if lora else "")
        ranks = setup.run(_measure, name, {"config": setup.config(*sets).to_dict(), "steps": args.steps})
        top = max(ranks, key=lambda r: r["peak_tensors_mib"])
        results.append({"strategy": name, "breakdown_mib": top["breakdown_mib"], "ranks": ranks,
                        "model_state_theory_mib": theory(name, setup.params, args, adapters),
                        **{k: max(r[k] for r in ranks) for k in ("peak_tensors_mib", "process_peak_mib",
                                                                  "init_peak_mib", "step_s")}})
    save_results(args.out, args, results, report(results, args, setup.params, adapters))


def adapter_params(setup: Setup, r: int) -> int:
    """The LoRA parameters of rank r that model.lora's default target_modules add to the benchmark's model."""
    import torch
    from transformers import AutoModelForCausalLM

    from raysft.config import LoraConfig
    from raysft.model.lora import add_adapters

    with torch.device("meta"):
        model = add_adapters(AutoModelForCausalLM.from_config(setup.model_config), LoraConfig(r=r))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def theory(strategy: str, params: int, args: argparse.Namespace, adapters: int = 0) -> float:
    """(params + grads + AdamW's two moments) in fp32 = 16 bytes per parameter, over the shard-group size, MiB.
    With LoRA: 4 bytes per frozen base parameter, 16 per adapter parameter."""
    shards = {"NO_SHARD": 1, "HYBRID_SHARD": args.workers // 2}.get(strategy.split("-")[0].split("+")[0],
                                                                    args.workers)
    if strategy.endswith("+lora"):
        return (4 * params + 16 * adapters) / shards / MiB
    return 16 * params / shards / MiB


def report(results: list[dict], args: argparse.Namespace, params: int, adapters: int = 0) -> str:
    base = results[0]
    process = "CUDA allocator peak" if args.gpu else "RSS peak"
    lines = [f"peak memory per worker: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of "
             f"{params / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers), "
             f"{args.mixed_precision}, seq {args.seq_len} × micro-batch {args.micro_batch}, "
             f"+lora: rank {args.lora_r} on every decoder linear layer ({adapters / 1e6:.2f}M parameters), "
             f"largest value over workers, MiB", "",
             f"| strategy | peak tensors | vs {base['strategy']} | params | grads | optimizer | activations + temp "
             f"| {process} | s/step | model state in theory | measured / theory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        def part(*keys: str, b: dict = r["breakdown_mib"]) -> float:
            return sum(b.get(k, 0.0) for k in keys)

        model_state = r["model_state_theory_mib"]
        lines.append(
            f"| {r['strategy']} | {r['peak_tensors_mib']:.0f} | {r['peak_tensors_mib'] / base['peak_tensors_mib']:.2f} "
            f"| {part('Sharded Param', 'Unsharded Param', 'All Gather'):.0f} "
            f"| {part('Sharded Grad', 'Unsharded Grad', 'Reduce Scatter'):.0f} | {part('OptState'):.0f} "
            f"| {part('Activation', 'Temp', 'Inputs', 'Buffer'):.0f} | {r['process_peak_mib']:.0f} "
            f"| {r['step_s']:.2f} | {model_state:.0f} "
            f"| {part('Sharded Param', 'Sharded Grad', 'OptState') / model_state:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
