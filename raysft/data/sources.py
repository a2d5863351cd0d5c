"""Where records come from: data.paths resolved into sources (path, weight, content hash, size); parquet files and
Hugging Face `datasets` directories (`Dataset.save_to_disk`), whose rows hold `messages` or `conversations`; and the
weights that sample a source into the store. JSON and JSON Lines are read by raysft.data.readers.

Both are Arrow underneath and are read with pyarrow, a batch at a time: `datasets` itself is not needed to read
what it saved. Rows come out as the same Python dicts a JSON record would be, so the same checks and labels apply.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raysft.config import BUILTIN, DataConfig, data_sources
from raysft.data.demo import DEMO_CONVERSATIONS, DEMO_PREFERENCES
from raysft.errors import DataError, SourceError
from raysft.storage import hash_stream

HF_STATE_FILE = "state.json"  # what Dataset.save_to_disk writes beside its Arrow files
HF_DICT_FILE = "dataset_dict.json"  # DatasetDict.save_to_disk: one directory per split


@dataclass(frozen=True)
class Source:
    """One data.paths entry, resolved: what the store's key and manifest record of it."""

    name: str  # as configured (a path, or builtin:demo)
    path: Path
    weight: float
    sha256: str
    bytes: int

    def info(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256, "bytes": self.bytes,
                **({"weight": self.weight} if self.weight != 1 else {})}


def is_table(path: Path) -> bool:
    """Parquet, or a `datasets` directory: read by rows, not as JSON text."""
    return path.suffix == ".parquet" or path.is_dir()


def check_table(path: Path) -> None:
    """A clear error, before any record is read, for a directory that is not a saved dataset (or is a DatasetDict:
    name the split), and for a parquet file or a dataset's Arrow file that pyarrow cannot open (cut short by a copy,
    say): pyarrow's own message names no file."""
    if path.suffix == ".parquet":
        files = [path]
    elif (path / HF_STATE_FILE).is_file():
        try:
            files = _arrow_files(path)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{path / HF_STATE_FILE}: not the state file save_to_disk writes ({e!r})") from None
    elif (path / HF_DICT_FILE).is_file():
        splits = json.loads((path / HF_DICT_FILE).read_text()).get("splits", [])
        raise SourceError(f"{path} is a DatasetDict: name one of its splits, e.g. {path / (splits or ['train'])[0]}")
    else:
        raise SourceError(f"{path} is a directory but not a Hugging Face dataset saved with save_to_disk (no "
                          f"{HF_STATE_FILE})")
    for file in files:
        try:
            if file.suffix == ".parquet":
                pq.read_metadata(file)
            else:
                with pa.memory_map(str(file)) as source:
                    pa.ipc.open_stream(source)  # reads the schema: the check
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{file}: not a readable {'parquet' if file.suffix == '.parquet' else 'Arrow'} file "
                              f"({e})") from None


def _arrow_files(path: Path) -> list[Path]:
    state = json.loads((path / HF_STATE_FILE).read_text())
    return [path / f["filename"] for f in state.get("_data_files", [])]


def _batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    if path.suffix == ".parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns)
        return
    for arrow in _arrow_files(path):
        with pa.memory_map(str(arrow)) as source:
            for batch in pa.ipc.open_stream(source):
                yield batch.select(columns) if columns else batch


def num_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        return pq.ParquetFile(path).metadata.num_rows
    return sum(batch.num_rows for batch in _batches(path, columns=[]))


def table_records(path: Path, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Any]]:
    """(index, row as a dict) for rows [start, stop)."""
    check_table(path)
    index = 0
    for batch in _batches(path):
        if stop is not None and index >= stop:
            return
        if index + batch.num_rows > start:
            rows = batch.to_pylist()
            for i in range(max(0, start - index), len(rows)):
                if stop is not None and index + i >= stop:
                    return
                yield index + i, {k: v for k, v in rows[i].items() if v is not None}
        index += batch.num_rows


def source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def source_sha256(path: Path) -> str:
    """A file's sha256; for a dataset directory, of its files' names and contents."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as data:
            hash_stream(data, h)
    return h.hexdigest()


def copies(weight: float, source_sha: str, index: int) -> int:
    """How many times record `index` of a source goes into the store under `weight`: floor(weight), plus one more
    for a deterministic pseudo-random share of the records equal to the fraction. The same on every run and every
    chunking of the source (it depends only on the source's content hash and the record's index)."""
    whole, fraction = math.floor(weight), weight - math.floor(weight)
    if not fraction:
        return whole
    digest = hashlib.blake2b(f"{source_sha}:{index}".encode(), digest_size=8).digest()
    return whole + (int.from_bytes(digest, "big") / 2**64 < fraction)


def resolve_data_path(name: str) -> Path:
    if name == BUILTIN + "demo":
        return DEMO_CONVERSATIONS
    if name == BUILTIN + "demo-preferences":
        return DEMO_PREFERENCES
    path = Path(name).expanduser()
    if not (path.is_file() or path.is_dir()):
        raise DataError(f"data.paths: {name} is not a file or a dataset directory")
    return path


def resolve_sources(cfg: DataConfig) -> list[Source]:
    sources = []
    for name, weight in data_sources(cfg.paths):
        path = resolve_data_path(name)
        try:
            if is_table(path):
                check_table(path)
        except SourceError as e:
            raise DataError(f"data.paths: {e}") from None
        sources.append(Source(name, path, weight, source_sha256(path), source_bytes(path)))
    return sources
