"""A model loaded to answer, from whatever raysft leaves: an HF model directory, an export, a peft adapter directory
or any checkpoint; `raysft chat` and the evaluation's hf engine (raysft.evals.engines) load and generate through it,
so that an evaluated answer is the one `raysft chat` gives.

raysft installs the training template on the tokenizer, and every checkpoint and export saves that tokenizer beside
the weights, so apply_chat_template here renders a conversation exactly as training did.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from raysft.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    TRAINING_FILES,
    CheckpointError,
    incomplete_reason,
    read_trainer_state,
)
from raysft.data.labels import stop_token_ids
from raysft.hf.files import check_model_dir
from raysft.model.build import check_pretrained_dir
from raysft.products.adapters import load_adapter_dir
from raysft.products.directories import CONFIG_FILE, kind
from raysft.products.export import check_checkpoint_tensors, export, full_checkpoint_tensors

Message = dict[str, str]
DEFAULT_MAX_NEW_TOKENS = 128


class ChatModel:
    """A model and its tokenizer, loaded once; greedy replies to whole conversations."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model, self.tokenizer = model.eval(), tokenizer
        # a peft model passes its base model's generation config on
        self.stop_ids = stop_ids(getattr(model, "generation_config", None), tokenizer)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ChatModel:
        """An HF model directory as it is, or a raysft checkpoint: a full one is an HF directory once checked
        complete; a sharded one is exported to a temporary directory first (export checks it). No progress bar:
        what the user reads after a load is the answer (`raysft train --export DIR --prompt`, `raysft chat`)."""
        with no_progress_bars():
            return cls._load(Path(path).expanduser())

    @classmethod
    def _load(cls, path: Path) -> ChatModel:
        what = kind(path)
        if what == "checkpoint":
            state = read_trainer_state(path)
            if state["mode"] == "sharded" or state.get("lora"):  # LoRA: the adapters merged into the base
                with tempfile.TemporaryDirectory(prefix="raysft-chat-") as tmp, warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP read in one process
                    return cls._from_hf_dir(export(path, Path(tmp) / "model", merge=bool(state.get("lora"))))
            reason = incomplete_reason(path)
            if reason:
                raise CheckpointError(f"{path}: incomplete checkpoint: {reason}")
            stored, where = full_checkpoint_tensors(path)
            check_checkpoint_tensors(stored, path, None, where)  # as export checks it: CheckpointError
            return cls._from_hf_dir(path, weights_checked=True)
        elif what == "partial":
            raise CheckpointError(f"{path}: incomplete checkpoint: it holds training state "
                                  f"({', '.join(n for n in TRAINING_FILES if (path / n).exists())}) but neither "
                                  f"{MANIFEST_FILE} nor {STATE_FILE}, so its weights cannot be checked; use a "
                                  "complete checkpoint or an exported model")
        elif what == "adapters":  # a peft adapter directory (raysft export of a LoRA checkpoint)
            return cls._from_hf_dir(path, load_adapter_dir(path))
        elif what is None:
            raise FileNotFoundError(f"{path}: neither an HF model directory (no {CONFIG_FILE}) "
                                    f"nor a raysft checkpoint (no {STATE_FILE})")
        return cls._from_hf_dir(path)

    @classmethod
    def _from_hf_dir(cls, path: Path, model: PreTrainedModel | None = None,
                     weights_checked: bool = False) -> ChatModel:
        # local_files_only: a path that does not exist must not turn into a hub download; no code of it runs
        check_model_dir(path)
        if model is None and not weights_checked:  # from_pretrained would make up a tensor the files lack
            check_pretrained_dir(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        if not tokenizer.chat_template:
            raise ValueError(f"{path}: the tokenizer has no chat template (not saved by raysft?)")
        return cls(model or AutoModelForCausalLM.from_pretrained(path, local_files_only=True, trust_remote_code=False),
                   tokenizer)

    def render(self, messages: list[Message]) -> str:
        """The text the model sees for its next reply: the conversation and the assistant's turn opening."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @torch.no_grad()
    def reply(self, messages: list[Message], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> str:
        """Greedy: the same conversation always gets the same answer."""
        inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
        output = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=self.tokenizer.pad_token_id,
                                     eos_token_id=self.stop_ids)
        return self.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (from_pretrained's "Loading weights") off for the block, and back on after it
    if they were on: a caller that turned them off keeps them off."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def stop_ids(generation_config, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What generation stops at: the eos_token_id of the model's generation_config.json (an export writes the
    template's end-of-turn tokens there; another model may list stops of its own; None: none) and, for a directory
    whose generation config lacks them, the training template's end-of-turn tokens and EOS."""
    configured = generation_config.eos_token_id if generation_config is not None else None
    configured = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys([*(i for i in configured if i is not None), *stop_token_ids(tokenizer)]))
