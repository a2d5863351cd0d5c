"""The manifest that makes a checkpoint complete: every file's size and sha256, written by rank 0 after every rank
has written and flushed its own files. A directory without a manifest that matches its files is incomplete and is
never loaded, exported or counted as a checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import BinaryIO

from raysft.checkpoint.state import FORMAT_VERSION, CheckpointError
from raysft.hf.shards import dcp_shard_rank, is_dcp_shard, is_tensor_file
from raysft.storage import Location, location

MANIFEST_FILE = "manifest.json"


def is_payload(name: str) -> bool:
    """The big files: weights and optimizer state (DCP shards or safetensors), all but the small ones."""
    return is_dcp_shard(name) or is_tensor_file(name)


def read_manifest(ckpt_dir: Path | Location) -> dict:
    """The manifest's file listing, checked (raises CheckpointError naming the path and the problem)."""
    files, problem = _manifest_files(location(ckpt_dir))
    if problem:
        raise CheckpointError(f"{location(ckpt_dir)}: {problem}")
    return files


def _manifest_files(ckpt: Location) -> tuple[dict, str | None]:
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return {}, f"no {MANIFEST_FILE} (the save did not finish)"
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, f"unreadable {MANIFEST_FILE}: {e}"
    problem = manifest_problem(manifest)
    if problem:
        return {}, f"{MANIFEST_FILE} is not a raysft manifest: {problem}"
    return manifest["files"], None


def incomplete_reason(ckpt_dir: Path | Location, checksums: bool | None = None) -> str | None:
    """Why ckpt_dir is not a complete checkpoint (None if it is): the manifest is missing or unreadable, or a file
    it lists is missing, of another size or (with checksums) of other content. One process reads every hashed
    file; a resume shares that reading over the ranks (raysft.checkpoint.discovery).

    checksums None: every file's on local storage; on remote storage only the small files', since hashing the
    payload would read the whole checkpoint through one process. An object store never shows a partly written
    object, and a full checkpoint's payload is checked as rank 0 downloads it (full.local_copy).
    """
    ckpt = location(ckpt_dir)
    files, problem = listed_and_sized(ckpt)
    return problem or hash_problem(ckpt, files, to_hash(ckpt, files, checksums))


def listed_and_sized(ckpt: Location) -> tuple[dict, str | None]:
    """The manifest's listing, and the first problem short of hashing: no manifest, a listed file missing or of
    another size. Reads the manifest and one directory listing, never a file's contents."""
    files, problem = _manifest_files(ckpt)
    if problem:
        return {}, problem
    sizes = ckpt.files()
    for name, entry in files.items():
        if name not in sizes:
            return files, f"{name} is missing"
        if sizes[name] != entry["size"]:
            return files, f"{name} has {sizes[name]} bytes, the manifest says {entry['size']}"
    return files, None


def to_hash(ckpt: Location, files: dict, checksums: bool | None = None) -> list[str]:
    """The listed files whose sha256 is checked (see incomplete_reason for checksums None), in manifest order."""
    return [name for name in files
            if (checksums if checksums is not None else ckpt.local is not None or not is_payload(name))]


def hash_problem(ckpt: Location, files: dict, names: list[str]) -> str | None:
    """The first of `names` whose content does not match its sha256 in the manifest (None if all do)."""
    for name in names:
        if (ckpt / name).sha256() != files[name]["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def share_by_size(files: dict, names: list[str], ranks: int) -> list[list[str]]:
    """`names` dealt over `ranks` so that each reads about the same bytes: the largest first, each to the rank with
    the fewest bytes so far (ties to the lowest rank), every share in manifest order. The same on every rank."""
    shares: list[list[str]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for name in sorted(names, key=lambda n: -files[n]["size"]):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += files[name]["size"]
    order = {name: i for i, name in enumerate(names)}
    return [sorted(share, key=order.__getitem__) for share in shares]


def manifest_problem(manifest: object) -> str | None:
    """What makes parsed JSON not a manifest (None if it is one): valid JSON is not enough to be trusted."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no 'files' listing"
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or \
                not isinstance(entry.get("sha256"), str):
            return f"the entry of {name!r} lacks an integer size and a sha256"
        if name.startswith("/") or ".." in name.split("/"):
            return f"{name!r} is not a path inside the checkpoint"
    return None


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned_by(name: str, rank: int) -> bool:
    """In a directory every rank writes into: rank r writes its DCP shard file __<r>_<n>.distcp, rank 0 the rest."""
    writer = dcp_shard_rank(name)
    return writer == rank if writer is not None else rank == 0


class HashingWriter:
    """A file being written whose sha256 is computed on the way, so that the manifest needs no second read of it."""

    def __init__(self, f: BinaryIO):
        self._f, self._hash = f, hashlib.sha256()

    def write(self, data) -> int:
        written = self._f.write(data)  # a buffered file writes all of it
        self._hash.update(data)
        return written

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def durable_file_list(out_dir: Path, owner: int | None = None, hashed: dict[str, str] | None = None) -> dict[str, dict]:
    """This rank's files (all in its own directory; those it wrote in a shared one), flushed to disk, with their
    sizes and sha256: from `hashed` ({name: sha256} of the files hashed as they were written), else read."""
    hashed = hashed or {}
    mine = {}
    for f in sorted(out_dir.rglob("*")):
        name = str(f.relative_to(out_dir))
        if f.is_file() and (owner is None or _owned_by(name, owner)):
            fsync(f)
            mine[name] = {"size": f.stat().st_size, "sha256": hashed.get(name) or location(f).sha256()}
    return mine


def write_manifest(out_dir: Path, step: int, everyone: list[dict]) -> None:
    """Rank 0, last: every rank's files in one manifest, which makes the checkpoint complete."""
    files: dict[str, dict] = {}
    for rank, part in enumerate(everyone):
        for name, entry in part.items():
            if name in files:
                raise CheckpointError(f"{out_dir}: rank {rank} also wrote {name}; Ray would keep only one of them")
            files[name] = entry
    tmp = out_dir / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, "files": files}, indent=1))
    fsync(tmp)
    tmp.rename(out_dir / MANIFEST_FILE)
    fsync(out_dir)
