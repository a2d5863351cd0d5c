"""`raysft plan`: what a run will need, per worker and per host, before anything starts.

Counts come from the model's config on the meta device (no memory); the memory model is written out, with its
derivation and its check against measured peaks, in docs/MEMORY.md. Every figure is in bytes; "per worker" is one
GPU (or one CPU worker). No Ray here: the CLI passes the cluster's GPU memory when it can read it.

Terms, with P parameters (T of them trained: all, or LoRA's adapters), S the shard group's size, p and r the
bytes of parallel.mixed_precision and parallel.reduce_dtype, L the parameters of the largest decoder layer and
R those outside the decoder layers (embeddings, final norm, LM head):
  weights      4 P / S             fp32 shards (on the host with cpu_offload)
  gradients    4 T / S             fp32 shards, from the end of backward to the optimizer step
  optimizer    8 T / S             AdamW's two moments in fp32
  gathered     p (R + 2 L)         the root for the whole step, the current layer and the one prefetched
               (p (R + L) when S = 1; SHARD_GRAD_OP keeps every layer gathered: p (P + 2 L))
  in flight    L_T (p + r)         one layer's unsharded gradient and its reduce-scatter buffer
  activations  tokens x per layer  p (10 h + 3 i + 3 kv) per token and layer without checkpointing; a
                                   checkpointed layer keeps only its input (p h) and one is recomputed at a time
  logits       chunk x V (2p + 8)  the logits, fp32 log-softmax and both gradients, per loss chunk
With parallel.sequence_parallel N, each row's tokens are split over N workers: activations and logits count
tokens / N per worker, and NO_SHARD's shard group is the N workers (FSDP shards over the sequence group).
The peak is the larger of two moments: early in backward (weights, optimizer, gathered, activations, the larger
of logits and in-flight gradients) and at its end (weights, gradients, optimizer, gathered, in flight).

The memory tier (checkpoint.memory_every_n_steps, raysft.checkpoint.memory) is counted per node, in host memory:
with b a worker's part of the training state (its shards of the saved weights and of the optimizer state) and w the
node's workers, staging buffers w b, its own newest 2 snapshots 2 w b in checkpoint.memory_dir, and, with one
replica (FULL_SHARD, SHARD_GRAD_OP) on 2 nodes or more, the copies of the 2 snapshots its workers receive from the
previous node, 2 r b (r = w on nodes of one size; on uneven ones, the node that needs most is counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from raysft.checkpoint.checkpointer import FULL_SAVE_MAX_BYTES
from raysft.checkpoint.memory import partners, resolve_memory_dir
from raysft.config import TrainConfig
from raysft.distributed.layout import ParallelDims
from raysft.hf.dtypes import DTYPES
from raysft.model.build import build_meta_model, decoder_layer_classes
from raysft.model.lora import add_adapters
from raysft.training.objective import objective_for

GiB, MiB = 2**30, 2**20
# GPU memory by Ray's accelerator_type (Ray reports the model, not its memory), in vendor GB. A100 comes in 40 and
# 80 GB under one name: not guessed.
GPU_MEMORY_GB = {"H100": 80, "H200": 141, "H20": 96, "B200": 180, "L40S": 48, "L4": 24, "A10G": 24, "T4": 16,
                 "V100": 16}
_ADAMW_BYTES = 8  # exp_avg and exp_avg_sq in fp32, per trained parameter
_LOGITS_FP32_BYTES = 8  # the fp32 log-softmax and its gradient, per logit


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a model: counted on the meta device, adapters included."""

    params: int
    trainable: int
    layer_params: int  # the largest decoder layer
    layer_trainable: int
    root_params: int  # outside the decoder layers: embeddings, final norm, LM head
    largest_module: int  # the largest single module's own parameters (seeded init and export hold one at a time)
    layers: int
    hidden: int
    intermediate: int
    kv: int  # key (= value) width: KV heads x head size
    vocab: int


def model_shape(cfg: TrainConfig, hf_config: PretrainedConfig) -> ModelShape:
    with torch.device("meta"):
        model = add_adapters(build_meta_model(hf_config, cfg.model.attn_implementation), cfg.model.lora)
    classes = decoder_layer_classes(model)  # once: it walks every module
    layers = [m for m in model.modules() if isinstance(m, classes)]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    params = list(model.parameters())
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return ModelShape(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        layer_trainable=max(sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers),
        root_params=sum(p.numel() for p in params if id(p) not in in_layers),
        largest_module=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        layers=len(layers), hidden=hf_config.hidden_size, intermediate=hf_config.intermediate_size,
        kv=hf_config.num_key_value_heads * head_dim, vocab=hf_config.vocab_size)


