"""A rank's part of a snapshot as a file in node-local memory: a safetensors file (any safetensors reader loads it)
whose tensor data is the rank's staging buffer byte for byte, followed by the RNG states, with the header
(trainer state, layout, launch attempt, metrics held) in its metadata, and a checksum of every byte after the
header (xxh3_64, taken as the bytes are written, at memory speed), checked before a part is used: a bit flipped in
node memory, or in a copy sent over the network, sets that copy aside rather than being resumed from.

Written under a temporary name and renamed, so that a file under its own name is whole; created 0600 in
directories of 0700 (raysft.checkpoint.memory.directory), so that only its owner reads the weights; mapped to be
sent and received, so that a part never passes through a buffer of the process; its header read and checked
without its tensors (`read_header`), since whoever could write the directory could have put anything there.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_state_dict

from raysft.checkpoint.state import TrainingObjects, check_trainer_state
from raysft.checkpoint.trainable import state_dict_options
from raysft.errors import CheckpointError
from raysft.hf.tensors import dtype_name

FORMAT = 3  # a part's header format; 2: no checksum; 1: per-tensor files written by save_file, RNG and metrics as
# tensors
CHECKSUM = "xxh3_64:"  # the header's "checksum": this, then 16 hex digits
_PENDING = CHECKSUM + "~" * 16  # its place in the header until the data is written
HEADER_KEY = "raysft_memory"
FILE_MODE = 0o600
WRITE_CHUNK = 64 << 20  # bytes per write: a part of tens of GiB is written without a second buffer of its size


@dataclass(frozen=True)
class Slot:
    """Where a tensor lies in the staging buffer (and in the file's data, which is that buffer)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def state_dicts(objs: TrainingObjects) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts as the tier saves them (what trains: LoRA's adapters only)."""
    return get_state_dict(objs.model, objs.optimizer, options=state_dict_options(objs.model))


def flatten(model_sd: dict, optim_sd: dict) -> dict[str, torch.Tensor]:
    """A part's tensor names for the state dicts' values: "model.<name>", "optim.<parameter>.<state>"."""
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd.get("state", {}).items():
        flat.update({f"optim.{fqn}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return flat


def plan_slots(tensors: dict[str, torch.Tensor]) -> list[Slot]:
    """Byte ranges for `tensors` in one buffer, largest element size first: every tensor starts at a multiple of its
    element size (a view of the buffer needs it), with no gap (safetensors needs its data contiguous)."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    slots, offset = [], 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        slots.append(Slot(name, t.dtype, tuple(t.shape), offset, offset + size))
        offset += size
    return slots


def views(buffer: torch.Tensor, slots: list[Slot]) -> dict[str, torch.Tensor]:
    """Each slot's tensor as a view of the uint8 `buffer`."""
    return {s.name: buffer[s.start:s.end].view(s.dtype).view(s.shape) for s in slots}


