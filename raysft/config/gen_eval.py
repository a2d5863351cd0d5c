"""The `eval` section: generation evaluation of checkpoints (raysft.evals, docs/EVAL.md).

A section of its own module, composed into TrainConfig by raysft.config.sections like the others; its docstrings
are part of the configuration reference (sections.reference_markdown reads them here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SCORERS = ("exact_match", "contains", "regex", "choice", "number")  # raysft.evals.scorers


@dataclass
class GenEvalConfig:
    path: str = ""
    """Generation evaluation (docs/EVAL.md): a JSONL eval set of prompts with their expected answers, in the
    conversation formats of data.paths ("builtin:demo-eval": the demo's). Every checkpoint is evaluated with the
    model's chat template: under Ray by a validation task on resources of its own (eval.num_cpus, eval.num_gpus),
    never on the training workers' step path; under torchrun in-process after the save, blocking training.
    Scores go to metrics.jsonl and the trackers as gen/<scorer>, and beside the checkpoint (eval/result.json, the
    per-sample table eval/samples.jsonl); checkpoint.best_metric may rank by them. Empty: off."""
    scorers: list[str] = field(default_factory=lambda: ["exact_match"])
    """Any of SCORERS: exact_match (SQuAD-normalized), contains (the expected answer's words in the generation),
    regex (answer_pattern's match equals the expected answer), choice (the multiple-choice letter), number (the
    final number, GSM8K-style). Each is a plain function of the texts: nothing from the data or config is run."""
    answer_pattern: str = ""
    """The regex scorer's regular expression: its first match in the generation (its first group, if it has one)
    is compared, normalized, with the expected answer."""
    max_new_tokens: int = 128
    """The longest generation, in tokens."""
    temperature: float = 0.0
    """0: greedy, the answers `raysft chat` gives; above 0: sampled at this temperature, seeded by eval.seed."""
    seed: int = 0
    """The sampling seed (temperature > 0)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a generation ends at the first one, which is cut off (the chat template's end-of-turn token
    ends it anyway)."""
    max_samples: int = 0
    """Evaluate the first N records of the eval set; 0: all."""
    batch_size: int = 16
    """Prompts generated together (the Hugging Face engine batches prompts of neighbouring lengths, padded on the
    left)."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """"hf": batched Hugging Face generate; "vllm": vLLM through ray.data.llm (installed where the evaluation
    runs; eval.num_gpus GPUs as its tensor-parallel size); "auto": vllm when the driver can import it and
    eval.num_gpus > 0, else hf."""
    num_cpus: float = 1.0
    """CPUs of the Ray validation task (Ray schedules it beside the training workers)."""
    num_gpus: float = 0.0
    """GPUs of the Ray validation task (the hf engine), or of vLLM's engine (the vllm engine)."""
    timeout_s: float = 1800.0
    """An evaluation that runs longer is stopped and recorded as timed out (one event; the checkpoint stays
    unranked); training goes on."""
    every_checkpoint: bool = False
    """Under Ray, evaluations run one at a time beside training, and a checkpoint waiting for its evaluation is
    never pruned. false: a checkpoint saved while an earlier one's evaluation is still running is not evaluated
    (a gen_eval_skipped event says so), but the base (eval.at_start) and the run's last checkpoint always are, so
    that evaluations slower than the checkpoint cadence keep at most two checkpoints waiting; true: every one is
    evaluated, in order, and those waiting stay on disk until theirs has run."""
    at_start: bool = False
    """With eval.path: also evaluate the starting model; a fresh run saves a checkpoint of step 0 (the base) and
    evaluates it as every other."""
