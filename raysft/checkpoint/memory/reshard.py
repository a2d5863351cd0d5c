"""A snapshot resumed on another layout: each rank's new shards cut from the old parts, as FSDP2 would have cut them.

FSDP2 shards every parameter, and the optimizer state with it, along dim 0 over its shard group (the sequence
group folded in), as torch.chunk does: place k of S holds rows [k c, (k + 1) c) of D, c = ceil(D / S), clipped to D
(so the last places may hold fewer rows, or none). A part is one place's shards; replicas (HYBRID_SHARD,
NO_SHARD) hold the same ones. So a step whose every old place is held on some node is the whole state, and a rank of
any new layout reads, from the parts whose rows overlap its own, just those rows: the tensor whole is never built.
That is what a stored sharded checkpoint's reshard does (DCP), read from node memory; the values are copied, never
computed, so a resume on another width equals a stored checkpoint's bit for bit.

What cannot be cut this way (a tensor sharded on another dim, a part whose rows are not what its place holds) is
refused by name, and the stored checkpoint is used.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from raysft.hf.tensors import dtype_name


def chunk_rows(rows: int, places: int, place: int) -> tuple[int, int]:
    """Rows [start, end) of `rows` that place `place` of `places` holds (torch.chunk's cut, as FSDP2 shards)."""
    per = -(-rows // places) if rows else 0
    return min(place * per, rows), min((place + 1) * per, rows)


def sharded_rows(value: torch.Tensor) -> int | None:
    """The global rows of a value FSDP2 shards along dim 0 (None: a value every rank holds whole, such as AdamW's
    step count). A DTensor sharded otherwise cannot be cut here: ValueError, naming the placement."""
    if not isinstance(value, DTensor):
        return None
    shards = [p for p in value.placements if p.is_shard()]
    if any(p != Shard(0) for p in shards) or len(shards) > 1:
        raise ValueError(f"placements {value.placements}: only one Shard(0) (FSDP2's) is resharded from memory")
    return value.shape[0] if shards else None


def needed_places(targets: dict[str, torch.Tensor], old_places: int, new_places: int, place: int) -> set[int]:
    """The old places whose rows a rank at `place` of `new_places` needs, over every tensor (at least one: the values
    every rank holds whole come from any part)."""
    needed = set()
    for value in targets.values():
        rows = sharded_rows(value)
        if rows is None:
            continue
        start, end = chunk_rows(rows, new_places, place)
        needed |= {k for k in range(old_places) if _overlap((start, end), chunk_rows(rows, old_places, k))}
    return needed or {0}


def assemble(targets: dict[str, torch.Tensor], parts: dict[int, Path], old_places: int, new_places: int,
             place: int) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """This rank's shards of every tensor in `targets` (its state dict's values, DTensors or whole), read from the
    old parts (`parts`: old place -> file) as new CPU tensors; or None and why they cannot be."""
    out = {}
    with ExitStack() as stack:
        files = {k: stack.enter_context(safe_open(path, framework="pt")) for k, path in parts.items()}
        for name, value in targets.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            try:
                rows = sharded_rows(value)
            except ValueError as e:
                return None, f"{name}: {e}"
            if rows is None:  # whole on every rank
                source = files[min(files)]
                if name not in source.keys():
                    return None, f"{name} is in no part of the snapshot"
                whole = source.get_tensor(name)
                if whole.shape != local.shape or whole.dtype != local.dtype:
                    return None, f"{name} is {tuple(whole.shape)} {whole.dtype}, this model's is " \
                                 f"{tuple(local.shape)} {local.dtype}"
                out[name] = whole
                continue
            start, end = chunk_rows(rows, new_places, place)
            if end - start != local.shape[0]:
                return None, f"{name}: this rank holds {local.shape[0]} rows, not the {end - start} of place " \
                             f"{place} of {new_places} (a sharding other than FSDP2's dim-0 chunks)"
            shard = torch.empty(local.shape, dtype=local.dtype)
            for k in sorted(files):
                old = chunk_rows(rows, old_places, k)
                lo, hi = max(start, old[0]), min(end, old[1])
                if lo >= hi:
                    continue
                piece = files[k].get_slice(name) if name in files[k].keys() else None
                expected = (dtype_name(local.dtype), [old[1] - old[0], *local.shape[1:]])
                found = None if piece is None else (piece.get_dtype(), list(piece.get_shape()))
                if found != expected:
                    return None, f"{name} of place {k} is {found or 'missing'}, expected {expected}"
                shard[lo - start:hi - start] = piece[lo - old[0]:hi - old[0]]
            out[name] = shard
    return out, None


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])
