"""FP8 training (`parallel.fp8`): linear layers swapped for torchao's Float8Linear before they are sharded, FSDP2
all-gathering their weights in float8, as torchtitan's float8 converter does.

Which layers: every plain `nn.Linear` but the LM head whose two dimensions are multiples of 16, the FP8 tensor
cores' requirement (`fp8_linear_names`, torchtitan's filter with its output projection left out). The LM head stays
in the compute dtype: its logits over the whole vocabulary feed the loss, the part of the step most sensitive to
precision, and torchtitan and torchao's recipes leave it out too.

How: tensorwise dynamic scaling (one amax per tensor, taken afresh at every cast), the recipe whose weights FSDP2 can
all-gather already in float8 (torchao's `enable_fsdp_float8_all_gather`): each rank casts its shard, the all-gather
carries one byte a weight instead of bf16's two, and each Float8Linear's three matmuls (output, input gradient,
weight gradient) run in float8: e4m3 for inputs and weights, e5m2 for the gradients. torch.compile fuses the casts;
without parallel.compile they cost more than they save.

What stays: a Float8Linear keeps the nn.Linear's weight and bias under the same names, shapes and dtypes (the weight
wrapped in torchao's subclass that casts it before the all-gather), so checkpoints, the seeded initialization and
`raysft export` see the model they would see without FP8; the optimizer steps the same fp32 parameters.

What it does not do yet: torchtitan's option to compute every weight's scale in one all-reduce after the optimizer
step (`precompute_float8_dynamic_scale_for_fsdp`) needs a hook after the step; here each weight's amax is reduced
in its own all-gather's pre-hook.

torchao is optional (`pip install 'raysft[fp8]'`) and imported only here, when parallel.fp8 is on.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from raysft.config import ConfigError

FP8_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) onwards: the first NVIDIA GPUs with FP8 tensor cores
ALIGNMENT = 16  # torch._scaled_mm's requirement on both dimensions of a float8 matmul's weight


def require_fp8(device_type: str) -> None:
    """Refuse parallel.fp8 where it cannot run, by a ConfigError naming the key and what to do: off an NVIDIA GPU,
    on one older than FP8_CAPABILITY, or without torchao. In the worker, where the device is known; the driver
    checks torchao when it loads the configuration (raysft.config.checks)."""
    need = f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}"
    if device_type != "cuda":
        raise ConfigError(f"config key 'parallel.fp8': FP8 training needs NVIDIA GPUs of compute capability {need} "
                          f"or higher (Ada, Hopper, Blackwell); this worker trains on {device_type}: set "
                          "parallel.fp8: false, or train on such GPUs (scaling.use_gpu: true)")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"config key 'parallel.fp8': FP8 training needs compute capability {need} or higher (Ada, "
                          f"Hopper, Blackwell); this worker's {torch.cuda.get_device_name()} has "
                          f"{capability[0]}.{capability[1]}, without FP8 tensor cores: set parallel.fp8: false")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("config key 'parallel.fp8': FP8 training needs torchao, which is not installed on this "
                          "worker: pip install 'raysft[fp8]' (or set parallel.fp8: false)")


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The modules FP8 converts, in the model's order: each plain nn.Linear whose in and out features are multiples
    of ALIGNMENT, except the LM head (the model's output embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and m is not head
            and m.in_features % ALIGNMENT == 0 and m.out_features % ALIGNMENT == 0]


def convert_to_fp8(model: nn.Module) -> list[str]:
    """Swap the layers of `fp8_linear_names` for torchao's Float8Linear in place (tensorwise scaling, float8
    all-gather), before activation checkpointing, compile and fully_shard wrap them; on the meta device too. Returns
    the names converted. Checks nothing about the device: `require_fp8` does, before."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(fp8_linear_names(model))
    convert_to_float8_training(model, module_filter_fn=lambda _module, fqn: fqn in names,
                               config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return [name for name, _ in model.named_modules() if name in names]
