"""What a checkpoint holds of a model with frozen parameters (LoRA): only what trains.

torch's ignore_frozen_params leaves the frozen base out of the saved and loaded state, and loading is then not
strict, so the names of the trainable tensors are checked here instead: a checkpoint of another model.lora or model
is refused rather than half loaded. Both layouts (full, sharded) read and write through these options.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from raysft.checkpoint.state import CheckpointError
from raysft.hf.tensors import Stored, check_tensors, split_aliases
from raysft.model.seeded_init import clean_name


def has_frozen_parameters(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def state_dict_options(model: nn.Module, **options: bool) -> StateDictOptions:
    """StateDictOptions for the training state of `model`: with frozen parameters (LoRA) only what trains is saved
    and loaded (ignore_frozen_params); loading is then not strict, since the frozen base is not in the checkpoint
    (raysft checks the adapters' names itself: `check_adapter_names`)."""
    frozen = has_frozen_parameters(model)
    return StateDictOptions(**options, ignore_frozen_params=frozen, strict=not frozen)


def check_adapter_names(model: nn.Module, names: Iterable[str], where: str) -> None:
    """Loading without strict would keep the initial value of an adapter a checkpoint lacks: refuse that instead."""
    expected = {clean_name(n) for n, p in model.named_parameters() if p.requires_grad}
    got = set(names)
    if got != expected:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise CheckpointError(f"{where}: the checkpoint's trainable tensors do not match the model's: "
                              f"{len(missing)} missing ({missing[:2]}), {len(extra)} unexpected ({extra[:2]}): "
                              "another model.lora or model (the run identity should have refused it)")


def saved_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors a checkpoint of `model` holds, by name (a real, sharded or meta model: names, shapes and dtypes
    are what count): with frozen parameters (LoRA) the trainable ones, else the whole state dict, each shared
    tensor under its first name; and {alias: that name} for the others."""
    if has_frozen_parameters(model):
        return {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}, {}
    return split_aliases({clean_name(n): t for n, t in model.state_dict(keep_vars=True).items()})


def check_saved_tensors(model: nn.Module, stored: Mapping[str, Stored], where: str) -> None:
    """CheckpointError naming the file and the tensor unless the checkpoint holds exactly `model`'s tensors, each of
    its shape and of a dtype read correctly (raysft.hf.tensors): resume, export and chat check the same way."""
    expected, aliases = saved_tensors(model)
    check_tensors(expected, stored, where, CheckpointError, aliases, extra=False)
