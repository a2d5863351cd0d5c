"""Conversations → token ids with assistant-only labels → a parquet store that every run can reuse.

Records are ShareGPT/FastChat (`{"conversations": [{"from", "value"}]}`) or OpenAI (`{"messages": [{"role",
"content"}]}`), in JSON arrays, JSON Lines, parquet files or Hugging Face datasets directories (raysft.sources), each
source sampled into the store by its weight. Labels come from the chat template (raysft.labels). The store is
content-addressed (source hashes and weights, tokenizer, template, max length, labelling), so a changed input makes
a new store and an existing one is never rewritten in place. Large inputs are tokenized on Ray (raysft.prepare_ray)
into the same rows.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from raysft.config import BUILTIN, DataConfig
from raysft.config_checks import data_sources
from raysft.conversation import BadRecord, to_conversation
from raysft.demo import DEMO_CONVERSATIONS
from raysft.labels import IGNORE_INDEX, label_conversation, marks_generation, template_profile
from raysft.sources import (
    Source,
    SourceError,
    check_table,
    copies,
    is_table,
    source_bytes,
    source_sha256,
    table_records,
)
from raysft.storage import built_then_renamed
from raysft.tokenizer import tokenizer_fingerprint

__all__ = ["IGNORE_INDEX", "BadRecord", "DataError", "StoreFull", "StoreInfo", "prepare_store", "read_manifest",
           "read_store", "store_files"]

STORE_FORMAT = 2  # 2: labels from the one rendering of the whole conversation (raysft.labels), tool calls
# Token bytes per parquet row group: a worker reading one sample decodes its whole row group (about 1 ms here).
ROW_GROUP_BYTES = 256 << 10


Split = Literal["train", "eval"]


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and the record."""


class StoreFull(OSError):
    """The disk of data.store_dir filled up while a store was written; the message names the directory."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, or the user's quota reached


def resolve_data_path(name: str) -> Path:
    if name == BUILTIN + "demo":
        return DEMO_CONVERSATIONS
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


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, record) pairs; an unparseable JSONL line is yielded as a BadRecord for the caller to judge."""
    if is_table(path):
        yield from table_records(path)
        return
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            yield from jsonl_records(f, index=0, lineno=1)
        return
    yield from enumerate(json_array(path, json_text(path)))


def jsonl_records(lines: Iterable[bytes], index: int, lineno: int) -> Iterator[tuple[int, Any]]:
    """Lines end at b"\\n" only, so that a byte range cut after one reads exactly as the whole file does."""
    for raw in lines:
        if not is_blank(raw):
            try:
                yield index, json.loads(raw.decode("utf-8-sig"))  # -sig: a BOM that starts the file
            except UnicodeDecodeError as e:
                yield index, BadRecord("invalid_json", f"line {lineno} is not UTF-8: {e.reason} at byte {e.start}")
            except json.JSONDecodeError as e:
                yield index, BadRecord("invalid_json", f"line {lineno} is not valid JSON: {e.msg} (column {e.colno})")
            index += 1
        lineno += 1


def is_blank(raw: bytes) -> bool:
    """A line of whitespace only, as str.strip sees it (blank lines are not records and take no index)."""
    stripped = raw.strip()
    if not stripped:
        return True
    if 0x20 < stripped[0] < 0x80:  # an ASCII character that is not whitespace: the common case, no decoding
        return False
    return not raw.decode("utf-8-sig", "replace").strip()


