"""Per-rank host memory and time of getting weights in and out: load, from-scratch init, full save, full resume.

A LLaMA of Llama-3.2-1B's shape by default (untied head: about 1.5B parameters) is synthesized as random bf16
weights in sharded safetensors files with an index, as transformers writes them. Each leg runs on 2 gloo workers
in fresh processes (FULL_SHARD over both), so every VmHWM is the leg's own:

- `load rank0`: rank 0 builds the whole model with from_pretrained in fp32 and broadcasts it
  (model.broadcast_from_rank0);
- `load slices`: every rank reads its own slices, a safe_open + get_slice loop (raysft.hf.weights, what training uses);
- `load dcp`: the same slices through torch's HuggingFaceStorageReader and dcp.load, to compare the two readers;
- `init rank0`: a from-scratch model built whole by rank 0 and broadcast (model.broadcast_from_rank0 without
  model.path: the way every rank got its from-scratch weights before the seeded initialization);
- `init`: a from-scratch initialization as load_initial_weights does it (each rank, one module at a time);
- `save whole`: one full checkpoint of weights and AdamW state, the whole state gathered onto rank 0 first (what
  raysft.checkpoint.full.save does with checkpoint.async, and did for every full save before issue 27);
- `save streamed`: the same checkpoint, one tensor gathered and written at a time (a synchronous full save);
- `resume rank0`: that checkpoint loaded by rank 0 and broadcast (what remote storage still takes);
- `resume slices`: every rank reading its own slices of the files (raysft.checkpoint.full.load on shared storage).

Per rank: the leg's time, VmHWM (peak resident memory of the process, reset at the leg's start), the peak of
anonymous resident memory (sampled), and what the rank held before the leg (its shards: the training floor).

    .venv/bin/python bench/load_memory.py --legs "load rank0,load slices,load dcp,init rank0,init" \\
        --out docs/bench/cpu-load-memory-1.5b.json   # the 1.5B shape: its save legs need more than 24 GiB
    .venv/bin/python bench/load_memory.py --hidden 1024 --layers 16 --intermediate 4096 --heads 16 --kv-heads 4 \\
        --out docs/bench/cpu-load-memory-0.5b.json   # every leg (docs/BENCHMARKS.md, issue 27)
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import MiB, PeakSampler, save_results

LEGS = ["load rank0", "load slices", "load dcp", "init rank0", "init", "save whole", "save streamed", "resume rank0",
        "resume slices"]


def _status_kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def _build(model_dir: str, pretrained: bool):
    """The sharded, materialized model as the trainer builds it, and its config."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from raysft.config import ModelConfig, ParallelConfig
    from raysft.distributed.layout import ParallelDims
    from raysft.model.build import build_meta_model, materialize
    from raysft.parallel.fsdp import parallelize

    config = AutoConfig.from_pretrained(model_dir)
    cfg = ModelConfig(path=model_dir if pretrained else "", config=model_dir)
    model = build_meta_model(config, "sdpa")
    parallel = ParallelConfig()
    parallelize(model, ParallelDims.from_config(parallel, [0] * dist.get_world_size()).build_mesh("cpu"), parallel)
    materialize(model, torch.device("cpu"))
    return model, cfg, config


def _training_objects(model, config):
    """What full.save and full.load use of the training objects: the model, AdamW with its state, the aliases."""
    import torch

    from raysft.checkpoint import TrainingObjects

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist, as after any training step
    optimizer.zero_grad()
    return TrainingObjects(model, optimizer, None, None, config, None, {}, None)


def _leg(rank: int, world: int, work: str, leg: str, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/pg-{leg.replace(' ', '-')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=30))
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load

    from raysft.checkpoint import full
    from raysft.hf.files import weight_files
    from raysft.hf.weights import read_local_slices, tensor_files
    from raysft.model.build import broadcast_from_rank0, load_initial_weights

    model_dir, ckpt = Path(work) / "model", Path(work) / "checkpoint"
    model, cfg, config = _build(str(model_dir), pretrained=not leg.startswith("init"))
    objs = _training_objects(model, config) if leg.startswith(("save", "resume")) else None
    if leg.startswith("resume"):
        for state in objs.optimizer.state.values():  # what the checkpoint must bring back
            for t in state.values():
                t.zero_()
    dist.barrier()
    held = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    start = time.perf_counter()
    with PeakSampler(lambda: _status_kib("RssAnon") * 1024) as anon:
        if leg in ("load rank0", "init rank0"):
            broadcast_from_rank0(model, cfg, config, seed=0)
        elif leg == "load slices":
            read_local_slices(model.state_dict(keep_vars=True), tensor_files(weight_files(model_dir)))
        elif leg == "load dcp":
            dcp_load(model.state_dict(), storage_reader=HuggingFaceStorageReader(str(model_dir)))
        elif leg == "init":
            load_initial_weights(model, cfg, config, seed=0)
        elif leg.startswith("save"):
            (ckpt / leg).mkdir(parents=True, exist_ok=True)
            full.save(ckpt / leg, objs, asynchronous=leg == "save whole").result()
        elif leg == "resume rank0":
            full.all_ranks = lambda flag: False  # the way for files that not every rank sees
            full.load(ckpt / "save streamed", objs)
        elif leg == "resume slices":
            full.load(ckpt / "save streamed", objs)
        dist.barrier()
    seconds = time.perf_counter() - start
    results.put({"leg": leg, "rank": rank, "seconds": round(seconds, 2), "held_mib": held // MiB,
                 "vmhwm_mib": _status_kib("VmHWM") // 1024, "anon_peak_mib": anon.peak // MiB})
    dist.destroy_process_group()


def _synthesize(args: argparse.Namespace, model_dir: Path) -> int:
    """Random bf16 weights of the chosen shape, saved as transformers saves them; the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size=args.shard_size)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    import multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--shard-size", default="1GB", help="safetensors file size, as save_pretrained takes it")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--out", default="docs/bench/cpu-load-memory.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="raysft-bench-load-"))
    try:
        params = _synthesize(args, work / "model")
        ctx = mp.get_context("spawn")
        results = []
        for leg in args.legs.split(","):
            queue = ctx.Queue()
            procs = [ctx.Process(target=_leg, args=(r, args.workers, str(work), leg, queue))
                     for r in range(args.workers)]
            for p in procs:
                p.start()
            got = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
            for p in procs:
                p.join()
            results.extend(got)
            print(leg, got, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [f"{r['leg']:12} {r['rank']:4} {r['seconds']:8.2f} {r['held_mib']:9} {r['vmhwm_mib']:9} "
            f"{r['anon_peak_mib']:9}" for r in results]
    table = (f"{params / 1e6:.0f}M parameters, bf16 files; {args.workers} gloo workers, FULL_SHARD, fp32 shards\n\n"
             f"{'leg':12} {'rank':>4} {'seconds':>8} {'held MiB':>9} {'VmHWM MiB':>9} {'anon peak':>9}\n" +
             "\n".join(rows))
    save_results(args.out, args, [{"parameters": params}, *results], table)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
