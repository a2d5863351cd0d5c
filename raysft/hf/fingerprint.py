"""A cheap fingerprint of a model directory's weights: what tells the base a run started from from other weights
of the same shapes put in its place.

A full sha256 reads every byte, some 140 GB for a 70B base in bf16, on every launch. Headers, sizes and mtimes
cost nothing but miss the swap that matters: other weights of the same shapes (another fine-tune, another
checkpoint of the same pretraining) have byte-identical headers and sizes, and a copy gives the same weights new
mtimes. What differs between two such models is their values, in practically every element of every tensor: a
fine-tune's update is dense (LoRA's B·A merged into a weight changes all of it). So each safetensors file is
summed up by its size, its whole header and, of every tensor, WINDOWS windows of WINDOW_BYTES (its start, middle
and end): a single tensor replaced changes its file's digest, and the read is bounded by 12 KiB per tensor plus the
headers (a few MiB even for a 70B model). config.json and the index are small and hashed whole. Not
caught: a few bytes edited between the windows, which is an owner changing the file on purpose, not a swap.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from raysft.errors import ModelDirError
from raysft.hf.files import weight_files
from raysft.hf.shards import MODEL_INDEX

WINDOW_BYTES = 4096
WINDOWS = 3  # a tensor's start, middle and end


def weights_fingerprint(directory: Path) -> dict[str, str]:
    """{file name: sha256} of config.json, the index (if any) and a sample of each safetensors weight file."""
    small = [directory / name for name in ("config.json", MODEL_INDEX) if (directory / name).is_file()]
    fingerprint = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in small}
    for path in weight_files(directory):
        fingerprint[path.name] = sampled_digest(path)
    return fingerprint


def sampled_digest(path: Path) -> str:
    """sha256 of the file's size, its header and WINDOWS windows of each tensor's bytes."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header_bytes = f.read(length)
        try:
            header = json.loads(header_bytes)
            spans = [info["data_offsets"] for name, info in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError) as e:
            raise ModelDirError(f"{path}: the safetensors header cannot be read ({e})") from None
        digest.update(size.to_bytes(8, "little"))
        digest.update(header_bytes)
        for begin, end in sorted(spans):
            for offset in _windows(begin, end):
                f.seek(8 + length + offset)
                digest.update(f.read(min(WINDOW_BYTES, end - offset)))
    return digest.hexdigest()


def _windows(begin: int, end: int) -> list[int]:
    """Where the windows of a tensor's bytes [begin, end) start: all of a small tensor, else start, middle, end."""
    if end - begin <= WINDOWS * WINDOW_BYTES:
        return list(range(begin, end, WINDOW_BYTES))
    middle = begin + (end - begin - WINDOW_BYTES) // 2
    return [begin, middle, end - WINDOW_BYTES]


def changed_files(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two fingerprints, one phrase per file, in file order."""
    return [f"{name} {'is new' if name not in recorded else 'is gone' if name not in now else 'differs'}"
            for name in sorted(set(recorded) | set(now)) if recorded.get(name) != now.get(name)]
