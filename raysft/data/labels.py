"""Assistant-only labels, found in the one rendering of the whole conversation that the model trains on.

A label is right when it sits on exactly the tokens the model must produce: each assistant message's text as the
chat template renders it, and the end-of-turn token the template writes right after it. Two ways to find them:

- Templates with `{% generation %}` blocks say so themselves (transformers reports the blocks' character spans).
- Any other template: the conversation is rendered twice as text, once as it is and once with every assistant text
  wrapped in unique markers (the whitespace around it left outside, so `trim` acts as on the real text) and every
  tool call's name prefixed with one. With the markers removed the two must be equal character for character (else
  the template inspects the text it renders, and the record is refused): the markers' places are then the places of
  the assistant texts in the real rendering. Nothing is inferred from renderings of prefixes, so a template that
  moves text between turns, opens the generation prompt with more than the history holds, or writes the end-of-turn
  token only when another message follows is labelled as it renders.

The end-of-turn tokens and the text a tool call starts with are learnt once per template from probe conversations
(`TemplateProfile`). A template that drops the beginning of an assistant text (Qwen3 drops the reasoning of earlier
turns) is labelled on what the rendering holds, and the record counts as rewritten. What cannot be located without
doubt is a BadRecord naming the template; nothing is guessed.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Literal

from transformers import BatchEncoding, PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from raysft.data.conversation import BadRecord, Conversation

IGNORE_INDEX = -100
TrainOn = Literal["all_assistant", "last_assistant"]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# Markers: letters and digits only, so that json encoding, HTML escaping and whitespace trimming leave them whole.
_NONCE = "qXrAySfTmK"
_MARK = re.compile(_NONCE + r"([SENUV])(\d+)_(\d+)" + _NONCE[::-1])
# The probe's tool call; 9-character ids because Mistral's templates insist on them.
_PROBE_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}


def mark(kind: str, message: int, item: int = 0) -> str:
    """S/E: start/end of assistant text, N: start of a tool call's name, U/V: start/end of a probe's user text."""
    return f"{_NONCE}{kind}{message}_{item}{_NONCE[::-1]}"


@dataclass(frozen=True)
class Labelled:
    input_ids: list[int]
    labels: list[int]
    rewritten_turns: int = 0
    """Assistant turns whose text the template renders otherwise than written (labelled as rendered)."""


@dataclass(frozen=True)
class TemplateProfile:
    """What a template writes around assistant turns, learnt once from probe conversations."""

    end_of_turn: frozenset[str]
    """Special tokens that close an assistant turn (not those that open the next message)."""
    special: re.Pattern
    """Matches any special token of the tokenizer, longest first."""
    call_prefix: str | None
    """What an assistant turn with only tool calls writes before the first call's name; None: no tool support."""
    call_content: str | None = ""
    """The content a tool-call-only message must carry to render ("" or None, templates differ)."""
    arguments_as_text: bool = False
    """Whether the template wants a call's arguments as a JSON string instead of an object."""
    closes_turn: str | None = None
    """The end-of-turn token the template writes after an assistant turn that another message follows."""
    open_last_turn: bool = False
    """Whether the template writes no end-of-turn token after a conversation's last assistant turn (vLLM's example
    ChatML writes `<|im_end|>` only between messages): raysft then supervises `closes_turn` there itself."""


def template_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return getattr(tokenizer, "chat_template_source", "") or f"the chat template of {tokenizer.name_or_path}"


