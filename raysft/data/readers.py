"""Records out of a source, one (index, record) pair at a time: JSON arrays, JSON Lines, and the tables of
raysft.data.sources. A line that is not JSON comes back as a BadRecord for the caller to judge (data.on_bad_record);
a file that cannot be read at all is a DataError naming it. The Ray path reads byte ranges of the same files with
these functions, so that a chunk reads exactly as the whole file does."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from raysft.data.conversation import BadRecord
from raysft.data.sources import DataError, is_table, table_records


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
