"""Parallelism, applied in one place: the device mesh and FSDP2 for each sharding strategy.

PyTorch's FSDP1 names map onto FSDP2 as follows; all four use the same `fully_shard` code path:
  FULL_SHARD     1-D mesh ("shard",) over all workers, params resharded after forward
  SHARD_GRAD_OP  same mesh, params kept unsharded between forward and backward
  HYBRID_SHARD   2-D mesh ("replicate", "shard"): shard inside a node (or hsdp_shard_size workers), replicate across
  NO_SHARD       2-D mesh (world, 1): every worker holds everything, gradients are all-reduced (data parallel)

With `sequence_parallel: N` the layout gets a third, innermost dimension, "sequence" (N consecutive ranks, one
process group each, raysft.parallel.sequence), carved out of "shard" (out of "replicate" for NO_SHARD); FSDP's
mesh folds it back into "shard", so every worker's partial gradient is summed in the reduce-scatter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from raysft.config import ConfigError, ParallelConfig, parallel_layout, sequence_layout
from raysft.model.build import decoder_layer_classes
from raysft.parallel.sequence import apply_sequence_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MeshShape:
    """(replicate, shard, sequence) sizes; validated before any process group or model exists."""

    replicate: int
    shard: int
    sequence: int = 1

    @property
    def dims(self) -> tuple[int, ...]:
        """FSDP's mesh: the sequence dimension folded into "shard"."""
        shard = self.shard * self.sequence
        return (shard,) if self.replicate == 1 else (self.replicate, shard)

    @property
    def names(self) -> tuple[str, ...]:
        return ("shard",) if self.replicate == 1 else ("replicate", "shard")


def mesh_shape(cfg: ParallelConfig, node_ranks: Sequence[int]) -> MeshShape:
    """The mesh for `cfg.sharding` and `cfg.sequence_parallel`, given every worker's node rank in world-rank order
    (Ray groups each node's workers under consecutive ranks), checked by raysft.config's parallel_layout and
    sequence_layout. Raises ConfigError before any model is built."""
    fixed = parallel_layout(cfg, len(node_ranks))
    return MeshShape(*(fixed or sequence_layout(cfg, *_replicas_and_workers_per_node(node_ranks))))


def _replicas_and_workers_per_node(node_ranks: Sequence[int]) -> tuple[int, int]:
    per_node = Counter(node_ranks)
    layout = ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items()))
    hint = "set parallel.hsdp_shard_size to the shard-group size"
    if list(node_ranks) != sorted(node_ranks):
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs each node's workers on consecutive "
                          f"ranks, got node ranks {list(node_ranks)}; {hint}")
    if len(set(per_node.values())) > 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD needs the same number of workers on every "
                          f"node, Ray placed {layout}; {hint} or place the workers evenly")
    nodes, shard = len(per_node), len(node_ranks) // len(per_node)
    if nodes == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD on one node ({layout}) has nothing to "
                          f"replicate across nodes (logical nodes on one host share an IP and count as one); "
                          f"{hint} or use FULL_SHARD")
    if shard == 1:
        raise ConfigError(f"config key 'parallel.sharding': HYBRID_SHARD with one worker per node ({layout}) has "
                          f"nothing to shard inside a node; {hint} or use NO_SHARD")
    return nodes, shard


def gather_node_ranks(node_rank: int, device: torch.device) -> list[int]:
    """Collective: every worker's node rank, in world-rank order."""
    ranks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, torch.tensor([node_rank], dtype=torch.int64, device=device))
    return [int(r.item()) for r in ranks]


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """FSDP's mesh (`MeshShape.dims`): every worker of a replica, sequence groups included, shards the parameters
    and sums its partial gradient in the reduce-scatter; the sequence groups are `sequence_group`'s."""
    return init_device_mesh(device_type, shape.dims, mesh_dim_names=shape.names)


def sequence_group(shape: MeshShape) -> dist.ProcessGroup | None:
    """Collective: this worker's sequence group, the mesh's innermost dimension (`shape.sequence` consecutive
    ranks); None without sequence parallelism."""
    if shape.sequence == 1:
        return None
    n = shape.sequence
    groups = [dist.new_group(list(range(first, first + n))) for first in range(0, dist.get_world_size(), n)]
    return groups[dist.get_rank() // n]


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig,
                sequence: dist.ProcessGroup | None = None) -> nn.Module:
    """Sequence parallelism's attention, then activation checkpointing, then torch.compile, then fully_shard per
    decoder layer, then the root (embeddings, norm, head): torchtitan's order."""
    # 0. Ulysses attention over the sequence group (raysft.parallel.sequence).
    if sequence is not None:
        apply_sequence_parallel(model, sequence)
    layer_classes = decoder_layer_classes(model)
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, layer_classes)]

    # 1. Activation checkpointing (non-reentrant), on every layer or every k-th.
    if cfg.activation_checkpointing != "none":
        every = 1 if cfg.activation_checkpointing == "full" else int(cfg.activation_checkpointing)
        for i, (parent, name, child) in enumerate(layers):
            if i % every == 0:
                wrapped = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             preserve_rng_state=True)
                parent.register_module(name, wrapped)
                layers[i] = (parent, name, wrapped)

    # 2. torch.compile per decoder layer (in place: the module keeps its class and its state-dict keys). FSDP's
    #    hooks run outside the compiled graph (Dynamo skips them), so each layer's all-gather stays FSDP's own.
    if cfg.compile:
        for _, _, layer in layers:
            layer.compile()

    # 3. FSDP2: params stored in fp32, compute in the chosen dtype, gradients reduced in reduce_dtype.
    fsdp_kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.mixed_precision], reduce_dtype=DTYPES[cfg.reduce_dtype]),
        reshard_after_forward=cfg.sharding != "SHARD_GRAD_OP",
    )
    if cfg.cpu_offload:
        # pinned host memory speeds up host-device copies; there is no such thing without an accelerator
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for i, (_, _, layer) in enumerate(layers):
        # the last layer's backward comes right after its forward: resharding it would only all-gather it again
        reshard = fsdp_kwargs["reshard_after_forward"] and i < len(layers) - 1
        fully_shard(layer, **{**fsdp_kwargs, "reshard_after_forward": reshard})
    # 4. The root holds what is left: embeddings, final norm, LM head (kept together so tied weights stay tied).
    fully_shard(model, **fsdp_kwargs)
    return model