@dataclass(frozen=True)
class Topology:
    workers: int
    nodes: int
    gpu_mem_bytes: float | None = None  # per GPU; None: unknown (no cluster and no --gpu-mem-gib)
    host_mem_bytes: float | None = None  # per node; None: unknown (no --host-mem-gib)


def micro_batch_tokens(cfg: TrainConfig) -> int:
    """The most tokens one micro-batch can hold: train.micro_batch_tokens, else micro_batch_size padded rows of
    data.max_seq_len (shorter data pads to less). train.objective dpo counts two sequences per pair: the
    micro_batch_size pairs are twice as many rows, and a token budget takes whole pairs (one longer than the budget
    goes alone: up to two rows of data.max_seq_len)."""
    t, sequences = cfg.train, objective_for(cfg).sequences_per_sample
    if t.micro_batch_tokens:
        return max(t.micro_batch_tokens, sequences * cfg.data.max_seq_len)
    return sequences * t.micro_batch_size * cfg.data.max_seq_len


def activation_bytes(cfg: TrainConfig, shape: ModelShape, tokens: int) -> float:
    """What backward needs of the forward, kept from it: per token, each layer's saved tensors, or only its input
    where the layer is checkpointed (plus one layer recomputed at a time)."""
    p = DTYPES[cfg.parallel.mixed_precision].itemsize
    per_layer = p * (10 * shape.hidden + 3 * shape.intermediate + 3 * shape.kv)
    ac = cfg.parallel.activation_checkpointing
    checkpointed = 0 if ac == "none" else math.ceil(shape.layers / (1 if ac == "full" else int(ac)))
    return tokens * ((shape.layers - checkpointed) * per_layer + checkpointed * p * shape.hidden
                     + (per_layer if checkpointed else 0))


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    topology: Topology
    dims: ParallelDims  # the workers spread evenly over the topology's nodes
    tokens: int
    terms: dict[str, float]  # per worker
    early_backward: float
    end_of_backward: float
    checkpoint_bytes: dict[str, float]  # per mode: the whole checkpoint
    save_host_bytes: dict[str, float]  # per mode: host memory of the rank that saves the most, beyond training's
    init_host_bytes: float  # host memory of the rank building the initial weights that needs most, beyond its shards
    rank0_init: str | None  # why rank 0 would load model.path whole and broadcast it (None: each rank its slices)
    host_offload_bytes: float  # per worker, with parallel.cpu_offload: its shards on the host

    @property
    def shard_group(self) -> int:
        return self.dims.shard_group_size

    @property
    def peak(self) -> float:
        return max(self.early_backward, self.end_of_backward)

    @property
    def fits(self) -> bool | None:
        return None if self.topology.gpu_mem_bytes is None else self.peak <= self.topology.gpu_mem_bytes


