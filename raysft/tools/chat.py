"""Talking to a trained model with the chat template it was trained with: one answer, or a multi-turn REPL.

Everything goes through ChatModel.reply (raysft.products.chat_model, which loads any model directory or checkpoint):
`raysft train --prompt`, `raysft chat --prompt` and each REPL turn generate the same way.
"""

from __future__ import annotations

import os
import sys

from raysft.products.chat_model import DEFAULT_MAX_NEW_TOKENS, ChatModel, Message


class Conversation:
    """The multi-turn history: each turn's prompt is the whole conversation so far, assistant replies included."""

    def __init__(self, model: ChatModel, system: str | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        self.model, self.system, self.max_new_tokens = model, system, max_new_tokens
        self.messages: list[Message]
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> str:
        turn = [*self.messages, {"role": "user", "content": text}]
        answer = self.model.reply(turn, self.max_new_tokens)  # an interrupted reply leaves the history as it was
        self.messages = [*turn, {"role": "assistant", "content": answer}]
        return answer


def generate_answer(model_dir: str | os.PathLike, prompt: str, max_new_tokens: int = 48) -> str:
    """One answer to one user message (what `raysft train --export DIR --prompt` prints)."""
    return ChatModel.load(model_dir).reply([{"role": "user", "content": prompt}], max_new_tokens)


def repl(conversation: Conversation) -> None:
    """Read user lines from stdin until /exit or end of input; works on a terminal and on piped input alike."""
    print("raysft: /reset clears the conversation, /exit (or Ctrl-D) quits", file=sys.stderr)
    try:
        while True:
            try:
                line = input("user> ").strip()
            except EOFError:
                print()
                return
            if line == "/exit":
                return
            if line == "/reset":
                conversation.reset()
                print("(conversation cleared)")
            elif line.startswith("/"):
                print(f"unknown command {line.split()[0]}: /reset clears the conversation, /exit quits")
            elif line:
                print(f"assistant> {conversation.ask(line)}")
    except KeyboardInterrupt:  # Ctrl-C, at the prompt or during a reply
        print()
