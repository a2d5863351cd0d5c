"""What generates the answers: the seam between the evaluation and an inference engine.

An engine takes the eval samples and returns one Answer per sample, in order (its text, how many tokens it took,
whether max_new_tokens cut it); it is opened on a Hugging Face
model directory (raysft.evals.runner makes one of any checkpoint). Two engines:

  hf    batched `generate` of transformers, loaded as `raysft chat` loads a model
        (raysft.products.chat_model.ChatModel: the same weights, tokenizer, chat template and stop tokens), so that
        a greedy answer is the one `raysft chat` gives. Prompts of neighbouring lengths are batched, padded on the
        left with an attention mask that hides the padding (length_sorted_batches, left_padded).
  vllm  vLLM through Ray Data (`ray.data.llm.vLLMEngineProcessorConfig`, `build_processor`), for GPU clusters where
        vLLM is installed, fed the same prompt token ids and stopping at the same tokens (`vllm_processor`). Its
        kernels are not transformers': greedy answers may differ from `raysft chat`'s where two tokens are nearly
        tied.

`resolve_engine` settles eval.engine "auto" once, on the driver, so that every evaluation of a run uses one engine.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from raysft.config import GenEvalConfig
from raysft.evals.evalset import EvalSample


class EvalTimeout(RuntimeError):
    """The evaluation ran past eval.timeout_s; the message says how far it got."""


@dataclass(frozen=True)
class Answer:
    """One generation: its text (cut at the first of eval.stop), the tokens generated, and whether it ended because
    it reached eval.max_new_tokens (cut: its score may say more of the limit than of the model)."""

    text: str
    tokens: int
    cut: bool


class Engine(Protocol):
    name: str

    def generate(self, samples: Sequence[EvalSample], deadline: float | None = None) -> list[Answer]:
        """One answer per sample, in order, each cut at the first of eval.stop; EvalTimeout past `deadline`
        (time.monotonic())."""


def resolve_engine(settings: GenEvalConfig) -> str:
    """"hf" or "vllm": eval.engine, with auto as vllm where this process can import it and GPUs are asked for."""
    if settings.engine != "auto":
        return settings.engine
    return "vllm" if settings.num_gpus > 0 and importlib.util.find_spec("vllm") is not None else "hf"


def open_engine(name: str, model_dir: Path, settings: GenEvalConfig) -> Engine:
    if name == "vllm":
        return VllmEngine(model_dir, settings)
    return HfEngine(model_dir, settings)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (none: the text), stripped as `raysft chat` strips its answers."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)] if cuts else text).strip()


class HfEngine:
    """transformers' generate on a model loaded as `raysft chat` loads it; greedy at eval.temperature 0."""

    name = "hf"

    def __init__(self, model_dir: Path, settings: GenEvalConfig):
        from transformers.utils import logging as hf_logging

        from raysft.products.chat_model import ChatModel

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bar in a log per evaluation
        try:
            self.chat, self.settings = ChatModel.load(model_dir), settings
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        # on a GPU where the evaluation has one (eval.num_gpus); `raysft chat` answers on the CPU, where the greedy
        # answers are its own: a GPU's kernels may break a near tie the other way
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.chat.model.to(self.device)
        tok = self.chat.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.chat.stop_ids[0]

    def prompt_ids(self, sample: EvalSample) -> list[int]:
        return prompt_ids(self.chat.tokenizer, sample)

    def generate(self, samples: Sequence[EvalSample], deadline: float | None = None) -> list[Answer]:
        prompts = [self.prompt_ids(sample) for sample in samples]
        return self.generate_ids(prompts, length_sorted_batches(prompts, self.settings.batch_size), deadline)

    @torch.no_grad()
    def generate_ids(self, prompts: list[list[int]], batches: list[list[int]],
                     deadline: float | None = None) -> list[Answer]:
        """One answer per prompt (token ids), generated in `batches` (lists of indices into `prompts`)."""
        s, tok = self.settings, self.chat.tokenizer
        sampling = {"do_sample": True, "temperature": s.temperature, "top_k": 0, "top_p": 1.0} \
            if s.temperature > 0 else {"do_sample": False}
        stops = {"stop_strings": list(s.stop), "tokenizer": tok} if s.stop else {}
        # sampling seeds torch's generator per batch: on the generator of its own here, so that an evaluation in the
        # training process (the torchrun launch) leaves the training's random stream as it found it
        devices = [torch.cuda.current_device()] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=s.temperature > 0):
            return self._generate(prompts, batches, deadline, {**sampling, **stops})

    def _generate(self, prompts: list[list[int]], batches: list[list[int]], deadline: float | None,
                  options: dict) -> list[Answer]:
        s, tok = self.settings, self.chat.tokenizer
        answers: list[Answer] = [None] * len(prompts)  # each filled by its batch
        for done, batch in enumerate(batches):
            if deadline is not None and time.monotonic() > deadline:
                raise EvalTimeout(f"eval.timeout_s={s.timeout_s:g} passed after {done} of {len(batches)} batches "
                                  f"({sum(map(len, batches[:done]))} of {len(prompts)} prompts)")
            if s.temperature > 0:
                torch.manual_seed(s.seed + done)
            ids, mask = left_padded([prompts[i] for i in batch], self.pad_id)
            out = self.chat.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                           max_new_tokens=s.max_new_tokens, pad_token_id=self.pad_id,
                                           eos_token_id=self.chat.stop_ids, **options)
            for row, i in enumerate(batch):
                answers[i] = decoded(out[row, ids.shape[1]:].tolist(), tok, self.chat.stop_ids, s)
        return answers