def plan(cfg: TrainConfig, shape: ModelShape, topology: Topology, tokens: int | None = None,
         rank0_init: str | None = None) -> Plan:
    """The memory a run of `cfg` needs on `topology`; `tokens`: the largest micro-batch (default: its bound);
    `rank0_init`: why model.path's weights would be loaded whole by rank 0 (raysft.tools.architectures'
    initial_weights_fallback), None when each rank reads its slices."""
    dims = ParallelDims.spread(cfg.parallel, topology.workers, topology.nodes)
    s = dims.shard_group_size
    p, r = DTYPES[cfg.parallel.mixed_precision].itemsize, DTYPES[cfg.parallel.reduce_dtype].itemsize
    tokens = tokens or micro_batch_tokens(cfg)
    layer = shape.layer_params
    if cfg.parallel.sharding == "SHARD_GRAD_OP":
        gathered = p * (shape.params + 2 * layer)
    else:
        gathered = p * (shape.root_params + (2 if s > 1 else 1) * layer)
    local = math.ceil(tokens / dims.sequence)  # this worker's part of the row
    chunk = min(local, cfg.train.loss_chunk_tokens) if cfg.train.loss_chunk_tokens else local
    shards = 4 * shape.params / s
    terms = {
        "weights": 0.0 if cfg.parallel.cpu_offload else shards,
        "gradients": 4 * shape.trainable / s,
        "optimizer": _ADAMW_BYTES * shape.trainable / s,
        "gathered": gathered,
        "in flight": shape.layer_trainable * (p + r),
        "activations": activation_bytes(cfg, shape, local),
        "logits": chunk * shape.vocab * (2 * p + _LOGITS_FP32_BYTES),
    }
    if cfg.parallel.cpu_offload:  # gradients and optimizer state live with the shards on the host
        offloaded = terms["gradients"] + terms["optimizer"]
        terms["gradients"] = terms["optimizer"] = 0.0
    else:
        offloaded = 0.0
    t = terms
    early = t["weights"] + t["optimizer"] + t["gathered"] + t["activations"] + max(t["logits"], t["in flight"])
    end = t["weights"] + t["gradients"] + t["optimizer"] + t["gathered"] + t["in flight"]
    saved = 4 * (shape.trainable if cfg.model.lora.r else shape.params)  # LoRA: the adapters only
    state = saved + _ADAMW_BYTES * shape.trainable
    checkpoint = {"full": state, "sharded": state}
    # full: rank 0 gathers one tensor at a time and writes it (async: all of it first, the snapshot training goes
    # on from); sharded: each rank its shards
    one_tensor = 4 * (shape.largest_module if not cfg.model.lora.r else shape.trainable)
    save_host = {"full": state if cfg.checkpoint.async_save else one_tensor, "sharded": state / s}
    # model.path: each rank reads its slices from the files, one tensor's slice at a time, unless rank 0 loads the
    # whole fp32 model and broadcasts it; from scratch: each rank builds one module at a time in full and keeps its
    # slices
    rank0_init = rank0_init if cfg.model.path else None
    if rank0_init:
        init_host = 4 * shape.params
    else:
        init_host = 4 * shape.largest_module / s if cfg.model.path else 4 * shape.largest_module
    return Plan(shape, topology, dims, tokens, terms, early, end, checkpoint, save_host, init_host, rank0_init,
                shards + offloaded if cfg.parallel.cpu_offload else 0.0)


SNAPSHOTS_KEPT = 2  # raysft.checkpoint.memory.MemoryTier's keep: the newest whole step and the one being written


@dataclass(frozen=True)
class MemoryTierHost:
    """The memory tier's host memory on the node that needs most (`memory_tier_host`)."""

    workers: int  # on that node
    terms: dict[str, float]  # staging buffers (process memory), own snapshots and partner copies (memory_dir)
    host_mem_bytes: float | None  # per node, if known

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def in_memory_dir(self) -> float:
        return self.terms["own snapshots"] + self.terms["partner copies"]

    @property
    def fits(self) -> bool | None:
        return None if self.host_mem_bytes is None else self.total <= self.host_mem_bytes

    @property
    def fits_dev_shm(self) -> bool | None:
        """Whether the snapshots fit /dev/shm at its default size, half the host memory."""
        return None if self.host_mem_bytes is None else self.in_memory_dir <= self.host_mem_bytes / 2


def memory_tier_host(cfg: TrainConfig, result: Plan) -> MemoryTierHost:
    """The memory tier's host memory on the node that needs most (raysft.checkpoint.memory): each worker's part of
    the training state (what a sharded checkpoint of it holds) in staging buffers, its newest 2 snapshots on the node
    and, when a shard has no replica on another node, the 2 of each part the node's workers receive from the
    previous node (as many as their own on nodes of one size; more on a node smaller than the one before it)."""
    dims = result.dims
    copies = not dims.replicated  # no replica on another node holds a rank's shards (one node: partners sends none)

    def parts(ranks: list[int]) -> tuple[int, int]:  # (a node's workers' own parts, the parts they receive)
        return len(ranks), sum(len(partners(dims.nodes, r)[1]) for r in ranks) if copies else 0

    own, received = max((parts(ranks) for ranks in dims.ranks_by_node.values()), key=lambda p: 3 * p[0] + 2 * p[1])
    part = result.save_host_bytes["sharded"]
    terms = {"staging buffers": own * part, "own snapshots": SNAPSHOTS_KEPT * own * part,
             "partner copies": SNAPSHOTS_KEPT * received * part}
    return MemoryTierHost(own, terms, result.topology.host_mem_bytes)


