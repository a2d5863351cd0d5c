"""One generation evaluation: a model (an HF directory, an export, or any raysft checkpoint) answers the eval set,
each answer is scored, and the record and per-sample table are written.

A checkpoint is evaluated as it stands wherever the engine can read it: a full checkpoint is an HF directory; a
sharded one, a LoRA one (its adapters merged into the base: the model its checkpoint holds) or one on remote storage
is exported to a temporary directory first (raysft.products.export), so no user ever exports a checkpoint to
evaluate it.
`evaluate_checkpoint` keeps its record beside the checkpoint (raysft.checkpoint.gen_record) and does nothing when a
record of the same evaluation (its key: the eval set's content and every setting) is already there: a relaunch, or
Ray requeueing the validation of a checkpoint whose evaluation had finished, redoes nothing. A failure or a timeout
is recorded too (failed.json), then raised. A run's validation evaluates a checkpoint at most MAX_ATTEMPTS times
for one key, across its launches (Ray requeues a validation the run stopped in; a crash that repeats would otherwise
be met at every launch): the next request records that it gives up, once, and raises without generating.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path

from raysft.checkpoint import checkpoint_dirs, read_trainer_state
from raysft.checkpoint.discovery import step_of
from raysft.checkpoint.gen_record import (
    GEN_PREFIX,
    RECORD_FORMAT,
    RESULT_FILE,
    SAMPLES_FILE,
    count_attempt,
    eval_dir,
    read_failure,
    read_result,
    run_records,
    unrecorded_attempt,
    write_failure,
    write_result,
)
from raysft.config import GenEvalConfig
from raysft.errors import DataError
from raysft.evals.engines import EvalTimeout, open_engine, resolve_engine
from raysft.evals.evalset import EvalSample, eval_set_sha256, read_eval_set
from raysft.evals.scorers import score, standard_error
from raysft.products.directories import is_checkpoint
from raysft.products.export import export
from raysft.storage import Location, location

VLLM_EXPORT = "vllm_model"  # in a checkpoint's eval/: its export for vLLM while it is evaluated
MAX_ATTEMPTS = 3  # a run's validation of one checkpoint (one key), across launches: docs/EVAL.md


class EvaluationGaveUp(RuntimeError):
    """The checkpoint's evaluation was attempted max_attempts times already; `recorded`: the give-up is on record
    from an earlier request (no new record, no new event)."""

    def __init__(self, message: str, recorded: bool = False):
        super().__init__(message)
        self.recorded = recorded


def evaluation_key(settings: GenEvalConfig, system_prompt: str, engine: str) -> dict:
    """What the generations and scores depend on besides the weights: an evaluation recorded under the same key is
    not run again. Resources and the timeout change how it runs, not what it finds."""
    # eval.batch_size stays: a batch pads its prompts to its longest, and a batch's seeded sampling is its own
    generation = {k: v for k, v in asdict(settings).items() if k not in ("num_cpus", "num_gpus", "timeout_s",
                                                                        "at_start", "every_checkpoint", "engine")}
    return {**generation, "path": eval_set_sha256(settings.path), "system_prompt": system_prompt, "engine": engine}


@contextlib.contextmanager
def model_directory(model: str | Path | Location, engine: str) -> Iterator[Path | str]:
    """An HF model directory the engine reads: the model as it is, or an export of a checkpoint for as long as the
    evaluation runs. The hf engine loads checkpoints itself as `raysft chat` does (a local full one in place, a
    sharded or LoRA one through an export), so only a remote checkpoint is exported first for it, to this node.
    vLLM's engine runs where Ray Data places it, on any GPU node: its export goes beside the checkpoint, on the
    run's storage that every node reads (a URI on remote storage, which Ray's vLLM stage downloads on its node)."""
    where = location(model)
    lora = sharded = False
    if is_checkpoint(where):
        state = read_trainer_state(where)
        lora, sharded = bool(state.get("lora")), state["mode"] == "sharded"
    if where.local is not None and (engine == "hf" or not (lora or sharded)):
        yield where.local
        return
    with tempfile.TemporaryDirectory(prefix="raysft-eval-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP read in one process
        if engine == "hf":
            yield export(where, Path(tmp) / "model", merge=lora)  # fp32, as `raysft chat` loads it
            return
        shared = eval_dir(where) / VLLM_EXPORT  # vLLM serves bf16 whatever it reads: half the bytes
        try:
            if shared.local is not None:
                yield export(where, shared.local, overwrite=True, merge=lora, dtype="bf16")
            else:
                local = export(where, Path(tmp) / "model", merge=lora, dtype="bf16")
                for f in sorted(local.iterdir()):
                    (shared / f.name).upload(f)
                yield str(shared)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shared.fs.delete_dir(shared.path)


def evaluate(model: str | Path | Location, settings: GenEvalConfig, system_prompt: str = "",
             engine: str | None = None, deadline: float | None = None,
             samples: list[EvalSample] | None = None) -> tuple[dict, list[dict]]:
    """Generate and score: the record (metrics gen/<scorer>, the key, timings) and the per-sample table's rows.
    EvalTimeout once time.monotonic() passes `deadline`, checked between batches and once all are generated."""
    started, start = time.time(), time.monotonic()
    engine = engine or resolve_engine(settings)
    samples = samples if samples is not None else read_eval_set(settings.path, settings.scorers, system_prompt,
                                                                settings.max_samples)
    pattern = re.compile(settings.answer_pattern) if settings.answer_pattern else None
    with model_directory(model, engine) as model_dir:
        answers = open_engine(engine, model_dir, settings).generate(samples, deadline)
    rows, values = [], {name: [] for name in settings.scorers}
    for sample, answer in zip(samples, answers, strict=True):
        scores = score(answer.text, sample.expected, settings.scorers, pattern, sample.prompt)
        for name, value in scores.items():
            values[name].append(value)
        rows.append({"where": sample.where, **({"id": sample.id} if sample.id is not None else {}),
                     "prompt": sample.prompt, "generation": answer.text, "expected": sample.expected, "scores": scores,
                     "tokens": answer.tokens, "cut": answer.cut, "messages": sample.messages})
    if deadline is not None and time.monotonic() > deadline:
        raise EvalTimeout(f"eval.timeout_s={settings.timeout_s:g} passed after all {len(samples)} generations")
    return {"metrics": {f"{GEN_PREFIX}{name}": sum(v) / len(v) for name, v in values.items()},
            "stderr": {f"{GEN_PREFIX}{name}": standard_error(v) for name, v in values.items()},
            "cut": sum(row["cut"] for row in rows),
            "samples": len(samples), "table": SAMPLES_FILE, "engine": engine, "started": started,
            "finished": time.time(), "seconds": round(time.monotonic() - start, 3),
            "key": evaluation_key(settings, system_prompt, engine)}, rows


def write_table(out_dir: str | Path | Location, rows: list[dict]) -> Location:
    """The per-sample table, one JSON line per sample: prompt, generation, expected answer, scores, conversation."""
    table = location(out_dir) / SAMPLES_FILE
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return table


def evaluate_checkpoint(ckpt: str | Path | Location, settings: GenEvalConfig, system_prompt: str = "",
                        engine: str | None = None, timeout_s: float | None = None,
                        max_attempts: int | None = None) -> tuple[dict, bool]:
    """The checkpoint's evaluation record and whether it was made now (False: an equal one was recorded before).
    A failure or timeout is recorded in eval/failed.json, naming what happened, then raised. With `max_attempts`
    (a run's validation), EvaluationGaveUp instead of a further attempt once that many started."""
    engine = engine or resolve_engine(settings)
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else settings.timeout_s)
    try:  # reading the eval set (for its key) and the checkpoint's state fail as the evaluation does: recorded
        key = evaluation_key(settings, system_prompt, engine)
        recorded = read_result(ckpt)
        if recorded is not None and recorded["key"] == key:
            return recorded, False
        step = read_trainer_state(ckpt)["step"]
        if max_attempts is not None:
            check_attempts(ckpt, key, max_attempts)
        record, rows = evaluate(ckpt, settings, system_prompt, engine, deadline)
        if not is_checkpoint(ckpt):  # pruned meanwhile: no directory is made up for it
            raise FileNotFoundError(f"{ckpt}: the checkpoint went away while it was evaluated")
        write_table(eval_dir(ckpt), rows)
    except Exception as e:
        if not is_checkpoint(ckpt) or isinstance(e, EvaluationGaveUp) and e.recorded:
            raise
        kind = "timed_out" if isinstance(e, EvalTimeout) else "gave_up" if isinstance(e, EvaluationGaveUp) else "failed"
        record_failure(ckpt, settings, system_prompt, engine, f"{type(e).__name__}: {e}", kind)
        raise
    record = {**record, "step": step, "checkpoint": location(ckpt).name}
    write_result(ckpt, record)
    return record, True


