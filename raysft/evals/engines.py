"""What generates the answers: the seam between the evaluation and an inference engine.

An engine takes the eval samples and returns one Answer per sample, in order (its text, how many tokens it took,
whether max_new_tokens cut it); it is opened on a Hugging Face
model directory (raysft.evals.runner makes one of any checkpoint). Two engines:

  hf    batched `generate` of transformers, loaded as `raysft chat` loads a model
        (raysft.products.chat_model.ChatModel: the same weights, tokenizer, chat template and stop tokens), so that
        a greedy answer is the one `raysft chat` gives. Prompts are batched only with prompts of the same length,
        so no batch is padded: a row of a batch then computes what it computes alone.
  vllm  vLLM through Ray Data (`ray.data.llm.vLLMEngineProcessorConfig`, `build_processor`), for GPU clusters where
        vLLM is installed; its chat-template stage renders the prompts with the template saved in the model
        directory, the same one. Its kernels are not transformers': greedy answers may differ from `raysft chat`'s
        where two tokens are nearly tied.

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

    def prompt_ids(self, sample: EvalSample) -> list[int]:
        """The prompt's tokens as `raysft chat` renders a conversation: the chat template and the assistant's turn
        opening (ChatModel.reply)."""
        ids = self.chat.tokenizer.apply_chat_template(sample.messages, tools=sample.tools, add_generation_prompt=True,
                                                      return_tensors="pt", return_dict=True)["input_ids"]
        return ids[0].tolist()

    @torch.no_grad()
    def generate(self, samples: Sequence[EvalSample], deadline: float | None = None) -> list[Answer]:
        s, tok = self.settings, self.chat.tokenizer
        prompts = [self.prompt_ids(sample) for sample in samples]
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(i)
        batches = [group[j : j + s.batch_size] for group in by_length.values()
                   for j in range(0, len(group), s.batch_size)]
        answers: list[Answer | None] = [None] * len(samples)
        sampling = {"do_sample": True, "temperature": s.temperature, "top_k": 0, "top_p": 1.0} \
            if s.temperature > 0 else {"do_sample": False}
        stops = {"stop_strings": list(s.stop), "tokenizer": tok} if s.stop else {}
        for done, batch in enumerate(batches):
            if deadline is not None and time.monotonic() > deadline:
                raise EvalTimeout(f"eval.timeout_s={s.timeout_s:g} passed after {done} of {len(batches)} batches "
                                  f"({sum(map(len, batches[:done]))} of {len(samples)} prompts)")
            if s.temperature > 0:
                torch.manual_seed(s.seed + done)
            ids = torch.tensor([prompts[i] for i in batch], device=self.device)
            out = self.chat.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_token_id,
                                           eos_token_id=self.chat.stop_ids, **sampling, **stops)
            for row, i in enumerate(batch):
                new = out[row, ids.shape[1]:].tolist()
                ends = [k for k, token in enumerate(new) if token in self.chat.stop_ids]
                new = new[: ends[0] + 1] if ends else new  # a finished row is padded after its stop token
                text = tok.decode(new, skip_special_tokens=True)
                answer = cut_at_stop(text, s.stop)  # cut by the limit: no stop token and no stop string before it
                answers[i] = Answer(answer, len(new), not ends and len(new) >= s.max_new_tokens
                                    and answer == text.strip())
        return answers


class VllmEngine:
    """vLLM through Ray Data's LLM processor: one vLLM engine of eval.num_gpus GPUs (its tensor-parallel size),
    fed the prompts in batches of eval.batch_size; vLLM and Ray Data place it on the cluster."""

    name = "vllm"

    def __init__(self, model_dir: Path, settings: GenEvalConfig):
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("eval.engine vllm: vLLM is not installed where the evaluation runs (pip install "
                               "vllm on the GPU nodes), or set eval.engine: hf")
        import ray
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig

        if not ray.is_initialized():  # `raysft eval` outside a run: Ray Data needs a Ray, a local one here
            ray.init(logging_level="ERROR", log_to_driver=False)
        self.settings = settings
        sampling = {"temperature": settings.temperature, "max_tokens": settings.max_new_tokens,
                    **({"stop": list(settings.stop)} if settings.stop else {}),
                    **({"seed": settings.seed} if settings.temperature > 0 else {})}
        config = vLLMEngineProcessorConfig(
            model_source=str(model_dir), batch_size=settings.batch_size, concurrency=1,
            engine_kwargs={"tensor_parallel_size": max(1, int(settings.num_gpus))})
        self.processor = build_processor(
            config,
            preprocess=lambda row: {"index": row["index"], "messages": row["messages"], "sampling_params": sampling},
            postprocess=lambda row: {"index": row["index"], "answer": row["generated_text"],
                                     "tokens": row["num_generated_tokens"]})

    def generate(self, samples: Sequence[EvalSample], deadline: float | None = None) -> list[Answer]:
        import ray

        rows = [{"index": i, "messages": sample.messages} for i, sample in enumerate(samples)]
        out = self.processor(ray.data.from_items(rows)).take_all()
        if deadline is not None and time.monotonic() > deadline:
            raise EvalTimeout(f"eval.timeout_s={self.settings.timeout_s:g} passed while vLLM generated")
        limit = self.settings.max_new_tokens
        answers = {row["index"]: Answer(cut_at_stop(row["answer"], self.settings.stop), row["tokens"],
                                        row["tokens"] >= limit) for row in out}
        return [answers[i] for i in range(len(samples))]