def render_memory_tier(cfg: TrainConfig, tier: MemoryTierHost, unit: str, size: float) -> list[str]:
    """The memory tier's rows of `raysft plan`."""
    every = cfg.checkpoint.memory_every_n_steps
    state = "off (checkpoint.memory_every_n_steps: 0); were it on" if not every else f"every {every} step(s)"
    lines = [f"memory tier, host memory per node of {tier.workers} worker(s) ({unit}): {state}"]
    lines += [f"  {name:<17} {value / size:9.2f}" for name, value in tier.terms.items()]
    memory_dir = resolve_memory_dir(cfg.checkpoint.memory_dir)
    lines.append(f"  total             {tier.total / size:9.2f}  ({tier.in_memory_dir / size:.2f} of it in "
                 f"{memory_dir})")
    if tier.host_mem_bytes is None:
        lines.append("  fits: unknown (give --host-mem-gib)")
    else:
        host = tier.host_mem_bytes
        lines.append(f"  fits {host / GiB:.1f} GiB of host memory per node: {'yes' if tier.fits else 'NO'} "
                     f"({tier.total / host:.0%}, beside the workers' own host memory)")
        if memory_dir.is_relative_to("/dev/shm"):
            lines.append(f"  fits /dev/shm at its default size, half the host memory ({host / 2 / GiB:.1f} GiB): "
                         f"{'yes' if tier.fits_dev_shm else 'NO (mount it larger, or set checkpoint.memory_dir)'}")
    return lines


def render(cfg: TrainConfig, result: Plan) -> str:
    """The plan as `raysft plan` prints it."""
    sh, topo = result.shape, result.topology
    unit, size = ("GiB", GiB) if result.peak >= GiB else ("MiB", MiB)
    lora = f", LoRA r={cfg.model.lora.r}: {sh.trainable / 1e6:,.1f}M trained" if cfg.model.lora.r else ""
    lines = [
        f"model: {sh.params / 1e9:.3f}B parameters ({sh.params:,}){lora}; {sh.layers} layers of "
        f"{sh.layer_params / 1e6:,.1f}M, {sh.root_params / 1e6:,.1f}M outside them",
        f"topology: {topo.workers} workers on {topo.nodes} node(s), {cfg.parallel.sharding}: shard group of "
        f"{result.shard_group}; {cfg.parallel.mixed_precision} compute, {cfg.parallel.reduce_dtype} reduce, "
        f"activation checkpointing {cfg.parallel.activation_checkpointing}, micro-batch of {result.tokens:,} tokens"
        + (f" split over sequence groups of {cfg.parallel.sequence_parallel}" if cfg.parallel.sequence_parallel > 1
           else ""),
        "", f"per worker ({unit}):"]
    lines += [f"  {name:<17} {value / size:9.2f}" for name, value in result.terms.items()]
    lines += [f"  early in backward {result.early_backward / size:9.2f}",
              f"  end of backward   {result.end_of_backward / size:9.2f}",
              f"  peak              {result.peak / size:9.2f}"]
    if cfg.parallel.cpu_offload:
        lines.append(f"  on the host (cpu_offload): {result.host_offload_bytes / size:.2f}")
    if topo.gpu_mem_bytes is None:
        lines.append("  fits: unknown (no cluster to read GPU memory from: give --gpu-mem-gib)")
    else:
        verdict = "yes" if result.fits else "NO"
        lines.append(f"  fits {topo.gpu_mem_bytes / GiB:.1f} GiB per GPU: {verdict} "
                     f"({result.peak / topo.gpu_mem_bytes:.0%}; leave a few GiB for the CUDA context, NCCL and "
                     "fragmentation)")
    lines += ["", f"checkpoint ({unit}): mode, its size, host memory of the rank that saves the most"]
    for mode in ("full", "sharded"):
        chosen = " <- checkpoint.mode" if cfg.checkpoint.mode == mode else ""
        lines.append(f"  {mode:<8} {result.checkpoint_bytes[mode] / size:9.2f} "
                     f"{result.save_host_bytes[mode] / size:9.2f}{chosen}")
    if cfg.checkpoint.mode == "auto":
        lines.append(f"  auto: full up to {FULL_SAVE_MAX_BYTES / GiB:.0f} GiB, which rank 0 writes alone"
                     f"{' (async: and while 4 x it is available on rank 0)' if cfg.checkpoint.async_save else ''}, "
                     "else sharded")
    if not cfg.checkpoint.async_save:
        lines.append("  full: one tensor at a time on rank 0 (checkpoint.async gathers the whole state first)")
    if result.rank0_init:
        source = f"rank 0 loads model.path whole and broadcasts it: {result.rank0_init}"
    elif cfg.model.path:
        source = "each rank reads its slices of model.path, one tensor at a time"
    else:
        source = "each rank, one module at a time (seeded)"
    lines += ["", f"initial weights, host memory on top of the shards: {result.init_host_bytes / size:.2f} {unit} "
                  f"({source})"]
    lines += ["", *render_memory_tier(cfg, memory_tier_host(cfg, result), unit, size)]
    return "\n".join(lines)