def check_attempts(ckpt: str | Path | Location, key: dict, max_attempts: int) -> None:
    """Count this attempt at the checkpoint's evaluation of `key`; EvaluationGaveUp past `max_attempts`, naming the
    last failure on record (none: each attempt's process ended with its launch, or was killed)."""
    attempt = count_attempt(ckpt, key)
    if attempt <= max_attempts:
        return
    last = read_failure(ckpt)
    if last is not None and last["kind"] == "gave_up":
        raise EvaluationGaveUp(last["reason"], recorded=True)
    why = (f"the last: {last['reason']}" if last is not None else
           "none recorded a failure: each ended with its launch, or its process was killed")
    raise EvaluationGaveUp(f"not evaluated again: {max_attempts} attempts started across the run's launches "
                           f"(at most {max_attempts}); {why}")


def record_failure(ckpt: str | Path | Location, settings: GenEvalConfig, system_prompt: str, engine: str,
                   reason: str, kind: str = "failed") -> None:
    """Record that the checkpoint's evaluation failed (`kind` failed or timed_out) and why, in eval/failed.json and
    the run's copy: the trainer's GenEvalLog makes it one gen_eval_failed event. Also from outside the evaluation's
    process, when that process died (raysft.launch.ray_controller.validate_checkpoint). Its key is None where the
    eval set could not be read."""
    try:
        key = evaluation_key(settings, system_prompt, engine)
    except (OSError, DataError):
        key = None
    write_failure(ckpt, {"step": step_of(location(ckpt)), "checkpoint": location(ckpt).name, "kind": kind,
                         "key": key, "reason": reason, "finished": time.time()})


