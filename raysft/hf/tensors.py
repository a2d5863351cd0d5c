"""The one check of weights against the model that reads them: every tensor the model has is in the files, of the
model's shape and of a dtype the reader converts correctly; done from the files' headers (safetensors) or index
(DCP), before a byte of the weights is read.

Without it a reader fills what it finds: from_pretrained gives a tensor the files lack fresh random values, an
export writes the files' tensors whatever their shape, and a copy into a float32 parameter turns int8 or fp8
values into floats as they are, without their scales. Every reader (export, chat, resume, `model.path`) passes the
model's tensors (meta or sharded: only names, shapes and dtypes are used) and what the files hold, and raises the
error class of its kind (CheckpointError for a checkpoint, WeightsFileError or ModelDirError for `model.path`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from raysft.hf.dtypes import CONVERTED, dtype_name


class Stored(NamedTuple):
    """A tensor as a file's header or index describes it."""

    file: str  # the file (or checkpoint) holding it, for messages
    shape: tuple[int, ...]
    dtype: str  # safetensors' name (F32, BF16, I8, F8_E4M3, ...)


def safetensors_tensors(files: Iterable[Path]) -> dict[str, Stored]:
    """{tensor name: Stored} over safetensors files, from their headers only."""
    found = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                piece = f.get_slice(name)
                found[name] = Stored(str(path), tuple(piece.get_shape()), piece.get_dtype())
    return found


def split_aliases(named: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a state dict (kept as variables), each shared one under its first name, and {alias: that
    name} for the others (tied embeddings: the files hold either name)."""
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    aliases = {}
    for name, t in named.items():
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)], tensors[name] = name, t
    return tensors, aliases


def check_tensors(expected: Mapping[str, torch.Tensor], stored: Mapping[str, Stored], where: str,
                  error: type[Exception], aliases: Mapping[str, str] | None = None, extra: bool = True) -> None:
    """Raise `error` naming the file and the tensor unless every expected tensor (or an alias of it) is stored
    with the model's shape and a dtype it reads correctly: a floating-point tensor from CONVERTED, any other
    exactly its own. `where` names the files (a directory, an index) for a tensor none of them holds. With
    extra=False a stored tensor the model does not have is refused too (a checkpoint raysft wrote holds exactly
    the model's)."""
    by_canonical = {canonical: alias for alias, canonical in (aliases or {}).items()}
    missing = []
    for name, tensor in expected.items():
        found = stored.get(name) or stored.get(by_canonical.get(name, ""))
        if found is None:
            missing.append(name)
            continue
        if tuple(found.shape) != tuple(tensor.shape):
            raise error(f"{found.file}: tensor {name!r} has shape {list(found.shape)}, the model's is "
                        f"{list(tensor.shape)}: weights of another model (or another config.json)")
        problem = _dtype_problem(found.dtype, tensor.dtype)
        if problem:
            raise error(f"{found.file}: tensor {name!r} is {found.dtype}, {problem}")
    if missing:
        raise error(f"{where}: tensor {missing[0]!r} of the model is in none of the files"
                    f"{f' ({len(missing)} of its {len(expected)} tensors are missing)' if len(missing) > 1 else ''}: "
                    "a reader would leave it uninitialized or random; the files are incomplete or of another model")
    if not extra:
        known = set(expected) | set(aliases or {})
        unknown = [name for name in stored if name not in known]
        if unknown:
            raise error(f"{stored[unknown[0]].file}: tensor {unknown[0]!r} is not one of the model's "
                        f"({len(unknown)} such): the files are of another model")


def check_dtypes(stored: Mapping[str, Stored], error: type[Exception]) -> None:
    """For weights whose names a reader cannot match to the model's (transformers renames them on load): raise
    `error` naming the first tensor of a dtype not in CONVERTED."""
    for name, found in stored.items():
        problem = _dtype_problem(found.dtype, torch.float32)
        if problem:
            raise error(f"{found.file}: tensor {name!r} is {found.dtype}, {problem}")


def _dtype_problem(stored: str, wanted: torch.dtype) -> str | None:
    if wanted.is_floating_point:
        if stored in CONVERTED:
            return None
        return (f"which raysft does not convert into the model's {dtype_name(wanted)} parameters (it reads "
                f"{', '.join(CONVERTED)}): quantized values would be read as if they were weights; use the "
                "model's unquantized weights")
    if stored == dtype_name(wanted):
        return None
    return f"the model's is {dtype_name(wanted)}"
