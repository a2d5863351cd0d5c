"""Reading a configuration: YAML and `--set section.key=value` overrides into the dataclasses of
raysft.config.sections, every value's type checked on the way in and the whole checked once (raysft.config.checks),
so that a typo or an inconsistent value fails on the driver with the key's name instead of deep inside a Ray
worker."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from raysft.config.checks import validate
from raysft.config.sections import TrainConfig, field_key
from raysft.errors import ConfigError


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A checked TrainConfig from nested plain values (TrainConfig.to_dict's form, a parsed YAML file)."""
    cfg = _build(TrainConfig, data, prefix="")
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML file (None: the defaults) and apply `section.key=value` overrides (values parsed as YAML)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config {path}: top level must be a mapping of sections, got {type(data).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {' '.join(str(e).split())}") from e
    train = data.get("train")
    if isinstance(train, dict) and train.get("num_epochs") and "max_steps" in train:
        raise ConfigError("config keys 'train.max_steps' and 'train.num_epochs' are both set: the run's length is one "
                          "of them (num_epochs: max_steps is derived from the data's size); remove the other")
    return config_from_dict(data)


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {field_key(f): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' "
                          f"(known in this section: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        key, tp = prefix + name, hints[names[name]]
        kwargs[names[name]] = _build(tp, value, key + ".") if dataclasses.is_dataclass(tp) else _coerce(tp, value, key)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(map(str, typing.get_args(tp)))}")
        return value
    if origin in (typing.Union, types.UnionType):  # data.paths entries: a path, or {path, weight}
        for option in typing.get_args(tp):
            if option is dict and isinstance(value, dict):
                return dict(value)
            if option is str and isinstance(value, (str, int)) and not isinstance(value, bool):
                return str(value)
        raise ConfigError(f"config key '{key}': expected {' or '.join(a.__name__ for a in typing.get_args(tp))}, "
                          f"got {value!r}")
    if origin in (list, list):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"config key '{key}': expected float, got {value!r} (str)") from None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, (str, int)) and not isinstance(value, bool),  # YAML reads `2` as an int
    }[tp]
    if not ok:
        raise ConfigError(f"config key '{key}': expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"config key '{key}': must be a finite number, got {value!r}")
    return float(value) if tp is float else str(value) if tp is str else value