def json_text(path: Path) -> str:
    """The file as text, newlines untranslated: character positions then map to byte positions."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text: {e}") from None


def json_array(path: Path, text: str) -> list:
    try:
        data = json.loads(text.removeprefix(BOM))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(data).__name__}")
    return data


_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # json's own definition of whitespace
BOM = "\ufeff"  # a byte-order mark some editors write at the start of UTF-8 files; kept in the text (3 bytes)


def json_array_spans(text: str) -> list[tuple[int, int]] | None:
    """Character spans of the elements of a top-level JSON array, parsed one at a time so that only one record is in
    memory; None for anything json.loads would not read as an array (it then gives the error message)."""
    decoder = json.JSONDecoder()
    spans: list[tuple[int, int]] = []
    pos = _JSON_SPACE.match(text, 1 if text.startswith(BOM) else 0).end()
    if text[pos : pos + 1] != "[":
        return None
    pos = _JSON_SPACE.match(text, pos + 1).end()
    if text[pos : pos + 1] != "]":
        while True:
            try:
                _, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            spans.append((pos, end))
            pos = _JSON_SPACE.match(text, end).end()
            if text[pos : pos + 1] == "]":
                break
            if text[pos : pos + 1] != ",":
                return None
            pos = _JSON_SPACE.match(text, pos + 1).end()
    return spans if _JSON_SPACE.match(text, pos + 1).end() == len(text) else None


@dataclass
class StoreInfo:
    path: Path
    num_samples: int
    reused: bool
    built_with: str = ""
    """"local" or "ray" when this call wrote the store (the store is the same either way)."""


def prepare_store(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, store_root: Path,
                  split: Split = "train") -> StoreInfo:
    """Tokenize cfg.paths into `<store_root>/<fingerprint>` unless an identical store is already there.

    `split` "eval" is the validation store: cfg.eval_paths, or the records data.eval_fraction holds out of cfg.paths
    (then the "train" store lacks them). Where (data.prepare) is not part of the fingerprint: both ways write the
    same rows and manifest.
    """
    if split == "eval" and cfg.eval_paths:  # a store like any other, of those files
        cfg = dataclasses.replace(cfg, paths=cfg.eval_paths, eval_paths=[])
        split = "train"
    sources = resolve_sources(cfg)
    source_info = [s.info() for s in sources]
    key = {
        "format": STORE_FORMAT,
        "sources": [[s.sha256, s.weight] if s.weight != 1 else s.sha256 for s in sources],
        "system_prompt": cfg.system_prompt,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": cfg.max_seq_len,
        "on_bad_record": cfg.on_bad_record,
        "train_on": cfg.train_on,
        **({"eval_split": [cfg.eval_fraction, split]} if cfg.eval_fraction else {}),
        **({"stop_after_last_turn": stop} if (stop := appended_stop(tokenizer)) else {}),
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    store = store_root / fingerprint
    manifest_path = store / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return StoreInfo(store, manifest["counts"]["samples"], reused=True)

    from raysft.prepare_ray import tokenize_on_ray, use_ray

    on_ray = use_ray(cfg.prepare, sum(s.bytes for s in sources))
    # A directory without a manifest under the store's name is debris of a crash before the rename: replaced.
    try:
        with built_then_renamed(store, replace=lambda existing: not manifest_path.is_file()) as tmp:
            counts = (tokenize_on_ray if on_ray else _tokenize_here)(cfg, tokenizer, sources, tmp, split)
            manifest = {
                "fingerprint": fingerprint,
                "key": key,
                "sources": source_info,
                "tokenizer": {"name_or_path": str(tokenizer.name_or_path), "sha256": key["tokenizer"]},
                "chat_template": tokenizer.chat_template,
                "labels": labelling(tokenizer, cfg),
                "counts": counts,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    except OSError as e:
        if manifest_path.is_file():  # another process finished the same store first: theirs is identical
            return StoreInfo(store, read_manifest(store)["counts"]["samples"], reused=True)
        if e.errno in DISK_FULL:  # what was written of the store went with its build directory
            raise StoreFull(f"data.store_dir: {store_root} is full ({os.strerror(e.errno)}) while the store "
                            f"{store.name} was written; its partial files were removed and nothing else there was "
                            "touched. Free space there or set data.store_dir to another disk, and launch again: the "
                            "store is then tokenized whole") from None
        raise
    return StoreInfo(store, counts["samples"], reused=False, built_with="ray" if on_ray else "local")


def appended_stop(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The end-of-turn token raysft supervises after a last assistant turn that the template leaves open."""
    if marks_generation(tokenizer) or not tokenizer.chat_template:
        return None
    profile = template_profile(tokenizer)
    return profile.closes_turn if profile.open_last_turn else None


def labelling(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> dict:
    """How the store's labels were found, for the manifest: a reader can tell what was supervised and why."""
    if marks_generation(tokenizer):
        return {"method": "generation_blocks", "train_on": cfg.train_on}
    profile = template_profile(tokenizer)
    return {"method": "rendered_spans", "train_on": cfg.train_on, "end_of_turn": sorted(profile.end_of_turn),
            "tool_calls": profile.call_prefix is not None, "stop_after_last_turn": appended_stop(tokenizer),
            "rewritten_turns": "assistant turns whose text the template renders otherwise (earlier turns' reasoning "
                               "dropped, say) are labelled as rendered and counted in counts.rewritten_turns"}


def read_manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def store_files(store: Path) -> list[Path]:
    """The store's parquet files in sample order: samples.parquet, or one samples-<chunk>.parquet per chunk that
    had samples when Ray built it."""
    single = store / "samples.parquet"
    if single.is_file():
        return [single]
    return sorted(store.glob("samples-*.parquet"), key=lambda p: int(p.stem.partition("-")[2]))


def read_store(store: Path, columns: list[str] | None = None) -> pa.Table:
    """The whole store as one table, for tests and tools; training reads it lazily (dataloader.TokenizedDataset)."""
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in store_files(store)])


