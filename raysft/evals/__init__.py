"""Generation evaluation: what a model answers to an eval set, and how it scores (the `eval` section, `raysft eval`,
docs/EVAL.md).

Modules, by role (each imports only those above it in this list):
  scorers     exact_match, contains, regex, choice, number: plain functions of the generation and the expected answer
  evalset     the eval set: prompts in the conversation formats training reads, each with its expected answer,
              checked record by record (file and line)
  engines     what generates: batched Hugging Face generate (as `raysft chat` answers) or vLLM through ray.data.llm
  runner      one evaluation of a model or checkpoint: generate, score, write the record and per-sample table
  validation  the evaluation as Ray Train's validation task of each checkpoint, and in-process under torchrun

The record of a checkpoint's evaluation is raysft.checkpoint.gen_record (retention ranks by it); logging it into
metrics.jsonl and the trackers is raysft.training.gen_log.
"""

from raysft.evals.engines import EvalTimeout, resolve_engine
from raysft.evals.evalset import EvalSample, read_eval_set
from raysft.evals.runner import evaluate, evaluate_checkpoint, summary
from raysft.evals.scorers import SCORERS, score

__all__ = ["SCORERS", "EvalSample", "EvalTimeout", "evaluate", "evaluate_checkpoint", "read_eval_set",
           "resolve_engine", "score", "summary"]