def record_unrecorded_attempts(run_dir: str | Path | Location, why: str) -> list[str]:
    """Record as interrupted (one gen_eval_failed event each, outcome interrupted) every checkpoint of the run whose
    last evaluation attempt (eval/attempts.json) ended without a record: Ray cancels a validation without one when
    its run aborts, and force-cancels it at its own timeout. The driver looks before a launch and once a run's
    validations have all ended; `why` says what is known then. The checkpoints' names."""
    found = []
    for ckpt in checkpoint_dirs(run_dir):
        noted = unrecorded_attempt(ckpt)
        if noted is None:
            continue
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(noted.get("started", 0)))
        write_failure(ckpt, {"step": step_of(location(ckpt)), "checkpoint": location(ckpt).name,
                             "kind": "interrupted", "key": noted.get("key"), "finished": time.time(),
                             "reason": f"attempt {noted['attempts']} of its evaluation, started {started}, ended "
                                       f"without a record: {why}"})
        found.append(location(ckpt).name)
    return found


def evaluate_model(model: str | Path | Location, settings: GenEvalConfig, system_prompt: str = "",
                   out: str | Path | None = None) -> tuple[dict, Location, str | None]:
    """`raysft eval`: (the record, its table, a note for the user). A checkpoint's evaluation goes beside it, as a
    run's does, unless `out` is given or the checkpoint holds a record of another evaluation (another eval set or
    settings: the run's record stays as it is); anything else, and those, into `out` (default
    ./eval-<model directory's name>), with result.json beside the table."""
    engine = resolve_engine(settings)
    recorded = read_result(model) if is_checkpoint(model) else None
    key = evaluation_key(settings, system_prompt, engine)
    note = None
    if is_checkpoint(model) and out is None and (recorded is None or recorded["key"] == key):
        record, made = evaluate_checkpoint(model, settings, system_prompt, engine)
        if not made:
            note = (f"{model} was evaluated so before (same eval set and settings), at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record['finished']))}")
        return record, eval_dir(model) / record["table"], note
    where = location(out or Path.cwd() / f"eval-{location(model).name}")
    if recorded is not None and out is None:
        note = f"{model} holds the record of another evaluation (eval set or settings): this one goes to {where}"
    record, rows = evaluate(model, settings, system_prompt, engine)
    table = write_table(where, rows)
    (where / RESULT_FILE).write_text(json.dumps({"format": RECORD_FORMAT, "model": str(model), **record}, indent=1))
    return record, table, note


def run_settings(model: str | Path | Location, eval_set: str) -> list[str] | None:
    """The settings a run evaluated `eval_set` with, as config overrides (eval.*, data.system_prompt), read from the
    newest record of the run that `model` (a run directory or one of its checkpoints) belongs to whose eval set had
    the same content; None where there is none. `raysft eval` on a run's checkpoint then evaluates it as the run
    did, and finds the run's own record, without the run's config."""
    where = location(model)
    run_dir = where.parent if is_checkpoint(where) else where
    try:
        content = eval_set_sha256(eval_set)
    except (OSError, DataError):
        return None
    keys = [record["key"] for _, kind, record in run_records(run_dir) if kind == "result"
            and isinstance(record["key"], dict) and record["key"].get("path") == content]
    if not keys:
        return None
    settings = {f.name for f in fields(GenEvalConfig)} - {"path"}
    key = keys[-1]
    return [*(f"eval.{k}={json.dumps(v)}" for k, v in key.items() if k in settings),
            f"data.system_prompt={json.dumps(key.get('system_prompt', ''))}"]


def summary(record: dict) -> str:
    """One line: each score with its standard error, the samples (and how many max_new_tokens cut), the time."""
    stderr = record.get("stderr", {})  # a record written before scores carried it
    scores = ", ".join(f"{k} {v:.3f}" + (f" ± {stderr[k]:.3f}" if k in stderr else "")
                       for k, v in record["metrics"].items())
    cut = f", {record['cut']} cut at eval.max_new_tokens" if record.get("cut") else ""
    return f"{scores} ({record['samples']} samples{cut}, {record['engine']}, {record['seconds']:.1f} s)"