class Samples:
    """Tokenized records, in input order, and the counts the manifest keeps. The local path feeds it every record,
    a Ray task one chunk's: the same code on both sides is what makes the two stores agree."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.columns: dict[str, list] = {"input_ids": [], "labels": [], "num_loss_tokens": [], "source": [],
                                         "record": []}
        self.skipped: Counter[str] = Counter()
        self.records = self.truncated = self.rewritten_turns = self.weighted_out = self.held_out = 0

    def add(self, source: str, index: int, record: Any, copies: int | None = 1) -> None:
        """One record, appended `copies` times (its source's weight); one not sampled at all is counted only, as is
        one of the other split (None: see split_copies)."""
        self.records += 1
        if copies is None:
            self.held_out += 1
            return
        if not copies:
            self.weighted_out += 1
            return
        try:
            sample = label_conversation(self.tokenizer, to_conversation(record, self.cfg.system_prompt),
                                        self.cfg.max_seq_len,
                                        self.cfg.train_on)
            input_ids, labels = sample.input_ids, sample.labels
            # a label at position 0 is never predicted: count what the shifted loss actually sees
            num_loss_tokens = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
            if num_loss_tokens == 0:
                raise BadRecord("no_assistant_tokens_after_truncation",
                                f"no assistant token is left within data.max_seq_len={self.cfg.max_seq_len}")
        except BadRecord as e:
            if self.cfg.on_bad_record == "error":
                raise DataError(f"{source}: record {index}: {e} "
                                "(set data.on_bad_record=skip to skip such records)") from None
            self.skipped[e.reason] += 1
            return
        self.truncated += len(input_ids) == self.cfg.max_seq_len
        self.rewritten_turns += sample.rewritten_turns
        for name, value in zip(self.columns, (input_ids, labels, num_loss_tokens, source, index), strict=True):
            self.columns[name].extend([value] * copies)

    def counts(self) -> dict:
        return {"records": self.records, "samples": len(self.columns["record"]), "truncated": self.truncated,
                "rewritten_turns": self.rewritten_turns, "weighted_out": self.weighted_out,
                "held_out": self.held_out, "skipped": dict(self.skipped)}

    def write(self, path: Path) -> None:
        c = self.columns
        write_samples(pa.table({
            "input_ids": pa.array(c["input_ids"], type=pa.list_(pa.int32())),
            "labels": pa.array(c["labels"], type=pa.list_(pa.int32())),
            "num_loss_tokens": pa.array(c["num_loss_tokens"], type=pa.int32()),
            "num_tokens": pa.array([len(ids) for ids in c["input_ids"]], type=pa.int32()),
            "source": pa.array(c["source"], type=pa.string()),
            "record": pa.array(c["record"], type=pa.int64()),
        }), path)


def write_samples(table: pa.Table, path: Path) -> None:
    """Row groups of about ROW_GROUP_BYTES of tokens; written aside and renamed, so that a retried Ray task replaces
    a file whole."""
    token_bytes = 8 * (pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)  # ids + labels, int32
    part = path.with_name(f".{path.name}.{os.getpid()}")
    pq.write_table(table, part, row_group_size=max(1, table.num_rows * ROW_GROUP_BYTES // max(1, token_bytes)))
    os.replace(part, path)


# What to change when every record was skipped for one reason (data.on_bad_record=skip).
SKIP_HINTS = {"no_assistant_turn": "a record without an assistant turn has nothing to learn",
              "no_assistant_tokens_after_truncation": "raise data.max_seq_len: it keeps the start of each conversation"}


def no_usable_records(sources: list[Source], cfg: DataConfig, counts: dict, split: Split | None = None) -> DataError:
    """No sample at all, so nothing to train on: the files and why, from the counts, to say what to change."""
    why = [f"{counts['records']} records read"]
    if counts["skipped"]:
        why.append("skipped with data.on_bad_record=skip: " + ", ".join(
            f"{n} {reason}" + (f" ({SKIP_HINTS[reason]})" if reason in SKIP_HINTS else "")
            for reason, n in counts["skipped"].items()))
    if counts["weighted_out"]:
        why.append(f"{counts['weighted_out']} left out by a source weight below 1")
    if counts["held_out"]:
        why.append(f"{counts['held_out']} held out for validation (data.eval_fraction={cfg.eval_fraction})")
    where = f" of the {split} split (data.eval_fraction)" if split else ""
    return DataError(f"no record{where} of {', '.join(str(s.path) for s in sources)} has anything to learn: "
                     f"{'; '.join(why)}")


def split_copies(cfg: DataConfig, split: Split, weight: float, source_sha: str, index: int) -> int | None:
    """How many times a record goes into the `split` store; None for a record of the other split. With
    data.eval_fraction, a deterministic share of each source's records (by its content hash and the record's index,
    as weights sample) goes into the eval store once each and never into the train store."""
    if not cfg.eval_fraction:
        return copies(weight, source_sha, index)
    held = copies(cfg.eval_fraction, f"eval:{source_sha}", index) == 1  # a draw of its own, not the weight's
    if split == "eval":
        return 1 if held else None
    return None if held else copies(weight, source_sha, index)


def _tokenize_here(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, sources: list[Source], out: Path,
                   split: Split = "train") -> dict:
    samples = Samples(tokenizer, cfg)
    for source in sources:
        for index, record in read_records(source.path):
            samples.add(str(source.path), index, record, split_copies(cfg, split, source.weight, source.sha256, index))
    counts = samples.counts()
    if not counts["samples"]:
        raise no_usable_records(sources, cfg, counts, split if cfg.eval_fraction else None)
    samples.write(out / "samples.parquet")
    return counts
