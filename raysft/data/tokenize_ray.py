"""Tokenizing large inputs on the Ray cluster (data.prepare): the driver cuts the sources into chunks of whole
records and Ray Data tasks tokenize one chunk each into its own parquet file. Rows, record indices, counts and error
messages are those of the single-process path in raysft.data.prepare; only the number of parquet files differs."""

from __future__ import annotations

import io
import json
import os
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from raysft.config import BUILTIN, DataConfig
from raysft.data.readers import is_blank, json_array, json_array_spans, json_text, jsonl_records
from raysft.data.sources import DataError, Source, is_table, num_rows, resolve_data_path, source_bytes, table_records
from raysft.data.store import DISK_FULL, Samples, Split, no_usable_records, split_copies
from raysft.data.tokenizer import tokenizer_fingerprint

# data.prepare=auto: inputs this large are worth Ray's start-up (a few seconds) when a cluster is there.
RAY_MIN_BYTES = 64 << 20
# Input bytes per Ray task at most; fewer when that keeps every CPU of the cluster busy (4 chunks per CPU).
CHUNK_BYTES = 32 << 20
MIN_CHUNK_BYTES = 64 << 10


def use_ray(mode: str, input_bytes: int) -> bool:
    """auto: Ray for large inputs, and only when a cluster is there to use; never a Ray started just for this."""
    if mode != "auto":
        return mode == "ray"
    if input_bytes < RAY_MIN_BYTES:
        return False
    import ray

    return ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))


@dataclass
class _Chunk:
    """Whole records of one input file: bytes [start, end), and the file's index (and JSONL line) of the first."""

    number: int  # the chunk's place in the store: samples-<number>.parquet
    open: str  # an absolute path (tasks run in another directory), or builtin:... (the task's own install)
    source: str  # as the local path writes it: the `source` column and error messages
    jsonl: bool
    start: int  # a byte, or a row of a table source (parquet, a datasets directory)
    end: int
    index: int
    lineno: int = 0  # JSONL: the file's line number of the chunk's first line
    records: int = 0  # JSON array: the chunk's element count
    table: bool = False
    weight: float = 1.0  # the source's: how many times each record goes into the store (raysft.data.sources.copies)
    sha256: str = ""


def _plan(sources: list[Source], chunk_bytes: int) -> tuple[list[_Chunk], DataError | None]:
    """Every file's chunks in order, up to the first file that cannot be read, and that file's error: the local path
    meets it only after the records before it, so a bad record there is the error to report."""
    chunks: list[_Chunk] = []
    for source in sources:
        path = source.path
        try:
            chunker = _table_chunks if is_table(path) else _jsonl_chunks if path.suffix == ".jsonl" else _json_chunks
            spans = chunker(path, chunk_bytes)
        except DataError as e:
            return chunks, e
        open_as = source.name if source.name.startswith(BUILTIN) else str(path.resolve())
        chunks += [_Chunk(len(chunks) + i, open_as, str(path), weight=source.weight, sha256=source.sha256, **span)
                   for i, span in enumerate(spans)]
    return chunks, None


