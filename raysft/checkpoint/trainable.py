"""What a checkpoint holds of a model with frozen parameters (LoRA): only what trains.

torch's ignore_frozen_params leaves the frozen base out of the saved and loaded state, and loading is then not
strict, so the names of the trainable tensors are checked here instead: a checkpoint of another model.lora or model
is refused rather than half loaded. Both layouts (full, sharded) read and write through these options.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from raysft.checkpoint.state import CheckpointError
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