def marks_generation(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(_GENERATION_TAG.search(tokenizer.chat_template or ""))


def label_conversation(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, max_seq_len: int,
                       train_on: TrainOn = "all_assistant", context_turns: int = 0) -> Labelled:
    """input_ids and labels (IGNORE_INDEX outside the supervised spans), truncated to max_seq_len. The first
    `context_turns` assistant turns are context, not supervised (a preference pair's prompt)."""
    try:
        if marks_generation(tokenizer):
            (text, spans), rewritten = _generation_spans(tokenizer, conversation), 0
        else:
            text, spans, rewritten = rendered_spans(tokenizer, conversation)
    except BadRecord:
        raise
    except Exception as e:  # jinja's raise_exception and friends: the template rejects this conversation
        raise BadRecord("template_error", f"{template_name(tokenizer)} failed: {e}") from e
    if context_turns:
        turns = sum(m["role"] == "assistant" for m in conversation.messages)
        if len(spans) != turns:  # generation blocks that do not wrap each assistant turn once
            raise BadRecord("template_error", f"{template_name(tokenizer)} marks {len(spans)} generation spans for "
                            f"{turns} assistant turns, so which belong to the prompt is not certain")
        spans = spans[context_turns:]
    if train_on == "last_assistant":
        spans = spans[-1:]
    encoded = tokenizer(text, add_special_tokens=False)
    input_ids = list(encoded["input_ids"])
    labels = [IGNORE_INDEX] * len(input_ids)
    for start, end in spans:  # every token that holds a supervised character
        first, last = _token_at(encoded, range(start, end)), _token_at(encoded, range(end - 1, start - 1, -1))
        if first is None:
            continue
        # a character split over several tokens (byte-level BPE) maps to its first: take the others too
        while first > 0 and encoded.token_to_chars(first - 1).end > start:
            first -= 1
        while last + 1 < len(input_ids) and encoded.token_to_chars(last + 1).start < end:
            last += 1
        labels[first : last + 1] = input_ids[first : last + 1]
    return Labelled(input_ids[:max_seq_len], labels[:max_seq_len], rewritten)


def _token_at(encoded: BatchEncoding, chars: range) -> int | None:
    """The token of the first of `chars` that belongs to one (a normalizer may drop a character from every token)."""
    for char in chars:
        token = encoded.char_to_token(char)
        if token is not None:
            return token
    return None


def _generation_spans(tokenizer: PreTrainedTokenizerBase,
                      conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
    messages = [{k: v for k, v in m.items() if v is not None} for m in conversation.messages]
    rendered, spans = render_jinja_template([messages], tools=conversation.tools,
                                            chat_template=tokenizer.chat_template, return_assistant_tokens_mask=True,
                                            **tokenizer.special_tokens_map)
    return rendered[0], [tuple(s) for s in spans[0] if s[1] > s[0]]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None,
            add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def strip_marks(text: str) -> tuple[str, dict[tuple[str, int, int], list[int]]]:
    """The text without markers, and each marker's positions in it."""
    places: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    pieces, last, removed = [], 0, 0
    for m in _MARK.finditer(text):
        pieces.append(text[last : m.start()])
        places[m[1], int(m[2]), int(m[3])].append(m.start() - removed)
        removed += m.end() - m.start()
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces), places


def _wrap(content: str, message: int) -> str:
    """Markers around the text, the whitespace on either side left outside them (templates may trim it)."""
    core = content.strip()
    if not core:
        return content + mark("S", message) + mark("E", message)
    lead = content[: len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()) :]
    return lead + mark("S", message) + core + mark("E", message) + trail


