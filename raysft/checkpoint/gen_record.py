"""A checkpoint's generation-evaluation record: what the model said and how it scored, kept beside its weights.

`<checkpoint>/eval/` holds, once an evaluation of the checkpoint ended (raysft.evals: a Ray validation task, the
torchrun launch in-process, or `raysft eval`):
  result.json    the scores (`metrics`: gen/<scorer> -> mean over the samples), the step, the evaluation's key
                 (the eval set's sha256 and every setting that changes what is generated or scored), the engine,
                 when it started and finished, and the per-sample table's file name
  samples.jsonl  one line per sample: its prompt, the generation, the expected answer and each scorer's score
  failed.json    instead of result.json, when the evaluation failed or ran out of time: why, and when
  attempts.json  how many times a run's validation started the evaluation of this key (bounded across launches),
                 and when the last one started; each record names how many had started when it was written,
                 so an attempt that ended without one (Ray cancelled it, its launch ended) is found later

The directory is not part of the checkpoint's manifest (the manifest lists what the save wrote), so adding it never
makes a checkpoint incomplete, and a checkpoint that is pruned takes its table with it. A copy of the record (the
result or the failure, without the table) goes to `<run>/gen_evals/<checkpoint>.json`, which retention never
deletes: the run's log (raysft.training.gen_log) reads the records there, so a checkpoint pruned right after its
evaluation still has its scores logged. Every file is written whole (renamed into place, or one object on remote
storage), so a reader sees a record or none. The record is read here, below the evaluation itself, because retention
(`checkpoint.best_metric`) and `raysft export --checkpoint best` rank checkpoints by it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from raysft.checkpoint.discovery import RUN_FILE
from raysft.checkpoint.state import STATE_FILE
from raysft.storage import Location, location

EVAL_DIR = "eval"
RESULT_FILE = "result.json"
FAILED_FILE = "failed.json"
SAMPLES_FILE = "samples.jsonl"
RUN_RECORDS = "gen_evals"  # <run>/gen_evals/<checkpoint>.json: the run's records, kept when checkpoints are pruned
ATTEMPTS_FILE = "attempts.json"
RECORD_FORMAT = 1
GEN_PREFIX = "gen/"  # the metrics of a generation evaluation: gen/<scorer>


def eval_dir(ckpt: str | Path | Location) -> Location:
    return location(ckpt) / EVAL_DIR


def read_result(ckpt: str | Path | Location) -> dict | None:
    """The checkpoint's finished evaluation record, or None (none yet, a failure, or a file that is not one)."""
    return _read(eval_dir(ckpt) / RESULT_FILE, RESULT_KEYS)


def read_failure(ckpt: str | Path | Location) -> dict | None:
    """The record of an evaluation of the checkpoint that failed or timed out, or None."""
    return _read(eval_dir(ckpt) / FAILED_FILE, FAILURE_KEYS)


RESULT_KEYS, FAILURE_KEYS = ("metrics", "key", "step", "finished"), ("reason", "kind", "key", "finished")


def _read(path: Location, keys: tuple[str, ...]) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or any(k not in record for k in keys):
        return None
    return record


def write_result(ckpt: str | Path | Location, record: dict) -> None:
    """Write the result (whole), replacing a failure recorded before, and its copy in the run's records."""
    where, text = eval_dir(ckpt), _record_text(ckpt, record)
    (where / RESULT_FILE).write_text(text)
    (where / FAILED_FILE).delete()
    _run_copy(ckpt, text)


def write_failure(ckpt: str | Path | Location, record: dict) -> None:
    text = _record_text(ckpt, record)
    (eval_dir(ckpt) / FAILED_FILE).write_text(text)
    _run_copy(ckpt, text)


def _record_text(ckpt: str | Path | Location, record: dict) -> str:
    """The record as written, with the attempts started when it was (`unrecorded_attempt` compares them)."""
    noted = read_attempts(ckpt)
    return json.dumps({"format": RECORD_FORMAT, **record, "attempts": noted["attempts"] if noted else 0}, indent=1)


def read_attempts(ckpt: str | Path | Location) -> dict | None:
    """The checkpoint's attempts.json ({key, attempts, started}), or None."""
    try:
        noted = json.loads((eval_dir(ckpt) / ATTEMPTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return noted if isinstance(noted, dict) and isinstance(noted.get("attempts"), int) else None


def count_attempt(ckpt: str | Path | Location, key: dict) -> int:
    """Note one more attempt at the checkpoint's evaluation of `key`, before it runs (so that an attempt whose
    process died with it, unrecorded, counts too): this attempt's number, from 1; another key counts from 1."""
    noted = read_attempts(ckpt)
    attempt = noted["attempts"] + 1 if noted is not None and noted.get("key") == key else 1
    (eval_dir(ckpt) / ATTEMPTS_FILE).write_text(json.dumps({"format": RECORD_FORMAT, "key": key,
                                                            "attempts": attempt, "started": time.time()}))
    return attempt


def unrecorded_attempt(ckpt: str | Path | Location) -> dict | None:
    """The checkpoint's attempts.json when its last attempt left no record (Ray cancelled it when its run aborted,
    or at Ray's own timeout; its process died with its launch); None when a record followed it or the run gave up on
    it (later requests leave no record on purpose)."""
    noted = read_attempts(ckpt)
    if noted is None:
        return None
    records = [r for r in (read_result(ckpt), read_failure(ckpt)) if r is not None]
    latest = max(records, key=lambda r: r["finished"], default=None)
    if latest is not None and (latest.get("kind") == "gave_up" or latest.get("attempts") == noted["attempts"]):
        return None
    return noted


def _run_copy(ckpt: str | Path | Location, text: str) -> None:
    """The record's copy in `<run>/gen_evals/`, where the checkpoint is one of a run's (not a copy elsewhere)."""
    ckpt = location(ckpt)
    if (ckpt.parent / RUN_FILE).is_file():
        (ckpt.parent / RUN_RECORDS / f"{ckpt.name}.json").write_text(text)


def run_records(run_dir: str | Path | Location, skip: set[str] = frozenset()) -> list[tuple[str, str, dict]]:
    """(checkpoint name, "result" or "failure", record) of every record in the run's gen_evals/ but those of the
    checkpoints in `skip`, by name (the checkpoints' order)."""
    found = []
    for path in (location(run_dir) / RUN_RECORDS).children():  # sorted by name
        name = path.name.removesuffix(".json")
        if not path.name.endswith(".json") or name in skip:
            continue
        record = _read(path, RESULT_KEYS)
        if record is not None:
            found.append((name, "result", record))
        elif (record := _read(path, FAILURE_KEYS)) is not None:
            found.append((name, "failure", record))
    return found


def recorded_metric(ckpt: str | Path | Location, metric: str) -> float | None:
    """The value of `metric` recorded with a checkpoint, None where it has none: a gen/ metric from its evaluation
    record; eval_loss and the other validation metrics (eval/rewards/accuracies, ...) from its trainer_state.json,
    which the save wrote (`eval_loss`, and `eval_metrics` for the rest)."""
    if metric.startswith(GEN_PREFIX):
        record = read_result(ckpt)
        value = record["metrics"].get(metric) if record and isinstance(record["metrics"], dict) else None
    else:
        try:
            state = json.loads((location(ckpt) / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict):
            return None
        extra = state.get("eval_metrics")
        value = state.get(metric) if metric == "eval_loss" else extra.get(metric) if isinstance(extra, dict) else None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None
