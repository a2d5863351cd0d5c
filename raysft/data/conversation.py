"""Input records → chat messages as chat templates take them (OpenAI-style dicts), tool calls included.

Two record formats are read:
- ShareGPT/FastChat: `{"conversations": [{"from", "value"}], "tools"?}`. Tool use as in LLaMA-Factory's ShareGPT
  format: a `function_call` turn (the assistant calls: one JSON object or a list of `{"name", "arguments"}`), an
  `observation` turn (the tool's result), and `tools` as a list or a JSON string of function schemas.
- OpenAI: `{"messages": [{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}], "tools"?}`, where an
  assistant's `tool_calls` are `[{"id", "type": "function", "function": {"name", "arguments"}}]` with `arguments` a
  JSON string (as the API writes them) or an object.

Everything that would train on garbage is a BadRecord whose message names the turn and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class BadRecord(Exception):
    """A record that cannot be trained on; `reason` is the manifest's counter key, the message says where."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system", "developer": "system", "tool": "tool", "function": "tool", "observation": "tool",
         "function_call": "assistant"}
SHAREGPT_CALL_ROLE = "function_call"  # a ShareGPT turn whose value is the assistant's tool call(s), as JSON


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict] | None = field(default=None)


def to_conversation(record: Any, system_prompt: str = "") -> Conversation:
    """Normalize either input format, rejecting what would train on garbage; `system_prompt` opens conversations
    that have no system message."""
    messages, field_name = to_messages(record)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", f"'{field_name}' has no assistant turn to learn from")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return Conversation(messages, _tools(record.get("tools")))


def to_messages(record: Any) -> tuple[list[dict[str, Any]], str]:
    """The record's turns as messages, and the field they came from ("conversations" or "messages"); a record
    that is not a conversation of either format is a BadRecord. Whether it can be trained on is to_conversation's
    question: an evaluation prompt (raysft.evals) ends before the answer it asks for."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("bad_structure", f"expected an object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, content_key, field_name = record["conversations"], "from", "value", "conversations"
    elif "messages" in record:
        turns, role_key, content_key, field_name = record["messages"], "role", "content", "messages"
    else:
        raise BadRecord("bad_structure", "has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    if not isinstance(turns, list):
        raise BadRecord("bad_structure", f"'{field_name}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise BadRecord("empty_conversation", f"'{field_name}' is empty")
    return [_message(turn, f"{field_name}[{i}]", role_key, content_key) for i, turn in enumerate(turns)], field_name


def tools_of(record: dict) -> list[dict] | None:
    """The function schemas a record offers, as chat templates take them (BadRecord if they are malformed)."""
    return _tools(record.get("tools"))


def _message(turn: Any, where: str, role_key: str, content_key: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRecord("bad_structure", f"{where} must be an object, got {type(turn).__name__}")
    raw_role = turn.get(role_key)
    if raw_role not in ROLES:
        raise BadRecord("unknown_role", f"{where}.{role_key} is {raw_role!r}; known roles: {', '.join(ROLES)}")
    role, content = ROLES[raw_role], turn.get(content_key)
    if raw_role == SHAREGPT_CALL_ROLE:
        return {"role": "assistant", "content": "", "tool_calls": _sharegpt_calls(content, f"{where}.{content_key}")}
    calls = turn.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        message = {"role": "assistant", "content": "" if content is None else content,
                   "tool_calls": _openai_calls(calls, f"{where}.tool_calls")}
        if not isinstance(message["content"], str):
            raise BadRecord("non_string_content",
                            f"{where}.{content_key} must be a string or null, got {type(content).__name__}")
        return message
    if not isinstance(content, str):
        raise BadRecord("non_string_content", f"{where}.{content_key} must be a string, got {type(content).__name__}")
    message = {"role": role, "content": content}
    if role == "tool":  # the ids and names some templates need to pair a result with its call
        message.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
    return message


def _call(name: Any, arguments: Any, where: str, call_id: Any = None) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise BadRecord("bad_tool_call", f"{where}: a tool call needs a non-empty string 'name', got {name!r}")
    if isinstance(arguments, str):  # the OpenAI API's form; chat templates expect the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tool_call", f"{where}: 'arguments' is not valid JSON: {e.msg}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadRecord("bad_tool_call", f"{where}: 'arguments' must be an object, got {type(arguments).__name__}")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call_id, str):
        call["id"] = call_id
    return call


def _openai_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise BadRecord("bad_tool_call", f"{where} must be a non-empty list, got {calls!r}")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise BadRecord("bad_tool_call", f"{where}[{i}] must be an object with a 'function' object")
        out.append(_call(fn.get("name"), fn.get("arguments"), f"{where}[{i}].function", call.get("id")))
    return out


def _sharegpt_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tool_call", f"{where}: a function_call value must be JSON: {e.msg}") from None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) for c in calls):
        raise BadRecord("bad_tool_call", f"{where}: expected a call object or a list of them, got {value!r}")
    return [_call(c.get("name"), c.get("arguments", c.get("parameters")), f"{where}[{i}]", c.get("id"))
            for i, c in enumerate(calls)]


def _tools(tools: Any) -> list[dict] | None:
    """Function schemas the record offers, as templates take them (a list of objects); ShareGPT keeps a JSON string."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tools", f"'tools' is a string but not JSON: {e.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("bad_tools", f"'tools' must be a list of function schemas (objects), got {tools!r}")
    return [t if "function" in t or "type" in t else {"type": "function", "function": t} for t in tools]
