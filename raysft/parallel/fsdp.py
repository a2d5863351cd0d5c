"""FSDP2 applied in one place: the dtype policy, and `fully_shard` for each sharding strategy on the mesh that
raysft.distributed.layout builds (ParallelDims.build_mesh), after sequence parallelism's attention, FP8's linear layers,
activation checkpointing and torch.compile.

PyTorch's FSDP1 names all use the same `fully_shard` code path: FULL_SHARD, HYBRID_SHARD and NO_SHARD differ only
in the mesh (layout), SHARD_GRAD_OP keeps the params unsharded between forward and backward.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from raysft.config import ParallelConfig
from raysft.hf.dtypes import DTYPES
from raysft.model.build import decoder_layer_classes
from raysft.parallel.fp8 import convert_to_fp8, require_fp8
from raysft.parallel.sequence import apply_sequence_parallel


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig,
                sequence: dist.ProcessGroup | None = None) -> nn.Module:
    """Sequence parallelism's attention, then FP8's linear layers, then activation checkpointing, then torch.compile,
    then fully_shard per decoder layer, then the root (embeddings, norm, head): torchtitan's order."""
    # 0. Ulysses attention over the sequence group (raysft.parallel.sequence).
    if sequence is not None:
        apply_sequence_parallel(model, sequence)
    # 0b. FP8: linear layers swapped for torchao's Float8Linear while still plain modules (raysft.parallel.fp8).
    if cfg.fp8:
        require_fp8(mesh.device_type)
        convert_to_fp8(model)
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
