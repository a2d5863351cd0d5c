"""Conversations → token ids with assistant-only labels → a parquet store that every run can reuse.

Records are ShareGPT/FastChat (`{"conversations": [{"from", "value"}]}`) or OpenAI (`{"messages": [{"role",
"content"}]}`), in a JSON array or JSON Lines. Labels come from the chat template itself: `{% generation %}`
blocks where the template has them, otherwise the difference between renderings of successive prefixes.
The store is content-addressed (source hashes, tokenizer, template, max length), so a changed input makes a new
store and an existing one is never rewritten in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from raysft.config import BUILTIN, DataConfig
from raysft.demo import DEMO_CONVERSATIONS
from raysft.tokenizer import template_marks_generation, tokenizer_fingerprint

IGNORE_INDEX = -100
STORE_FORMAT = 1
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system"}


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and the record."""


class BadRecord(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def resolve_data_path(name: str) -> Path:
    if name == BUILTIN + "demo":
        return DEMO_CONVERSATIONS
    path = Path(name).expanduser()
    if not path.is_file():
        raise DataError(f"data.paths: {name} is not a file")
    return path


def read_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, record) pairs; an unparseable JSONL line is yielded as a BadRecord for the caller to judge."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            index = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield index, json.loads(line)
                except json.JSONDecodeError as e:
                    yield index, BadRecord("invalid_json",
                                           f"line {lineno} is not valid JSON: {e.msg} (column {e.colno})")
                index += 1
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json data file must hold a list of records, got {type(data).__name__}")
    yield from enumerate(data)


def to_messages(record: Any) -> list[dict[str, str]]:
    """Normalize either input format to OpenAI-style messages, rejecting what would train on garbage."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("bad_structure", f"expected an object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, content_key, field = record["conversations"], "from", "value", "conversations"
    elif "messages" in record:
        turns, role_key, content_key, field = record["messages"], "role", "content", "messages"
    else:
        raise BadRecord("bad_structure", "has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    if not isinstance(turns, list):
        raise BadRecord("bad_structure", f"'{field}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise BadRecord("empty_conversation", f"'{field}' is empty")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise BadRecord("bad_structure", f"{where} must be an object, got {type(turn).__name__}")
        role = turn.get(role_key)
        if role not in ROLES:
            raise BadRecord("unknown_role", f"{where}.{role_key} is {role!r}; known roles: {', '.join(ROLES)}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise BadRecord("non_string_content",
                            f"{where}.{content_key} must be a string, got {type(content).__name__}")
        messages.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", f"'{field}' has no assistant turn to learn from")
    return messages


def tokenize_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_seq_len: int
) -> tuple[list[int], list[int]]:
    """input_ids and labels (IGNORE_INDEX outside assistant turns), truncated to max_seq_len."""
    try:
        if template_marks_generation(tokenizer):
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            input_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            input_ids, mask = _mask_from_prefixes(tokenizer, messages)
    except BadRecord:
        raise
    except Exception as e:  # jinja's raise_exception and friends: the template rejects this conversation
        raise BadRecord("template_error", f"the chat template failed: {e}") from e
    labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, mask, strict=True)]
    return input_ids[:max_seq_len], labels[:max_seq_len]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    if not messages and not add_generation_prompt:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"])


def _mask_from_prefixes(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    """For templates without {% generation %}: an assistant turn is what its message adds to the rendering
    of the conversation before it (with the generation prompt). Needs renderings that extend each other."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True))
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(upto)] != upto:
            raise BadRecord("template_error", "the chat template does not render conversations prefix-stably; "
                            "add {% generation %} blocks around assistant text")
        mask[start : len(upto)] = [1] * (len(upto) - start)
    return full, mask


@dataclass
class StoreInfo:
    path: Path
    num_samples: int
    reused: bool


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_store(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, store_root: Path) -> StoreInfo:
    """Tokenize cfg.paths into `<store_root>/<fingerprint>` unless an identical store is already there."""
    sources = [resolve_data_path(p) for p in cfg.paths]
    source_info = [{"path": str(p), "sha256": file_sha256(p), "bytes": p.stat().st_size} for p in sources]
    key = {
        "format": STORE_FORMAT,
        "sources": [s["sha256"] for s in source_info],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": cfg.max_seq_len,
        "on_bad_record": cfg.on_bad_record,
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    store = store_root / fingerprint
    manifest_path = store / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return StoreInfo(store, manifest["counts"]["samples"], reused=True)

    columns: dict[str, list] = {"input_ids": [], "labels": [], "num_loss_tokens": [], "source": [], "record": []}
    skipped: Counter[str] = Counter()
    records = truncated = 0
    for source in sources:
        for index, record in read_records(source):
            records += 1
            try:
                input_ids, labels = tokenize_messages(tokenizer, to_messages(record), cfg.max_seq_len)
                # a label at position 0 is never predicted: count what the shifted loss actually sees
                num_loss_tokens = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
                if num_loss_tokens == 0:
                    raise BadRecord("no_assistant_tokens_after_truncation",
                                    f"no assistant token is left within data.max_seq_len={cfg.max_seq_len}")
            except BadRecord as e:
                if cfg.on_bad_record == "error":
                    raise DataError(f"{source}: record {index}: {e} "
                                    "(set data.on_bad_record=skip to skip such records)") from None
                skipped[e.reason] += 1
                continue
            truncated += len(input_ids) == cfg.max_seq_len
            for name, value in zip(columns, (input_ids, labels, num_loss_tokens, str(source), index), strict=True):
                columns[name].append(value)
    if not columns["input_ids"]:
        raise DataError(f"no usable records in {', '.join(map(str, sources))} (skipped: {dict(skipped)})")

    table = pa.table({
        "input_ids": pa.array(columns["input_ids"], type=pa.list_(pa.int32())),
        "labels": pa.array(columns["labels"], type=pa.list_(pa.int32())),
        "num_loss_tokens": pa.array(columns["num_loss_tokens"], type=pa.int32()),
        "source": pa.array(columns["source"], type=pa.string()),
        "record": pa.array(columns["record"], type=pa.int64()),
    })
    manifest = {
        "fingerprint": fingerprint,
        "key": key,
        "sources": source_info,
        "tokenizer": {"name_or_path": str(tokenizer.name_or_path), "sha256": key["tokenizer"]},
        "chat_template": tokenizer.chat_template,
        "counts": {"records": records, "samples": table.num_rows, "truncated": truncated, "skipped": dict(skipped)},
    }
    # Build beside the final place and rename, so a crash never leaves a half-written store that looks complete.
    store_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fingerprint}.", dir=store_root))
    try:
        pq.write_table(table, tmp / "samples.parquet")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if store.exists() and not manifest_path.is_file():  # debris of a crash before the rename
            shutil.rmtree(store)
        os.replace(tmp, store)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if manifest_path.is_file():  # another process finished the same store first: theirs is identical
            return StoreInfo(store, table.num_rows, reused=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StoreInfo(store, table.num_rows, reused=False)


def read_manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())