class VllmEngine:
    """vLLM through Ray Data's LLM processor: one vLLM engine of eval.num_gpus GPUs (its tensor-parallel size),
    fed the prompts in batches of eval.batch_size; vLLM and Ray Data place it on the cluster."""

    name = "vllm"

    def __init__(self, model_dir: Path | str, settings: GenEvalConfig):
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("eval.engine vllm: vLLM is not installed where the evaluation runs (pip install "
                               "vllm on the GPU nodes), or set eval.engine: hf")
        self.settings, self.tokenizer, self.stop_ids = settings, *tokenizer_and_stops(model_dir)
        self.processor = vllm_processor(str(model_dir), settings, self.stop_ids)

    def generate(self, samples: Sequence[EvalSample], deadline: float | None = None) -> list[Answer]:
        import ray

        rows = [{"index": i, "ids": prompt_ids(self.tokenizer, sample)} for i, sample in enumerate(samples)]
        out = self.processor(ray.data.from_items(rows)).take_all()
        if deadline is not None and time.monotonic() > deadline:
            raise EvalTimeout(f"eval.timeout_s={self.settings.timeout_s:g} passed while vLLM generated")
        answers = {row["index"]: decoded(list(row["tokens"]), self.tokenizer, self.stop_ids, self.settings)
                   for row in out}
        return [answers[i] for i in range(len(samples))]


def length_sorted_batches(prompts: list[list[int]], size: int) -> list[list[int]]:
    """Batches of `size` prompts (indices) of neighbouring lengths, the shortest first: each is padded (on the left)
    only to its longest, as TRL and lm-evaluation-harness batch."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[j : j + size] for j in range(0, len(order), size)]


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the left to the longest row, and the attention mask that hides the padding (generate
    then places each row's tokens from its first real one: its positions are the unpadded row's)."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def tokenizer_and_stops(model_dir: Path | str) -> tuple:
    """The model directory's tokenizer and the token ids generation stops at, as `raysft chat` takes them
    (raysft.products.chat_model.stop_ids), without loading the weights."""
    from transformers import AutoTokenizer, GenerationConfig

    from raysft.products.chat_model import stop_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json
        generation_config = None
    return tokenizer, stop_ids(generation_config, tokenizer)


def vllm_processor(model_source: str, settings: GenEvalConfig, stop_ids: list[int]):
    """Ray Data's vLLM processor (`ray.data.llm`), fed token ids: rows {"index", "ids"} in, {"index", "tokens"}
    out. Its chat-template and tokenize stages are off, so the prompt is the one the hf engine and training render
    (Ray's tokenize stage adds special tokens to a rendered template: a second BOS; its template stage drops tools),
    and its detokenize stage too (the answer is decoded as the hf engine decodes it). Generation stops at the
    template's end-of-turn tokens (`stop_ids`), which a full checkpoint's directory has no generation config for.
    Building it needs Ray, not vLLM."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    if not ray.is_initialized():  # `raysft eval` outside a run: Ray Data needs a Ray, a local one here
        ray.init(logging_level="ERROR", log_to_driver=False)
    sampling = {"temperature": settings.temperature, "max_tokens": settings.max_new_tokens, "stop_token_ids": stop_ids,
                **({"stop": list(settings.stop)} if settings.stop else {}),
                **({"seed": settings.seed} if settings.temperature > 0 else {})}
    config = vLLMEngineProcessorConfig(
        model_source=model_source, batch_size=settings.batch_size, concurrency=1,
        engine_kwargs={"tensor_parallel_size": max(1, int(settings.num_gpus))},
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False)
    return build_processor(
        config,
        preprocess=lambda row: {"index": row["index"], "tokenized_prompt": row["ids"], "sampling_params": sampling},
        postprocess=lambda row: {"index": row["index"], "tokens": row["generated_tokens"]})


def prompt_ids(tokenizer, sample: EvalSample) -> list[int]:
    """The prompt's tokens as `raysft chat` and training render a conversation: the chat template (with the
    sample's tools) and the assistant's turn opening."""
    ids = tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    return ids[0].tolist()


def decoded(new: list[int], tokenizer, stop_ids: list[int], settings: GenEvalConfig) -> Answer:
    """A generation's tokens as its Answer: up to its first stop token, decoded, cut at the first stop string;
    cut by the limit when it has neither and reached eval.max_new_tokens."""
    ends = [k for k, token in enumerate(new) if token in stop_ids]
    new = new[: ends[0] + 1] if ends else new  # a finished row is padded after its stop token
    text = tokenizer.decode(new, skip_special_tokens=True)
    answer = cut_at_stop(text, settings.stop)
    return Answer(answer, len(new), not ends and len(new) >= settings.max_new_tokens and answer == text.strip())