def write_part(path: Path, buffer: torch.Tensor, slots: list[Slot], extra: dict[str, torch.Tensor],
               header: dict) -> None:
    """The part: `buffer` (uint8, laid out by `slots`) as the file's data, then `extra` (uint8 tensors: the RNG
    states), and `header` as its metadata, its checksum filled in once the data is written. Written to the
    temporary name (mode 0600 from its creation), which a failed write removes, and renamed."""
    entries = {s.name: {"dtype": dtype_name(s.dtype), "shape": list(s.shape), "data_offsets": [s.start, s.end]}
               for s in slots}
    offset = buffer.numel()
    for name, t in extra.items():
        if t.dtype != torch.uint8:
            raise TypeError(f"{name}: the extra tensors of a part are bytes (uint8), got {t.dtype}")
        entries[name] = {"dtype": "U8", "shape": list(t.shape), "data_offsets": [offset, offset + t.numel()]}
        offset += t.numel()
    entries["__metadata__"] = {HEADER_KEY: json.dumps({**header, "checksum": _PENDING})}  # its last key
    meta = json.dumps(entries, separators=(",", ":")).encode()
    meta += b" " * (-len(meta) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    tmp = temporary(path)
    tmp.unlink(missing_ok=True)  # what a rank killed mid-write left
    try:
        with open(tmp, "xb", opener=_private) as f:
            f.write(struct.pack("<Q", len(meta)) + meta)
            digest = xxhash.xxh3_64()
            write_bytes(f, buffer, digest)
            for t in extra.values():
                write_bytes(f, t, digest)
            f.seek(8 + meta.rindex(_PENDING.encode()) + len(CHECKSUM))
            f.write(digest.hexdigest().encode())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a write that failed (a full /dev/shm) leaves nothing behind
        raise
    tmp.rename(path)


def _private(path: str, flags: int) -> int:
    """open()'s opener for a new file: created 0600 whatever the umask, never through another's file or link."""
    return os.open(path, flags | os.O_NOFOLLOW, FILE_MODE)


def write_bytes(f, data: torch.Tensor, digest=None) -> None:
    """A uint8 tensor's bytes, a chunk at a time, each also fed to `digest` (an xxhash object) if given."""
    flat = data.contiguous().view(torch.uint8).reshape(-1).numpy()
    for start in range(0, flat.size, WRITE_CHUNK):
        chunk = memoryview(flat[start:start + WRITE_CHUNK])
        f.write(chunk)
        if digest is not None:
            digest.update(chunk)


def data_checksum(path: Path) -> str:
    """The checksum of every byte of a part after its header, as write_part records it."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + size)
        while chunk := f.read(WRITE_CHUNK):
            digest.update(chunk)
    return CHECKSUM + digest.hexdigest()


def checksum_problem(path: Path, header: dict) -> str | None:
    """Why the part's bytes are not those it was written with (None if they are)."""
    found = data_checksum(path)
    return None if found == header["checksum"] else \
        f"its bytes do not match its checksum ({found}, written with {header['checksum']})"


def read_header(path: Path) -> dict | None:
    """A part's header, or None if the file is no whole part (cut off, or not a safetensors file)."""
    try:
        with safe_open(path, framework="pt") as f:
            header = json.loads((f.metadata() or {})[HEADER_KEY])
    except Exception:  # noqa: BLE001 - safetensors' own errors for a torn or foreign file: not a part
        return None
    return header if isinstance(header, dict) else None


# A header's keys and their types; `header_problem` checks them before anything of the part is used.
_HEADER_TYPES = {"format": int, "run_id": str, "attempt": str, "step": int, "rank": int, "world_size": int,
                 "layout": dict, "replica": int, "replicated": bool, "trainer_state": dict, "metrics_rows": list,
                 "metrics_values": list, "checksum": str}


def header_problem(header: dict, path: Path) -> str | None:
    """Why `header` cannot be the header of a part of this raysft's snapshots (None if it can): every key of its
    kind and range, and the trainer state checked as a stored checkpoint's is (raysft.checkpoint.state)."""
    if header.get("format") != FORMAT:
        return f"format {header.get('format')!r}, expected {FORMAT}"
    wrong = [k for k, kind in _HEADER_TYPES.items() if type(header.get(k)) is not kind]
    if wrong:
        return f"{wrong[0]} is missing or of the wrong type ({header.get(wrong[0])!r})"
    layout = header["layout"]
    if type(layout.get("sharding")) is not str or not all(
            type(layout.get(k)) is int and layout[k] >= 1 for k in ("replicate", "shard", "sequence")):
        return f"layout {layout!r}: expected a sharding and replicate, shard and sequence sizes of at least 1"
    digits = header["checksum"].removeprefix(CHECKSUM)
    if not header["checksum"].startswith(CHECKSUM) or len(digits) != 16 or digits.strip("0123456789abcdef"):
        return f"checksum {header['checksum']!r}, expected {CHECKSUM} and 16 hex digits"
    if not 0 <= header["rank"] < header["world_size"] or header["step"] < 0:
        return f"rank {header['rank']} of {header['world_size']} at step {header['step']}"
    try:
        check_trainer_state(header["trainer_state"], path, modes=("memory",))
    except CheckpointError as e:
        return str(e).removeprefix(f"{path}: ")
    if header["trainer_state"]["step"] != header["step"]:
        return f"its trainer state is of step {header['trainer_state']['step']}, not {header['step']}"
    rows, values, ranks = header["metrics_rows"], header["metrics_values"], header["world_size"]
    if len(rows) != ranks or len(values) != ranks or any(len(v) != len(r) for r, v in zip(rows, values, strict=True)):
        return f"metrics held for {len(rows)} and {len(values)} ranks, expected {ranks}, as many values as rows"
    if not all(isinstance(row, list) and len(row) == 2 and isinstance(row[0], (int, float)) and
               isinstance(row[1], dict) for r in rows for row in r):
        return "metrics rows that are not [start time, host metrics]"
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for row in v for x in row):
        return "metrics held that are not numbers"
    return None


def finite_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first floating-point tensor holding NaN or inf (a snapshot of it is never resumed from), or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return f"{name} holds non-finite values"
    return None


def map_file(path: Path) -> torch.Tensor:
    """A file's bytes to send, mapped rather than read: in node-local shared memory they are the file's own pages,
    so sending a part costs no second copy of it in the process."""
    return torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)


def map_new(path: Path, size: int) -> torch.Tensor:
    """A file of `size` bytes under `path`'s temporary name (`commit` renames it), mapped to receive into: a part
    received from another node goes straight into the directory, not through a buffer of the process."""
    tmp = temporary(path)
    tmp.unlink(missing_ok=True)
    try:
        with open(tmp, "xb", opener=_private) as f:
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
