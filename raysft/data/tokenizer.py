"""Loading the tokenizer and choosing the chat template that renders training conversations."""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from raysft.config import BUILTIN, ConfigError, ModelConfig
from raysft.data.demo import DEMO_TOKENIZER
from raysft.hf.files import ModelDirError, refuse_code

# FastChat's vicuna_v1.1 conversation, text for text ("<s>SYSTEM USER: q ASSISTANT: a</s>USER: ..."), with the
# assistant text and its </s> marked for the loss.
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
VICUNA_TEMPLATE = (
    "{%- if bos_token -%}{{- bos_token -}}{%- endif -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{{- '" + VICUNA_SYSTEM.replace("'", "\\'") + "' -}}"
    "{%- set loop_messages = messages -%}{%- endif -%}{{- ' ' -}}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + ' ' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- 'ASSISTANT: ' -}}{% generation %}{{- m['content'] + eos_token -}}"
    "{% endgeneration %}"
    "{%- else -%}{{- raise_exception('the Vicuna template has no place for role ' + m['role']) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)

# data.chat_template values that name a template rather than a file (anything else is the path of a Jinja file).
CHAT_TEMPLATE_NAMES = ("auto", "vicuna")

# One of these (or a SentencePiece *.model, a *.tiktoken) makes a directory a tokenizer: the fast tokenizer's file,
# BPE's or WordPiece's vocabulary.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def resolve_tokenizer_dir(model: ModelConfig) -> Path:
    """The tokenizer's directory, checked to hold a vocabulary and to ask for no code. A ConfigError naming the key
    (model.tokenizer, or model.path when it is empty) where it cannot be used: no restart of the workers that
    load it changes that, so under Ray and torchrun it ends the run at once (raysft.errors.ends_the_run)."""
    key = "model.tokenizer" if model.tokenizer else "model.path"
    name = model.tokenizer or model.path
    if name == BUILTIN + "demo":
        return DEMO_TOKENIZER
    if name.startswith(BUILTIN):
        raise ConfigError(f"config key '{key}': unknown builtin {name!r} (known: {BUILTIN}demo)")
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(f"config key '{key}': {path} is not a directory with a Hugging Face tokenizer")
    if not any(f.name in VOCABULARY_FILES or f.suffix in (".model", ".tiktoken") for f in path.iterdir()):
        # transformers would build a tokenizer of a few special tokens from tokenizer_config.json alone
        raise ConfigError(f"config key '{key}': {path} has no tokenizer vocabulary (none of "
                          f"{', '.join(VOCABULARY_FILES)}, *.model; it holds "
                          f"{sorted(p.name for p in path.iterdir())})")
    try:
        refuse_code(path)  # before transformers would ask on the terminal whether to run it
    except ModelDirError as e:
        raise ConfigError(f"config key '{key}': {e}") from None
    return path


def load_tokenizer(model: ModelConfig, chat_template: str = "auto") -> PreTrainedTokenizerBase:
    """The model's tokenizer with the chat template used for training installed on it.

    local_files_only: nothing is ever fetched from a hub; trust_remote_code=False: no code of the directory runs.
    """
    directory = resolve_tokenizer_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    if not tokenizer.is_fast:
        raise ValueError(f"{directory}: a fast tokenizer is needed for assistant masks")
    source = f"the chat template of {directory}"
    if chat_template == "vicuna" or (chat_template == "auto" and not tokenizer.chat_template):
        tokenizer.chat_template, source = VICUNA_TEMPLATE, "the Vicuna v1.1 chat template"
    elif chat_template not in CHAT_TEMPLATE_NAMES:
        tokenizer.chat_template = read_template(chat_template)
        source = f"the chat template {chat_template}"
    tokenizer.chat_template_source = source  # error messages name it (raysft.data.labels.template_name)
    if tokenizer.pad_token is None:  # LLaMA tokenizers often have none; padding positions are masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_template(name: str) -> str:
    path = Path(name).expanduser()
    try:
        return path.read_text(encoding="utf-8-sig")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, UnicodeDecodeError) as e:
        # what no retry changes; another OSError (a storage hiccup) is raised as it is
        raise ConfigError(f"config key 'data.chat_template': cannot read {path} ({type(e).__name__}: "
                          f"{getattr(e, 'strerror', None) or e}); it is \"auto\", \"vicuna\" or the path of a Jinja "
                          "template file") from e


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Changes whenever the token ids or the rendered text of a conversation could change."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update((tokenizer.chat_template or "").encode())
    h.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()
