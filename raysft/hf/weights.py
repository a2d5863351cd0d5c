"""Reading this rank's slices of named tensors from Hugging Face safetensors files into sharded parameters.

A rank holds a slice of each FSDP2 parameter (a DTensor: sharded on the mesh's "shard" dimension, replicated on
"replicate", possibly uneven, possibly empty). Reading only that slice (safetensors' `get_slice`, which maps the
file and copies just the requested rows) keeps every rank's memory at its own shards: no rank ever holds the whole
model, at load or at resume. The copy into the local shard converts the dtype exactly (a bf16 file into fp32
parameters gives the values `from_pretrained(dtype=float32)` gives).

A hand loop of `safe_open` + `get_slice` is used rather than torch's `HuggingFaceStorageReader` with `dcp.load`:
both read the same slices, and bench/load_memory.py measures the two (docs/bench/cpu-load-memory.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raysft.errors import WeightsFileError


def tensor_files(files: Iterable[Path]) -> dict[str, Path]:
    """{tensor name: file holding it} over safetensors files (only their headers are read)."""
    where = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), Path(path)))  # noqa: SIM118 - safe_open has no __iter__
    return where


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank stores of `t` and the slices of the full tensor it holds (all of it for a plain
    tensor). FSDP2 pads uneven shards in storage; the local tensor is the unpadded view, as DTensor computes it."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t._local_tensor, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def read_local_slices(targets: dict[str, torch.Tensor], files: dict[str, Path]) -> None:
    """Fill each target (a DTensor or a plain tensor, by the name its tensor has in the files) with this rank's
    slice of the file's tensor, one file open at a time. Raises WeightsFileError naming the file and tensor when a
    name is missing or a shape differs: nothing is guessed."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        if name not in files:
            raise WeightsFileError(f"tensor {name!r} is in none of the safetensors files "
                                   f"({', '.join(sorted({p.name for p in files.values()}))})")
        by_file[files[name]].append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                target = targets[name]
                stored = f.get_slice(name)
                if list(stored.get_shape()) != list(target.shape):
                    raise WeightsFileError(f"{path}: tensor {name!r} has shape {stored.get_shape()}, the model's "
                                           f"is {list(target.shape)}")
                local, index = local_part(target)
                if local.numel():
                    local.copy_(stored[index] if index else f.get_tensor(name))


@torch.no_grad()
def copy_local_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Fill `target` (a DTensor or a plain tensor) with this rank's slice of `full`, a whole tensor in memory."""
    local, index = local_part(target)
    if local.numel():
        local.copy_(full[index])
