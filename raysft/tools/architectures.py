"""The architecture `raysft plan` counts: the model's shape, from a name or a config.json, without its weights or a
tokenizer, so that a run can be planned on a laptop before the cluster or the model directory exists.

Where it comes from, first found: `--model` (a name of KNOWN, a config.json, or a model directory, of which only
config.json is read); else the configuration's own: model.config (a config.json, or a preset, whose vocabulary is
its tokenizer's), or model.path's config.json where that directory is on this machine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from raysft.config import ConfigError, TrainConfig
from raysft.data.tokenizer import load_tokenizer
from raysft.model.build import (
    PRESETS,
    build_meta_model,
    model_read_problem,
    preset_config,
    read_config_file,
    slice_read_problem,
)
from raysft.tools.known import KNOWN


def known_architecture(name: str) -> PretrainedConfig:
    fields = dict(KNOWN[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def plan_architecture(cfg: TrainConfig, model: str | None = None) -> tuple[PretrainedConfig, str]:
    """The architecture to count and where it came from (for the plan's first line). ConfigError naming --model or
    the key when there is none to be had here, saying what to give instead."""
    if model:
        if model in KNOWN:
            return known_architecture(model), f"{model} (--model)"
        path = Path(model).expanduser()
        if not path.exists():
            raise ConfigError(f"--model {model!r} is neither a known architecture ({', '.join(KNOWN)}) nor a "
                              "config.json or a model directory")
        return read_config_file("--model", path), f"{path} (--model)"
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"config key 'model.path': {cfg.model.path} is not on this machine (no config.json "
                              f"there): give the architecture with --model NAME (one of {', '.join(KNOWN)}) or "
                              "--model path/to/config.json")
        return read_config_file("model.path", path), f"{path / 'config.json'} (model.path)"
    if cfg.model.config in PRESETS:
        return _preset(cfg), f"the preset {cfg.model.config} (model.config)"
    path = Path(cfg.model.config).expanduser()
    return read_config_file("model.config", path), f"{path} (model.config)"


def _preset(cfg: TrainConfig) -> PretrainedConfig:
    """A preset's architecture: its vocabulary is the tokenizer's, the one file a preset needs."""
    try:
        tokenizer = load_tokenizer(cfg.model)
    except ConfigError as e:
        raise ConfigError(f"config key 'model.config': the preset {cfg.model.config} takes its vocabulary from the "
                          f"tokenizer, which cannot be read here ({e}): give the architecture with --model NAME "
                          f"(one of {', '.join(KNOWN)}) or --model path/to/config.json") from None
    return preset_config(cfg.model.config, tokenizer)


def initial_weights_fallback(cfg: TrainConfig, hf_config: PretrainedConfig) -> str | None:
    """Why a launch would load model.path's weights whole on rank 0 and broadcast them (None: each rank reads its
    slices), as the workers decide it (raysft.model.build.load_initial_weights): from the model alone, and from the
    files' tensor names where they are on this machine."""
    if not cfg.model.path:
        return None
    with torch.device("meta"):
        model = build_meta_model(hf_config, cfg.model.attn_implementation)
    path = Path(cfg.model.path).expanduser()
    has_files = path.is_dir() and any(path.glob("*.safetensors"))
    return slice_read_problem(model, path) if has_files else model_read_problem(model)
