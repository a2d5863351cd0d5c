"""LoRA on FSDP2: peft adapters injected into the model before it is sharded, the base weights frozen.

The adapters are added in place (`peft.inject_adapter_in_model`), so the model keeps its class and FSDP2 shards
each decoder layer with its frozen base weights and trainable adapters in one parameter group; only the adapters
get gradients, a gradient reduction and optimizer state. Checkpoints hold only what trains
(raysft.checkpoint.trainable: torch's ignore_frozen_params); the frozen base always comes from where the run started:
`model.path`, or the from-scratch initialization with `train.seed`, rebuilt on every launch. A LoRA checkpoint
records that in its trainer_state.json (`record`), and exports as a peft adapter directory or merged into a full
Hugging Face model (raysft.products.adapters).

Parameter names: the base weight of an adapted linear layer `...q_proj` is `...q_proj.base_layer.weight` in the
model, its adapters `...q_proj.lora_A.default.weight` and `...q_proj.lora_B.default.weight` (peft's names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from raysft.config import ConfigError, LoraConfig, TrainConfig
from raysft.hf.fingerprint import weights_fingerprint
from raysft.model.seeded_init import INIT_SCHEME, clean_name, init_parameters

ADAPTER = "default"  # peft's adapter name; raysft trains one adapter


def peft_config(cfg: LoraConfig, base_path: str | None = None):
    """The peft LoraConfig for raysft's `model.lora` (peft is imported only when LoRA is on)."""
    import peft

    return peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=list(cfg.target_modules), base_model_name_or_path=base_path or None)


def add_adapters(model: nn.Module, cfg: LoraConfig, seed: int | None = None) -> nn.Module:
    """Inject the adapters in place and freeze everything else; a no-op with r = 0. On the meta device they stay
    there (materialized with the rest); with `seed`, they get the seeded initialization of raysft.model.seeded_init
    (the values the sharded model's adapters get from the same seed, on any topology), the caller's RNG untouched."""
    if not cfg.r:
        return model
    import peft

    try:
        model = peft.inject_adapter_in_model(peft_config(cfg), model)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        _config_error(e, cfg.target_modules)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if seed is not None:
        init_adapters(model, seed)
    return model


def init_adapters(model: nn.Module, seed: int) -> None:
    """Not collective: the seeded initialization of the adapters (in full, or this rank's shards of them), the
    base weights untouched."""
    init_parameters(model, seed, init_adapter, name_of=clean_name, select=lambda name: is_adapter(f"{name}."))


def init_adapter(name: str, module: nn.Module) -> None:
    """peft's default initialization of one adapter matrix: A as nn.Linear's own (Kaiming-uniform), B zero, so
    that the adapted model starts as its base."""
    if f".lora_B.{ADAPTER}." in f"{name}.":
        nn.init.zeros_(module.weight)
    else:
        module.reset_parameters()


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model for a while: every peft layer skips its adapters (the reference of a LoRA DPO run). The flag
    is peft's own, set directly: peft's enable_adapters(False) would also change the adapters' requires_grad,
    which FSDP2 has already grouped."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _config_error(e: Exception, targets: Iterable[str]) -> None:
    raise ConfigError(f"config key 'model.lora.target_modules': {list(targets)} cannot be adapted: {e}") from e


def is_adapter(name: str) -> bool:
    """A LoRA parameter's name (peft's lora_A / lora_B of raysft's one adapter)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def record(cfg: TrainConfig) -> dict | None:
    """What a LoRA checkpoint must say to be exported on its own: the adapters' settings and where the frozen base
    comes from (None for full fine-tuning): `model.path` and the fingerprint of its weights
    (raysft.hf.fingerprint), or the seeded initialization named by its scheme."""
    lora = cfg.model.lora
    if not lora.r:
        return None
    base = {"path": cfg.model.path, "seed": cfg.train.seed}
    if cfg.model.path:  # what the adapters were trained on: export and chat check the base against it
        base["weights"] = weights_fingerprint(Path(cfg.model.path).expanduser())
    else:
        base["init"] = INIT_SCHEME
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": list(lora.target_modules),
            "base": base}
