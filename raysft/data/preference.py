"""Preference records -> a pair of labelled sequences: the chosen and the rejected answer, each rendered with the
model's chat template after the same prompt, only the answer's tokens labelled.

The formats users have:
- TRL's explicit prompt: `{"prompt", "chosen", "rejected"}`, as plain text (the prompt a user message, each answer
  an assistant message) or as conversational message lists (the prompt's messages, each answer's messages);
- full conversations, the prompt implicit: `{"chosen": [...], "rejected": [...]}` as HH-RLHF and UltraFeedback
  hold them (message lists, or HH-RLHF's `"\\n\\nHuman: ... \\n\\nAssistant: ..."` text). The prompt is what the two
  conversations share; their first difference must be where the answers start.

Messages are OpenAI (`role`/`content`) or ShareGPT (`from`/`value`), checked as raysft.data.conversation checks
SFT records. The labels come from raysft.data.labels, the SFT machinery, with the prompt's own assistant turns as
unsupervised context, so a template it refuses for SFT is refused here too. A pair is refused (a BadRecord whose
reason counts under data.on_bad_record: skip) when the prompt's tokens differ between the two renderings or when
the answers are the same tokens.

A sequence longer than data.max_seq_len is what dpo.truncation_mode says (TRL's truncation_mode, each sequence
cut on its own): "keep_start" cuts its end, "keep_end" its start (the prompt's beginning goes first), "skip" drops
the pair and "error" refuses it (`answer_truncated`: a cut answer's log-probability is not the answer's). A prompt
that leaves no room for an answer token is `prompt_too_long` under all but keep_end. Dropped pairs (SkippedPair)
are counted in the store's manifest whatever data.on_bad_record says.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from raysft.config import DpoConfig
from raysft.config.sections import TruncationMode
from raysft.data.conversation import ROLES, BadRecord, Conversation, to_conversation
from raysft.data.labels import IGNORE_INDEX, Labelled, label_conversation

_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


class SkippedPair(BadRecord):
    """A pair that dpo.truncation_mode drops (too long under "skip", its prompt too long under "keep_start"): counted
    in the manifest under its reason and skipped whatever data.on_bad_record says, as TRL drops it."""


@dataclass(frozen=True)
class PreferencePair:
    """Both full conversations, normalized; the first `prompt_messages` messages of each are the shared prompt."""

    chosen: Conversation
    rejected: Conversation
    prompt_messages: int

    @property
    def context_turns(self) -> int:
        """Assistant turns inside the prompt (context, not supervised)."""
        return sum(m["role"] == "assistant" for m in self.chosen.messages[: self.prompt_messages])


def to_pair(record: Any, system_prompt: str = "") -> PreferencePair:
    """Either format, normalized; what would train on garbage is a BadRecord naming the key."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise BadRecord("bad_structure", "a preference record needs 'chosen' and 'rejected'")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if prompt is None or _is_full_conversation(chosen):
        return _implicit_prompt(_messages(chosen, "chosen"), _messages(rejected, "rejected"), record.get("tools"),
                                system_prompt)
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _list(prompt, "prompt")
    answers = [[{"role": "assistant", "content": a}] if isinstance(a, str) else _list(a, key)
               for a, key in ((chosen, "chosen"), (rejected, "rejected"))]
    for answer, key in zip(answers, ("chosen", "rejected"), strict=True):
        if not answer or _role(answer[0]) != "assistant":
            raise BadRecord("bad_structure", f"'{key}' must start with an assistant message (the answer)")
    convs = [_conversation(prompt + a, record.get("tools"), system_prompt, key)
             for a, key in zip(answers, ("chosen", "rejected"), strict=True)]
    added = len(convs[0].messages) - len(prompt) - len(answers[0])  # the system prompt, if one was inserted
    return PreferencePair(convs[0], convs[1], len(prompt) + added)


def _implicit_prompt(chosen: list, rejected: list, tools: Any, system_prompt: str) -> PreferencePair:
    convs = [_conversation(m, tools, system_prompt, key) for m, key in ((chosen, "chosen"), (rejected, "rejected"))]
    a, b = convs[0].messages, convs[1].messages
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    if shared == len(a) == len(b):
        raise BadRecord("identical_answers", "'chosen' and 'rejected' are the same conversation")
    if shared in (len(a), len(b)) or a[shared]["role"] != "assistant" or b[shared]["role"] != "assistant":
        raise BadRecord("prompt_mismatch", f"'chosen' and 'rejected' differ at message {shared}, which is not an "
                        "assistant answer in both: their prompts differ")
    return PreferencePair(convs[0], convs[1], shared)