def rendered_spans(tokenizer: PreTrainedTokenizerBase,
                   conversation: Conversation) -> tuple[str, list[tuple[int, int]], int]:
    """The rendered text, the character span of every assistant turn in it, and how many turns were rewritten."""
    profile = template_profile(tokenizer)
    name = template_name(tokenizer)
    messages = _as_template_wants(conversation.messages, profile, name)
    if _NONCE in json.dumps(messages, ensure_ascii=False):
        raise BadRecord("template_error", f"the record contains raysft's marker {_NONCE!r}")
    wrapped = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            m = dict(m)
            if isinstance(m.get("content"), str) and (m["content"] or not m.get("tool_calls")):
                m["content"] = _wrap(m["content"], i)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "name": mark("N", i, k) + c["function"]["name"]}}
                                   for k, c in enumerate(m["tool_calls"])]
        wrapped.append(m)
    real = _render(tokenizer, messages, conversation.tools)
    text, places = strip_marks(_render(tokenizer, wrapped, conversation.tools))
    if text != real:
        raise BadRecord("template_error", f"{name} renders assistant text differently when it is marked (it inspects "
                        "the text), so raysft cannot locate it without doubt: add {% generation %} blocks around the "
                        "assistant text in the template")

    def place(key: tuple[str, int, int]) -> int | None:
        found = places.get(key, [])
        if len(found) > 1:
            raise BadRecord("template_error", f"{name} renders messages[{key[1]}] {len(found)} times")
        return found[0] if found else None

    spans, rewritten = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        calls = m.get("tool_calls") or []
        names = [place(("N", i, k)) for k in range(len(calls))]
        if any(n is None for n in names):
            raise BadRecord("template_error", f"{name} does not render the tool calls of messages[{i}]")
        start, end = place(("S", i, 0)), place(("E", i, 0))
        if start is None and end is None and not calls:
            raise BadRecord("template_error", f"{name} does not render the assistant text of messages[{i}]")
        if end is not None:
            core = m["content"].strip()
            if start is None:  # the template dropped the text's beginning: label the part it kept
                start = end - len(_kept_tail(text[:end], core))
            rewritten += text[start:end] != core
        else:
            start = names[0] - len(profile.call_prefix)
            if text[start : names[0]] != profile.call_prefix:
                raise BadRecord("template_error", f"{name} writes tool calls in messages[{i}] otherwise than in its "
                                "probe, so where the turn starts is not certain")
        last = max(p for p in (end, *names) if p is not None)
        spans.append((start, _end_of_turn(text, last, profile, bool(calls), name, i)))
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise BadRecord("template_error", f"{name} renders the assistant turns out of order")
    if spans and messages[-1]["role"] == "assistant":
        text, spans[-1] = _close_last_turn(text, spans[-1], profile, name)
    return text, spans, rewritten


def _close_last_turn(text: str, span: tuple[int, int], profile: TemplateProfile,
                     name: str) -> tuple[str, tuple[int, int]]:
    """The model must learn to stop after its last answer too: a template that ends the conversation without an
    end-of-turn token gets the one it writes between turns, supervised, right after the answer (what a reply at
    inference ends with); one that writes none at all is refused."""
    start, end = span
    if any(text.startswith(token, end - len(token)) for token in profile.end_of_turn):
        return text, span
    if profile.closes_turn is None:
        raise BadRecord("template_error", f"{name} writes no end-of-turn token after an assistant turn, so the model "
                        "would never learn to stop its reply: end each assistant turn with one (eos_token, say)")
    return text[:end] + profile.closes_turn + text[end:], (start, end + len(profile.closes_turn))


def _kept_tail(before: str, core: str) -> str:
    """The longest end of `core` that the rendering holds right before the end marker, without the whitespace that
    then starts it (that whitespace is the template's own separator: the template lstripped it off the text)."""
    k = 0
    while k < len(core) and k < len(before) and before[-1 - k] == core[-1 - k]:
        k += 1
    return core[len(core) - k :].lstrip()


def _end_of_turn(text: str, last: int, profile: TemplateProfile, tool_turn: bool, name: str, message: int) -> int:
    """Where the turn's supervised span ends: after the end-of-turn token the template writes next, if it writes one
    before any other special token (after only whitespace, or after the rest of the tool calls)."""
    found = profile.special.search(text, last)
    if found and found[0] in profile.end_of_turn and (tool_turn or not text[last : found.start()].strip()):
        return found.end()
    if tool_turn:
        raise BadRecord("template_error", f"{name} ends the tool calls of messages[{message}] without an "
                        "end-of-turn token, so where they end is not certain")
    return last


def _as_template_wants(messages: list[dict], profile: TemplateProfile, name: str) -> list[dict]:
    """Tool calls in the form the template renders: its content value for call-only turns, arguments as text."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    if profile.call_prefix is None:
        raise BadRecord("template_error", f"{name} does not render tool calls")
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m)
            if not m.get("content"):
                m["content"] = profile.call_content
            if profile.arguments_as_text:
                m["tool_calls"] = [{**c, "function": {**c["function"],
                                                      "arguments": json.dumps(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
        out.append(m)
    return out


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens generation stops at: those that end an assistant turn in the training template (learnt by the
    probe: `<|im_end|>`, `<|eot_id|>`, ...) and EOS. An export writes them into generation_config.json."""
    tokens = sorted(template_profile(tokenizer).end_of_turn) if tokenizer.chat_template else []
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens] + [tokenizer.eos_token_id]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id))


