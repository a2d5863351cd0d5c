"""A part of a memory-tier snapshot as a file in node-local memory (raysft.checkpoint.memory): written under a
temporary name and renamed, so that a file under its own name is whole; mapped to be sent and received, so that a
part never passes through a buffer of the process; its header read without its tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HEADER_KEY = "raysft_memory"


def write_part(path: Path, tensors: dict[str, torch.Tensor], header: dict) -> None:
    """A rank's part: its tensors, and the header (trainer state, layout, run id) as the file's metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={HEADER_KEY: json.dumps(header)})
    tmp.rename(path)


def read_header(path: Path) -> dict | None:
    """A snapshot file's header, or None if it is no whole snapshot file (cut off, or not ours)."""
    try:
        with safe_open(path, framework="pt") as f:
            header = json.loads((f.metadata() or {})[HEADER_KEY])
    except Exception:  # noqa: BLE001 - safetensors' own errors for a torn or foreign file: not a snapshot
        return None
    return header if isinstance(header, dict) else None


def map_file(path: Path) -> torch.Tensor:
    """A file's bytes to send, mapped rather than read: in node-local shared memory they are the file's own pages,
    so sending a part costs no second copy of it in the process."""
    return torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)


def map_new(path: Path, size: int) -> torch.Tensor:
    """A file of `size` bytes under `path`'s temporary name (`commit` renames it), mapped to receive into: a part
    received from another node goes straight into the directory, not through a buffer of the process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    try:
        with tmp.open("wb") as f:
            if size:  # the room taken now: a full /dev/shm is an OSError here, not a SIGBUS on a page written later
                os.posix_fallocate(f.fileno(), 0, size)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return torch.from_file(str(tmp), shared=True, size=size, dtype=torch.uint8)


def commit(path: Path) -> None:
    """The file received under `path`'s temporary name, whole: now it counts."""
    temporary(path).rename(path)


def temporary(path: Path) -> Path:
    """Where a part is written or received until it is whole (a name the listing of parts never matches)."""
    return path.with_name(f".{path.name}.tmp")
