"""Sequence parallelism (parallel.sequence_parallel) measured: activation memory per worker against sequence
length for N = 1, 2, 4, the longest sample that fits a fixed activation budget, and tokens/s against N = 1.

Each N runs N processes (gloo on CPU, NCCL with --gpu) that hold the whole model (no FSDP: model state is not what
N changes) and run forward and backward on one packed row of L tokens (samples of --sample-len tokens back to back,
so samples straddle the workers' slices), through raysft's own pieces: `split_batch`, the Ulysses attention and
the chunked loss. Activation memory per worker is, on GPU, the peak allocated during the step above what was
allocated before it; on CPU (no allocator statistics), the bytes the autograd graph saves for backward (each
storage once), which is what grows with L. The largest over the workers is reported.

    .venv/bin/python bench/sequence_parallel.py --out docs/bench/cpu-sequence-parallel.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
MiB = 2**20


def _row(length: int, sample_len: int, vocab: int) -> dict:
    """A packed micro-batch as raysft.data.dataloader.collate makes it, of random tokens, every token a label."""
    lengths = [sample_len] * (length // sample_len) + ([length % sample_len] if length % sample_len else [])
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


class _SavedBytes:
    """Bytes the autograd graph holds for backward, each storage counted once."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen and not isinstance(t, torch.nn.Parameter):
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t


def _worker(rank: int, n: int, init: str, args: argparse.Namespace, out: mp.Queue) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raysft.distributed.layout import SequenceShard
    from raysft.model.loss import install_chunked_loss
    from raysft.parallel.sequence import apply_sequence_parallel, split_batch

    device = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    if args.gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group("nccl" if args.gpu else "gloo", init_method=init, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=600))
    dtype = torch.bfloat16 if args.gpu else torch.float32
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen", dtype=dtype).to(device)
    if n > 1:
        apply_sequence_parallel(model, dist.new_group(list(range(n))))
    install_chunked_loss(model, 1024)
    shard = SequenceShard(0, 1, rank, n)
    results = {}
    for length in args.lengths:
        batch = split_batch(_row(length, args.sample_len, args.vocab), shard, pad_id=0) if n > 1 else \
            _whole(_row(length, args.sample_len, args.vocab))
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        times, memory = [], 0
        for _ in range(args.repeats + 1):  # the first is a warm-up
            saved = _SavedBytes()
            if args.gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = model.chunked_loss_sum(**batch)
            loss.backward()
            if args.gpu:
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - start)
            memory = torch.cuda.max_memory_allocated() - before if args.gpu else saved.bytes
            model.zero_grad(set_to_none=True)
        results[length] = {"memory_mib": memory / MiB, "step_s": min(times[1:])}
    everyone = [None] * n
    dist.all_gather_object(everyone, results)
    if rank == 0:
        out.put({length: {"memory_mib": max(r[length]["memory_mib"] for r in everyone),
                          "step_s": everyone[0][length]["step_s"]} for length in args.lengths})
    dist.destroy_process_group()


def _whole(batch: dict) -> dict:
    from raysft.model.loss import loss_inputs

    batch.update(loss_inputs(batch.pop("labels")))
    return batch


def measure(n: int, args: argparse.Namespace) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tempfile.mkdtemp(prefix='raysft-sp-bench-')}/pg"
    procs = [ctx.Process(target=_worker, args=(r, n, init, args, out)) for r in range(n)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4", help="the N to measure")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--sample-len", type=int, default=700, help="tokens per packed sample")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=0,
                        help="activation budget for the longest sample; 0: N = 1's memory at the second length")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/sequence-parallel.json"))
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    by_n = {n: measure(n, args) for n in sizes}
    budget = args.budget_mib or by_n[sizes[0]][args.lengths[min(1, len(args.lengths) - 1)]]["memory_mib"]
    longest = {}
    for n in sizes:  # linear in L (attention keeps O(L) with flash/per-sample SDPA): extrapolate from the largest
        top = args.lengths[-1]
        per_token = by_n[n][top]["memory_mib"] / top
        longest[n] = int(budget / per_token)
    base = by_n[sizes[0]]
    rows = [{"n": n, "length": length, **r, "memory_vs_n1": r["memory_mib"] / base[length]["memory_mib"],
             "tokens_per_s": length / r["step_s"], "tokens_per_s_vs_n1": base[length]["step_s"] / r["step_s"]}
            for n in sizes for length, r in by_n[n].items()]
    record = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "device": "cuda" if args.gpu else "cpu",
              "torch": torch.__version__, "rows": rows, "budget_mib": budget,
              "longest_in_budget_extrapolated": longest,
              "longest_vs_n1": {n: longest[n] / longest[sizes[0]] for n in sizes}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print("| N | length | activation MiB / worker | vs N=1 | tokens/s | vs N=1 |\n|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {r['length']} | {r['memory_mib']:.1f} | {r['memory_vs_n1']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_vs_n1']:.2f} |")
    print(f"\nlongest sample in {budget:.1f} MiB of activations: " +
          ", ".join(f"N={n}: {longest[n]} ({longest[n] / longest[sizes[0]]:.2f}x)" for n in sizes))


if __name__ == "__main__":
    main()