# --- what a template writes around assistant turns, learnt from probes -----------------------------------------


def template_profile(tokenizer: PreTrainedTokenizerBase) -> TemplateProfile:
    """Cached on the tokenizer for its current chat template."""
    cached = tokenizer.__dict__.get("_raysft_profile")
    if cached and cached[0] == tokenizer.chat_template:
        return cached[1]
    profile = _probe(tokenizer)
    tokenizer.__dict__["_raysft_profile"] = (tokenizer.chat_template, profile)
    return profile


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    tokens = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(tokens | set(tokenizer.all_special_tokens), key=len, reverse=True)


def _probe(tokenizer: PreTrainedTokenizerBase) -> TemplateProfile:
    special = re.compile("|".join(map(re.escape, _special_tokens(tokenizer))) or "(?!)")
    user = [{"role": "user", "content": mark("U", i) + text + mark("V", i)}
            for i, text in ((0, "What is the weather in Paris?"), (2, "Thanks."))]
    probe = [user[0], {"role": "assistant", "content": mark("S", 1) + "Let me check." + mark("E", 1)},
             user[1], {"role": "assistant", "content": mark("S", 3) + "You are welcome." + mark("E", 3)}]
    try:
        text, places = strip_marks(_render(tokenizer, probe))
    except Exception:  # noqa: BLE001 - a template that refuses even this has no turns to learn from
        eos = tokenizer.eos_token
        return TemplateProfile(frozenset([eos] if eos else []), special, None, closes_turn=eos or None)
    end_of_turn, closes_turn, open_last_turn = set(), None, True
    for message, next_user in ((1, 2), (3, None)):
        end = places[("E", message, 0)][0]
        found = special.search(text, end)
        if not found or text[end : found.start()].strip():
            continue
        token = found[0]
        if next_user is None:  # a last turn: only a token already seen closing a turn, or EOS
            if token in end_of_turn or token == tokenizer.eos_token:
                end_of_turn.add(token)
                open_last_turn = False
            continue
        # the special tokens between this turn and the next user text: the last of them opens the user's turn
        between = special.findall(text, end, places[("U", next_user, 0)][0])
        if token == tokenizer.eos_token or between[-1] != token:
            end_of_turn.add(token)
            closes_turn = token
    header = text[places[("V", 0, 0)][0] : places[("S", 1, 0)][0]]
    profile = TemplateProfile(frozenset(end_of_turn), special, None, closes_turn=closes_turn,
                              open_last_turn=open_last_turn)
    return _probe_tool_calls(tokenizer, profile, user[0], header)


def _probe_tool_calls(tokenizer: PreTrainedTokenizerBase, profile: TemplateProfile, user: dict,
                      header: str) -> TemplateProfile:
    """Render one tool call in each form templates expect; the first that shows the call gives the prefix: what
    the turn writes after the user's text beyond what a text answer's header writes."""
    for content in ("", None):
        for as_text in (False, True):
            args = _PROBE_CALL["arguments"]
            call = {"id": _PROBE_CALL["id"], "type": "function",
                    "function": {"name": mark("N", 1) + _PROBE_CALL["name"],
                                 "arguments": json.dumps(args) if as_text else args}}
            probe = [user, {"role": "assistant", "content": content, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "name": _PROBE_CALL["name"],
                      "content": "sunny"},
                     {"role": "assistant", "content": "It is sunny."}]
            try:
                text, places = strip_marks(_render(tokenizer, probe))
            except Exception:  # noqa: BLE001 - this form is not the one; try the next
                continue
            if len(places.get(("N", 1, 0), [])) != 1:
                continue
            written = text[places[("V", 0, 0)][0] : places[("N", 1, 0)][0]]
            prefix = written[len(os.path.commonprefix([header, written])) :]
            return replace(profile, call_prefix=prefix, call_content=content, arguments_as_text=as_text)
    return profile