def _table_chunks(path: Path, chunk_bytes: int) -> list[dict]:
    """Rows of a table source, as many per chunk as make about chunk_bytes of it."""
    rows = num_rows(path)
    per_chunk = max(1, chunk_bytes * rows // max(1, source_bytes(path)))
    return [{"jsonl": False, "table": True, "start": start, "end": min(rows, start + per_chunk), "index": start}
            for start in range(0, rows, per_chunk)]


def _jsonl_chunks(path: Path, chunk_bytes: int) -> list[dict]:
    """Cuts after a newline once a chunk has chunk_bytes, counting records and lines on the way (one fast pass)."""
    chunks: list[dict] = []
    start = pos = index = first_index = 0
    lineno = first_lineno = 1
    with path.open("rb") as f:
        for raw in f:
            pos += len(raw)
            index += not is_blank(raw)
            lineno += 1
            if pos - start >= chunk_bytes:
                chunks.append({"jsonl": True, "start": start, "end": pos, "index": first_index, "lineno": first_lineno})
                start, first_index, first_lineno = pos, index, lineno
    if pos > start:
        chunks.append({"jsonl": True, "start": start, "end": pos, "index": first_index, "lineno": first_lineno})
    return chunks


def _json_chunks(path: Path, chunk_bytes: int) -> list[dict]:
    """A JSON array cannot be cut blindly: the driver finds the elements' byte spans (one record in memory at a
    time, besides the text) and cuts between elements."""
    text = json_text(path)
    spans = json_array_spans(text)
    if spans is None:
        json_array(path, text)  # raises the error the local path raises
        raise AssertionError(f"{path}: json.loads reads an array where the element scan does not")
    to_byte = _byte_offsets(text)
    chunks, i = [], 0
    while i < len(spans):
        j = i + 1
        while j < len(spans) and spans[j][1] - spans[i][0] <= chunk_bytes:
            j += 1
        chunks.append({"jsonl": False, "start": to_byte(spans[i][0]), "end": to_byte(spans[j - 1][1]), "index": i,
                       "records": j - i})
        i = j
    return chunks


def _byte_offsets(text: str):
    """Maps increasing character positions of UTF-8 text to byte positions, encoding each stretch once."""
    if text.isascii():
        return lambda pos: pos
    at = [0, 0]  # character, byte

    def to_byte(pos: int) -> int:
        at[1] += len(text[at[0] : pos].encode("utf-8"))
        at[0] = pos
        return at[1]

    return to_byte


def _chunk_records(chunk: _Chunk) -> Iterator[tuple[int, Any]]:
    path = resolve_data_path(chunk.open) if chunk.open.startswith(BUILTIN) else Path(chunk.open)
    if chunk.table:
        yield from table_records(path, chunk.start, chunk.end)
        return
    with path.open("rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.end - chunk.start)
    if chunk.jsonl:
        yield from jsonl_records(io.BytesIO(data), chunk.index, chunk.lineno)
        return
    records = json.loads("[" + data.decode("utf-8") + "]")
    if len(records) != chunk.records:
        raise DataError(f"{chunk.source} changed while it was being tokenized; run again")
    yield from enumerate(records, chunk.index)


def _tokenize_chunks(batch: dict, tokenizer: PreTrainedTokenizerBase, fingerprint: str, cfg: DataConfig,
                     out_dir: str, split: Split = "train") -> dict:
    """A Ray Data task: tokenizes whole chunks, each into its own parquet file, and returns each chunk's counts, or
    its first bad record's message (on_bad_record=error). The tokenizer comes from the driver through the object
    store, so no node needs its files. Tasks, not actors: Ray's worker processes, transformers imported, stay warm
    from one preparation to the next, so a second preparation does not import transformers again."""
    if tokenizer_fingerprint(tokenizer) != fingerprint:
        raise RuntimeError("the tokenizer does not tokenize on this node as it does on the driver")
    results = []
    for spec in batch["chunk"]:
        chunk, samples = _Chunk(**json.loads(spec)), Samples(tokenizer, cfg)
        try:
            for index, record in _chunk_records(chunk):
                samples.add(chunk.source, index, record, split_copies(cfg, split, chunk.weight, chunk.sha256, index))
            if samples.counts()["samples"]:
                samples.write(Path(out_dir) / f"samples-{chunk.number:05d}.parquet")
        except DataError as e:
            results.append({"number": chunk.number, "error": str(e)})
        except FileNotFoundError as e:
            results.append({"number": chunk.number, "error": (
                f"{e.filename}: not found on {socket.gethostname()}: with data.prepare=ray every node reads data.paths "
                "and writes data.store_dir at the driver's paths (a shared mount), or set data.prepare=local")})
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            results.append({"number": chunk.number, "errno": e.errno, "error": str(e)})  # the driver names the disk
        else:
            results.append({"number": chunk.number, **samples.counts()})
    return {"result": [json.dumps(r) for r in results]}


def tokenize_on_ray(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, sources: list[Source], out: Path,
                    split: Split = "train") -> dict:
    """The local path's result from Ray Data tasks: chunks are planned on the driver, tokenized in any order and
    put back in input order by their number (files samples-<number>.parquet, results sorted)."""
    import ray

    started = _connect_ray()
    try:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        total = sum(s.bytes for s in sources)
        chunk_bytes = max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, total // (4 * cpus)))
        chunks, unreadable = _plan(sources, chunk_bytes)
        results = []
        if chunks and not (unreadable and cfg.on_bad_record == "skip"):
            rows = ray.data.from_items([{"chunk": json.dumps(asdict(c))} for c in chunks],
                                       override_num_blocks=len(chunks)).map_batches(
                _tokenize_chunks, batch_size=1, num_cpus=1,
                fn_kwargs={"tokenizer": tokenizer, "fingerprint": tokenizer_fingerprint(tokenizer),
                           "cfg": cfg, "out_dir": str(out), "split": split},
            ).take_all()
            results = sorted((json.loads(r["result"]) for r in rows), key=lambda r: r["number"])
            assert [r["number"] for r in results] == list(range(len(chunks))), "a chunk is missing"
    finally:
        if started:
            ray.shutdown()
    full = next((r for r in results if r.get("errno")), None)
    if full:  # not retried: the disk stays full
        raise OSError(full["errno"], full["error"])
    errors = [r["error"] for r in results if "error" in r]
    if errors:  # the first in input order: the one the local path stops at
        raise DataError(errors[0])
    if unreadable:
        raise unreadable
    counts = {"records": 0, "samples": 0, "truncated": 0, "rewritten_turns": 0, "weighted_out": 0, "held_out": 0}
    skipped: Counter[str] = Counter()
    for r in results:
        for name in counts:
            counts[name] += r[name]
        skipped.update(r["skipped"])  # in chunk order: reasons in order of first appearance, as locally
    if not counts["samples"]:
        raise no_usable_records(sources, cfg, {**counts, "skipped": dict(skipped)},
                                split if cfg.eval_fraction else None)
    return {**counts, "skipped": dict(skipped)}


def _connect_ray() -> bool:
    """The running Ray, the cluster in RAY_ADDRESS, or else a local Ray started here: True then, and the caller shuts
    it down (`raysft train` then starts its own, sized for the workers)."""
    from raysft.distributed.local_ray import connect

    return connect(include_dashboard=False) is not None
