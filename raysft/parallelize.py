"""Parallelism, applied in one place: the device mesh and FSDP2 for each sharding strategy.

PyTorch's FSDP1 names map onto FSDP2 as follows; all four use the same `fully_shard` code path:
  FULL_SHARD     1-D mesh ("shard",) over all workers, params resharded after forward
  SHARD_GRAD_OP  same mesh, params kept unsharded between forward and backward
  HYBRID_SHARD   2-D mesh ("replicate", "shard"): shard inside a node (or hsdp_shard_size workers), replicate across
  NO_SHARD       2-D mesh (world, 1): every worker holds everything, gradients are all-reduced (data parallel)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from raysft.config import ConfigError, ParallelConfig
from raysft.model import decoder_layer_classes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MeshShape:
    """(replicate, shard) sizes; validated before any process group or model exists."""

    replicate: int
    shard: int

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.shard,) if self.replicate == 1 else (self.replicate, self.shard)

    @property
    def names(self) -> tuple[str, ...]:
        return ("shard",) if self.replicate == 1 else ("replicate", "shard")


def mesh_shape(cfg: ParallelConfig, world_size: int, local_world_size: int) -> MeshShape:
    if cfg.sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return MeshShape(1, world_size)
    if cfg.sharding == "NO_SHARD":
        return MeshShape(world_size, 1)
    shard = cfg.hsdp_shard_size or local_world_size
    if world_size % shard:
        raise ConfigError(f"config key 'parallel.hsdp_shard_size': HYBRID_SHARD shard size {shard} does not divide "
                          f"the world size {world_size}")
    if shard == world_size or shard == 1:
        raise ConfigError(
            f"config key 'parallel.sharding': HYBRID_SHARD with shard size {shard} on {world_size} workers has "
            f"{'nothing to replicate' if shard == world_size else 'nothing to shard'}; use "
            f"{'FULL_SHARD' if shard == world_size else 'NO_SHARD'} or set parallel.hsdp_shard_size")
    return MeshShape(world_size // shard, shard)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, shape.dims, mesh_dim_names=shape.names)


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> nn.Module:
    """Activation checkpointing, then fully_shard per decoder layer, then the root (embeddings, norm, head)."""
    layer_classes = decoder_layer_classes(model)
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, layer_classes)]

    # 1. Activation checkpointing (non-reentrant), on every layer or every k-th.
    if cfg.activation_checkpointing != "none":
        every = 1 if cfg.activation_checkpointing == "full" else int(cfg.activation_checkpointing)
        for i, (parent, name, child) in enumerate(layers):
            if i % every == 0:
                wrapped = checkpoint_wrapper(child, preserve_rng_state=True)
                parent.register_module(name, wrapped)
                layers[i] = (parent, name, wrapped)

    # 2. FSDP2: params stored in fp32, compute in the chosen dtype, gradients reduced in fp32.
    fsdp_kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES[cfg.mixed_precision], reduce_dtype=torch.float32),
        reshard_after_forward=cfg.sharding != "SHARD_GRAD_OP",
    )
    if cfg.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    for _, _, layer in layers:
        fully_shard(layer, **fsdp_kwargs)
    # 3. The root holds what is left: embeddings, final norm, LM head (kept together so tied weights stay tied).
    fully_shard(model, **fsdp_kwargs)
    return model
