"""The eval set of a generation evaluation (eval.path): prompts in the conversation formats training reads, each with
the answer it expects.

A JSONL file (or a JSON array) of records, each one of:

    {"prompt": "What is 2 plus 3?", "answer": "5"}                                  // one user message
    {"messages": [{"role": "user", "content": "..."}], "answer": "B"}              // OpenAI messages
    {"conversations": [{"from": "human", "value": "..."}], "answer": 42}          // ShareGPT
    {"messages": [..., {"role": "assistant", "content": "Paris."}]}                // the last assistant turn is
                                                                                   // the expected answer

`expected` may stand for `answer`; a number is taken as its text; `id` and `tools` are kept. The prompt must end
on a turn the model answers (a user's or a tool's). A record that cannot be evaluated is refused as training data
is, with the file and its line (a JSON array: its record index) and what is wrong, before anything is generated;
so is an expected answer a chosen scorer could never match (raysft.evals.scorers.check_expected). Nothing in the
file is run: it is JSON, read as data.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysft.config import BUILTIN
from raysft.data.conversation import BadRecord, to_messages, tools_of
from raysft.data.demo import DEMO_EVAL
from raysft.errors import DataError
from raysft.evals.scorers import check_expected

ANSWER_KEYS = ("answer", "expected")
DEMO_EVAL_NAME = BUILTIN + "demo-eval"


@dataclass(frozen=True)
class EvalSample:
    """One prompt of the eval set: the conversation the model answers and the answer it should give."""

    where: str  # "line 3" (JSONL) or "record 2" (a JSON array): how a message names it
    messages: list[dict[str, Any]]
    expected: str
    id: str | None = None
    tools: list[dict] | None = field(default=None)

    @property
    def prompt(self) -> str:
        """The turn the model answers, for the per-sample table (the whole conversation is kept beside it)."""
        return str(self.messages[-1].get("content", ""))


def eval_set_path(name: str) -> Path:
    """eval.path as a file: a path, or builtin:demo-eval (the demo's questions and answers)."""
    if name == DEMO_EVAL_NAME:
        return DEMO_EVAL
    if name.startswith(BUILTIN):
        raise DataError(f"eval.path: unknown builtin {name!r} (known: {DEMO_EVAL_NAME})")
    path = Path(name).expanduser()
    if not path.is_file():  # the node, as an evaluation runs where Ray places it: the file may be on others only
        raise DataError(f"eval.path: {path} is not a file on node {socket.gethostname()}")
    return path


def eval_set_sha256(name: str) -> str:
    """The eval set's content hash: part of an evaluation's key, so an edited file is evaluated again."""
    return hashlib.sha256(eval_set_path(name).read_bytes()).hexdigest()


def read_eval_set(name: str, scorers: list[str], system_prompt: str = "", limit: int = 0) -> list[EvalSample]:
    """Every record of the eval set (the first `limit`, if set), checked; DataError naming the file and line of the
    first bad one. `system_prompt` opens the conversations that have no system message, as in training
    (data.system_prompt)."""
    path = eval_set_path(name)
    samples = []
    for where, record in _records(path):
        try:
            samples.append(_sample(record, where, scorers, system_prompt))
        except BadRecord as e:
            raise DataError(f"{path}: {where}: {e} (an eval record is a prompt, as 'prompt' text or 'messages' / "
                            f"'conversations', with its expected answer in 'answer')") from None
        if limit and len(samples) == limit:
            break
    if not samples:
        raise DataError(f"{path}: no eval records")
    return samples


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record): JSONL line by line (blank lines skipped), or the elements of a JSON array."""
    if path.suffix == ".jsonl":
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text: {e.reason} at byte {e.start}") from None
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                yield f"line {lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {lineno}", BadRecord("invalid_json", f"not valid JSON: {e.msg} (column {e.colno})")
        return
    try:
        records = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON array of eval records, nor a .jsonl file: {e}") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: a .json eval set is an array of records, got a {type(records).__name__}")
    yield from ((f"record {i}", r) for i, r in enumerate(records))


def _sample(record: Any, where: str, scorers: list[str], system_prompt: str) -> EvalSample:
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("bad_structure", f"expected an object, got {type(record).__name__}")
    if "prompt" in record and not ("messages" in record or "conversations" in record):
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise BadRecord("bad_structure", f"'prompt' must be non-empty text, got {record['prompt']!r}")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        messages, _ = to_messages(record)
    expected = _answer(record)
    if expected is None:
        if messages[-1]["role"] != "assistant":
            raise BadRecord("no_expected_answer", "has no 'answer' and its conversation does not end with the "
                                                  "assistant's answer")
        expected = messages.pop()["content"]
        if not messages:
            raise BadRecord("no_prompt", "its only turn is the assistant's answer: there is nothing to answer")
    if messages[-1]["role"] not in ("user", "tool"):
        role = messages[-1]["role"]
        raise BadRecord("no_prompt", f"the prompt ends on {'an' if role[0] in 'aeiou' else 'a'} {role} turn: the model "
                                     "answers a user's or a tool's turn")
    if not expected.strip():
        raise BadRecord("no_expected_answer", "the expected answer is empty")
    problem = check_expected(expected, scorers)
    if problem:
        raise BadRecord("unscorable_answer", problem)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    ident = record.get("id")
    return EvalSample(where, messages, expected, None if ident is None else str(ident), tools_of(record))


def _answer(record: dict) -> str | None:
    for key in ANSWER_KEYS:
        if key in record:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise BadRecord("bad_structure", f"'{key}' must be text or a number, got {value!r}")
            return value if isinstance(value, str) else _number_text(value)
    return None


def _number_text(value: int | float) -> str:
    text = repr(value)
    return re.sub(r"\.0$", "", text)


def check_renders(samples: list[EvalSample], tokenizer, name: str) -> None:
    """Every prompt renders with the model's chat template (the one training installs on its tokenizer), else a
    DataError naming the file and line: a template that raises on a conversation (a role it does not know, a
    system turn where it wants none) fails here, on the driver, not in every evaluation."""
    for sample in samples:
        try:
            tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                          tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja raises its own errors, and templates raise what they like
            raise DataError(f"{eval_set_path(name)}: {sample.where}: the chat template cannot render this prompt: "
                            f"{type(e).__name__}: {e}") from None