def _is_full_conversation(answer: Any) -> bool:
    """An answer given as a whole conversation (UltraFeedback's chosen/rejected beside its prompt string)."""
    return isinstance(answer, list) and bool(answer) and _role(answer[0]) not in ("assistant", None)


def _role(message: Any) -> str | None:
    if not isinstance(message, dict):
        return None
    return ROLES.get(message.get("role", message.get("from")))


def _list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        raise BadRecord("bad_structure", f"'{key}' must be a string or a list of messages, got "
                        f"{type(value).__name__}")
    return value


def _messages(value: Any, key: str) -> list:
    """A full conversation: a list of messages, or HH-RLHF's Human/Assistant text."""
    if not isinstance(value, str):
        return _list(value, key)
    parts = _HH_TURN.split(value)
    if len(parts) < 3 or parts[0].strip():
        raise BadRecord("bad_structure", f"'{key}' is text but not HH-RLHF's '\\n\\nHuman: ... \\n\\nAssistant: ...' "
                        "(give a 'prompt' to train on plain-text answers)")
    return [{"role": _HH_ROLES[role], "content": text.strip()} for role, text in zip(parts[1::2], parts[2::2],
                                                                                     strict=True)]


def _conversation(messages: list, tools: Any, system_prompt: str, key: str) -> Conversation:
    """Checked as an SFT record is; the BadRecord says which side of the pair."""
    field = "conversations" if messages and isinstance(messages[0], dict) and "from" in messages[0] else "messages"
    try:
        return to_conversation({field: messages, **({"tools": tools} if tools is not None else {})}, system_prompt)
    except BadRecord as e:
        raise BadRecord(e.reason, f"'{key}': {e}") from None


def label_pair(tokenizer: PreTrainedTokenizerBase, pair: PreferencePair, max_seq_len: int,
               truncation_mode: TruncationMode = DpoConfig.truncation_mode) -> tuple[Labelled, Labelled]:
    """(chosen, rejected): each the whole rendering, labels on its answer's tokens only, fitted into max_seq_len as
    truncation_mode says (see the module's docstring)."""
    rows = [label_conversation(tokenizer, conv, sys.maxsize, context_turns=pair.context_turns)
            for conv in (pair.chosen, pair.rejected)]
    starts = []
    for row, key in zip(rows, ("chosen", "rejected"), strict=True):
        first = next((i for i, t in enumerate(row.labels[1:], 1) if t != IGNORE_INDEX), None)
        if first is None:
            raise BadRecord("no_assistant_tokens", f"the {key} answer has no token to learn")
        starts.append(first)
    chosen, rejected = rows
    if chosen.input_ids == rejected.input_ids:
        raise BadRecord("identical_answers", "the chosen and the rejected answer are the same tokens")
    if chosen.input_ids[: starts[0]] != rejected.input_ids[: starts[1]]:
        raise BadRecord("prompt_mismatch", "the chat template renders the prompt differently before the chosen and "
                        "the rejected answer, so the two are not answers to the same context")
    if max(len(row.input_ids) for row in rows) <= max_seq_len:
        return chosen, rejected
    return _fit(rows, starts[0], max_seq_len, truncation_mode)


def _fit(rows: list[Labelled], prompt: int, max_seq_len: int, mode: TruncationMode) -> tuple[Labelled, Labelled]:
    """A pair with a sequence longer than max_seq_len, cut or refused by mode; `prompt` is its prompt's tokens."""
    refusal = BadRecord if mode == "error" else SkippedPair
    hint = " (dpo.truncation_mode: keep_end keeps the end of each sequence)" if mode == "error" else ""
    if prompt >= max_seq_len and mode != "keep_end":  # a label at position max_seq_len or later: none is left
        raise refusal("prompt_too_long", f"the prompt has {prompt} tokens, data.max_seq_len={max_seq_len} leaves no "
                      f"room for an answer token{hint}")
    if mode in ("error", "skip"):
        key, row = max(zip(("chosen", "rejected"), rows, strict=True), key=lambda kr: len(kr[1].input_ids))
        raise refusal("answer_truncated", f"the {key} sequence has {len(row.input_ids)} tokens, more than "
                      f"data.max_seq_len={max_seq_len}: its answer would be cut" + (
                          " (dpo.truncation_mode: keep_start or keep_end cuts it, skip drops such pairs)"
                          if mode == "error" else ""))
    cut = slice(None, max_seq_len) if mode == "keep_start" else slice(-max_seq_len, None)
    chosen, rejected = (Labelled(row.input_ids[cut], row.labels[cut], row.rewritten_turns) for row in rows)
    return chosen, rejected
