"""Ulysses sequence parallelism: `parallel.sequence_parallel: N`.

What bounds the longest trainable sample is one worker's activations, which grow with the sequence. Here each of
a group of N workers (the mesh's innermost dimension, "sequence": consecutive ranks, inside a node) holds 1/N of
every packed row's tokens, so every per-token activation (embeddings, norms, MLPs, the saved layer inputs of
activation checkpointing, the chunked loss) is 1/N as large. Only attention needs whole sequences: an all-to-all
before it trades the sequence split for a head split (each worker gets every token of 1/N of the heads), varlen
attention runs on the whole row with the row's sample boundaries, and an all-to-all after it trades back
(DeepSpeed-Ulysses, arXiv 2309.14509). Both all-to-alls are autograd-aware (`_AllToAll`), so the backward swaps the
gradients the same way.

The rest of the step needs no change of its own:
- RoPE takes the full row's position_ids, sliced with the tokens (each sample's positions restart at 0, so a
  sample that straddles two workers keeps its positions);
- each worker's loss is the cross-entropy of its own tokens' next-token labels (shifted before slicing, so the
  label of a slice's last token comes from the next worker's first token), divided by the label tokens of the
  whole global batch as without sequence parallelism;
- gradients: FSDP shards over every worker of the data-parallel and the sequence dimension together (the two
  flattened, `raysft.distributed.layout`), so its reduce-scatter sums every worker's partial gradient, sequence groups
  included; the trainer's loss factor (world size / global label tokens) undoes FSDP's average over all of them.
  No separate all-reduce over the sequence group is needed, and parameters, gradients and optimizer state are
  sharded N times finer as a bonus.
- the data: the N workers of a group train on the same samples; the global batch is dealt over the
  world_size / N groups (raysft.distributed.layout: `ParallelDims.place`), so every sample is still seen once per epoch.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from raysft.config import ConfigError, TrainConfig
from raysft.data import IGNORE_INDEX
from raysft.distributed.layout import SequenceShard
from raysft.model.attention import VARLEN, varlen_attention_forward
from raysft.model.loss import loss_inputs

ULYSSES = "raysft_ulysses"  # the attention name the model runs under with sequence parallelism


def check_sequence_parallel(cfg: TrainConfig, hf_config: PretrainedConfig) -> None:
    """ConfigError, on the driver, for what sequence parallelism cannot run beyond its layout (N dividing every
    worker count and the shard group: raysft.distributed.layout): the model's attention heads must divide by
    N; the row must be packed with varlen attention (SDPA would build its mask from a worker's slice, not the whole
    row) and the loss chunked (it takes labels already shifted across the slices). KV heads need not divide N: they
    are repeated up to a multiple of it."""
    n = cfg.parallel.sequence_parallel
    key = "config key 'parallel.sequence_parallel'"
    if n == 1:
        return
    if not cfg.data.packing or cfg.model.attn_implementation != VARLEN:
        raise ConfigError(f"{key}: needs data.packing: true and model.attn_implementation: {VARLEN} (got packing="
                          f"{cfg.data.packing}, {cfg.model.attn_implementation!r}): attention sees whole rows "
                          "through their sample boundaries, which only varlen takes")
    if not cfg.train.loss_chunk_tokens:
        raise ConfigError(f"{key}: needs train.loss_chunk_tokens > 0 (each worker's loss is taken at its own "
                          "tokens' positions, which the chunked loss does)")
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    if heads % n:
        raise ConfigError(f"{key}: the model has {heads} attention heads, which {n} does not divide (each worker "
                          f"attends with heads / N of them): use a divisor of {heads}")


def apply_sequence_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Run the model's attention as Ulysses over `group`: every attention module gets the group, and the model's
    attention name becomes ULYSSES (which transformers builds no mask for, as for varlen). The model gets a config
    of its own first: it shares the one it was built from, which building another model from (rank 0's full copy
    of the weights) resets to that model's attention."""
    shared, own = model.config, copy.deepcopy(model.config)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
        if type(module).__name__.endswith("Attention"):
            module.sequence_group = group
    model.set_attn_implementation(ULYSSES)


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature, on this worker's slice: query (1, heads, tokens / N, dim), key/value
    (1, kv heads, tokens / N, dim); returns (1, tokens / N, heads, dim). The varlen kwargs (cu_seq_lens_q/k,
    max_length_q/k) are the whole row's."""
    group = module.sequence_group
    n = dist.get_world_size(group)
    if key.shape[1] % n:  # GQA with fewer KV heads than workers: repeat each until their count divides N
        repeat = n // math.gcd(key.shape[1], n)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (_sequence_to_heads(t, group) for t in (query, key, value))
    out, _ = varlen_attention_forward(module, q, k, v, None, dropout, scaling, **kwargs)
    return _heads_to_sequence(out, group), None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single in equal parts along dim 0, with its backward: the gradient of what worker i received from
    worker j goes back from i to j, which is the same exchange again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, heads, tokens / N, dim) → (1, heads / N, tokens, dim): head group j goes to worker j, and the slices
    come back in rank order, which is the row's token order."""
    n = dist.get_world_size(group)
    _, heads, tokens, dim = x.shape
    send = x[0].reshape(n, heads // n, tokens, dim).contiguous()
    recv = _AllToAll.apply(send, group)  # recv[i]: worker i's tokens
    return recv.transpose(0, 1).reshape(1, heads // n, n * tokens, dim)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, tokens, heads / N, dim) → (1, tokens / N, heads, dim): the inverse of `_sequence_to_heads`."""
    n = dist.get_world_size(group)
    _, tokens, heads, dim = x.shape
    send = x[0].reshape(n, tokens // n, heads, dim).contiguous()  # send[i]: worker i's tokens
    recv = _AllToAll.apply(send, group)  # recv[j]: head group j
    return recv.transpose(0, 1).reshape(1, tokens // n, n * heads, dim)


def model_batch(batch: dict, shard: SequenceShard, pad_id: int, chunked_loss: bool) -> dict:
    """What the model takes from a collated micro-batch: this worker's slice of it under sequence parallelism,
    else the whole, with the chunked loss's inputs in place of the labels when the loss is chunked."""
    if shard.sp_size > 1:
        return split_batch(batch, shard, pad_id)
    if chunked_loss:
        batch.update(loss_inputs(batch.pop("labels")))
    return batch


def split_batch(batch: dict, shard: SequenceShard, pad_id: int) -> dict:
    """This worker's slice of a packed micro-batch (raysft.data.dataloader.collate's, with labels), with the chunked
    loss's inputs for its own tokens. The row is padded to a multiple of N here (the store keeps no padding): the
    pad tokens form one more sample of their own in the boundaries, so no real token attends to them, and their
    labels are ignored."""
    n, r = shard.sp_size, shard.sp_rank
    ids, positions, cu = batch["input_ids"], batch["position_ids"], batch["cu_seq_lens_q"]
    length = ids.shape[1]
    pad = -length % n
    targets = torch.cat([batch["labels"][:, 1:], torch.full((1, 1 + pad), IGNORE_INDEX)], dim=1)
    longest = batch["max_length_q"]
    if pad:
        ids = torch.cat([ids, torch.full((1, pad), pad_id, dtype=ids.dtype)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype)[None]], dim=1)
        cu = torch.cat([cu, torch.tensor([length + pad], dtype=cu.dtype)])
        longest = max(longest, pad)
    share = (length + pad) // n
    mine = slice(r * share, (r + 1) * share)
    local = targets[0, mine]
    (where,) = (local != IGNORE_INDEX).nonzero(as_tuple=True)
    return {"input_ids": ids[:, mine], "position_ids": positions[:, mine], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest, "loss_positions": where, "loss_targets": local[where]}


AttentionInterface.register(ULYSSES, ulysses_attention_forward)
