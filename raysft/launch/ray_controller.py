"""What Ray's processes other than the training workers run of raysft, kept light on purpose. Ray Train's controller
unpickles the run's callback and validation function, and so imports their module, before it starts any worker; the
driver's StopFlag is an actor of its own, whose process imports its class's module. From raysft.launch.ray_driver
that meant torch, transformers and the rest of raysft in each of those processes, on every launch's path to its
first step (some 5 s of CPU each on 2 cores); from here it is the standard library, pyarrow and raysft's errors and
storage.

A run-ending error (raysft.errors.ends_the_run) met on a worker is written down in the run directory before it is
raised (`record_run_ending`); the controller's callback (`EndRunOnRecordedError`) reads the record after the poll
that found the error and ends the run instead of letting Ray restart the workers into it; the driver raises the
recorded error as its own class (`recorded_run_ending`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import ray

from raysft.errors import run_ending_type
from raysft.launch.ray_train import ControllerError, UserCallback
from raysft.storage import Location, location

# Ray cancels a validation task this long after eval.timeout_s (counted from the task's submission); the task gives
# up on its evaluation, and records why, half of it earlier
RAY_GRACE_S = 60.0
EVAL_REQUEST_FILE = "gen_eval_requested.json"  # <run dir>/: the checkpoint whose evaluation was asked for last
RUN_ENDING_PREFIX = "raysft_error."  # <run dir>/raysft_error.<rank>.json: the error a rank met that ends the run
RECORDED = threading.Event()  # this process recorded a run-ending error: its one line reaches the user from the driver


class RunEnded(Exception):
    """A worker met an error that no restart changes (raysft.errors.ends_the_run) and recorded it."""


class EndRunOnRecordedError(UserCallback):
    """On Ray Train's controller, after a poll that found a worker's error: when a worker recorded a run-ending
    error, end the run now instead of letting Ray restart the workers into it. An error raised from this hook is the
    controller's (ControllerError), which Ray's failure policy never retries; Ray then ends every worker, so a worker
    waiting in a collective for the one that raised is not left hanging. Without a record the error is Ray's to retry
    (scaling.max_failures)."""

    def __init__(self, run_dir: Path | Location):
        self.run_dir = run_dir

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        if recorded_run_ending(self.run_dir) is not None:
            raise ControllerError(RunEnded(f"ranks {sorted(worker_exceptions)} raised; one recorded a run-ending "
                                           f"error in {self.run_dir}"))


@ray.remote(num_cpus=0)
class StopFlag:
    """The driver's stop request (it got SIGTERM), which rank 0 asks at each of the training loop's notice checks:
    under Ray the signal reaches the driver, not the workers."""

    def __init__(self):
        self.requested = False

    def request(self) -> None:
        self.requested = True

    def get(self) -> bool:
        return self.requested


class EvaluationLost(RuntimeError):
    """The evaluation's process died (the OOM killer, a CUDA abort, its node lost): an ordinary error of the
    validation task, so that Ray marks the checkpoint's validation failed and training goes on."""


def validate_checkpoint(checkpoint, settings: dict, system_prompt: str = "", engine: str = "hf",
                        resources: dict | None = None) -> dict:
    """Ray Train's ValidationFn. Ray's validation task holds no resources and runs this, light: the evaluation
    (raysft.evals.validation.validate_checkpoint) is a task of its own on `resources` (eval.num_cpus, num_gpus).
    Ray 2.60's validation manager takes a task's ordinary error as a failed validation, but a system error (the
    process killed, out of memory, its node lost) ends the whole run as the controller's; from the inner task
    such a death is an error here, recorded as the evaluation's failure (a gen_eval_failed event naming it) and
    raised as EvaluationLost. An evaluation with no result eval.timeout_s + RAY_GRACE_S / 2 after it was asked for
    (waiting for its resources, or a batch that hangs past its own deadline) is cancelled and recorded as timed out,
    before Ray's own timeout would cancel this task without a record. Ray's cancel of this task (the run's abort)
    cancels the inner one."""
    where = Location(checkpoint.filesystem, checkpoint.path)
    evaluate = ray.remote(_evaluate).options(name=f"raysft gen_eval {where.name}", **(resources or {}))
    ref = evaluate.remote(checkpoint, settings, system_prompt, engine)
    wait_s = settings["timeout_s"] + RAY_GRACE_S / 2
    try:
        return ray.get(ref, timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        reason = (f"no result {wait_s:g} s after it was asked for (eval.timeout_s={settings['timeout_s']:g}): it "
                  "waited that long for its resources (eval.num_cpus, eval.num_gpus), or a batch hung")
        _record_lost(checkpoint, settings, system_prompt, engine, reason, "timed_out")
        raise EvaluationLost(reason) from None
    except (ray.exceptions.RayTaskError, ray.exceptions.TaskCancelledError):
        raise  # the evaluation raised, and recorded why (raysft.evals.runner.evaluate_checkpoint); or Ray cancelled
    except ray.exceptions.RayError as e:
        reason = f"the evaluation's process was lost ({type(e).__name__}): {str(e).splitlines()[0]}"
        _record_lost(checkpoint, settings, system_prompt, engine, reason)
        raise EvaluationLost(reason) from None
    finally:
        evaluation_ended(where.parent, where.name)


def request_evaluation(run_dir: Path | Location, name: str, always: bool, expires_s: float) -> str | None:
    """Rank 0, as it registers checkpoint `name`: None when its evaluation is to be asked for (and noted as the
    one asked for last, for `expires_s`), or, when the evaluation asked for before it is still running or waiting
    and this one is not `always` evaluated, why it is not (eval.every_checkpoint false)."""
    marker = location(run_dir) / EVAL_REQUEST_FILE
    try:
        earlier = json.loads(marker.read_text())
    except (OSError, ValueError):
        earlier = None
    if not always and earlier is not None and earlier["expires"] > time.time():
        return (f"the evaluation of {earlier['checkpoint']} had not ended when it was saved: the next checkpoint "
                "saved after that one's evaluation is evaluated (eval.every_checkpoint: false)")
    marker.write_text(json.dumps({"checkpoint": name, "expires": time.time() + expires_s}))
    return None


def forget_evaluation_request(run_dir: Path | Location) -> None:
    """Before a launch: the evaluation an earlier launch asked for last is no evaluation of this one's."""
    (location(run_dir) / EVAL_REQUEST_FILE).delete()


def evaluation_ended(run_dir: Path | Location, name: str) -> None:
    """The evaluation of checkpoint `name` ended, however: the next checkpoint's may be asked for, unless one
    asked for since (the run's last) is still to run."""
    marker = location(run_dir) / EVAL_REQUEST_FILE
    try:
        if json.loads(marker.read_text())["checkpoint"] == name:
            marker.delete()
    except (OSError, ValueError, KeyError):
        return


def _evaluate(checkpoint, settings: dict, system_prompt: str, engine: str) -> dict:
    from raysft.evals.validation import validate_checkpoint as validate

    return validate(checkpoint, settings, system_prompt, engine)


def _record_lost(checkpoint, settings: dict, system_prompt: str, engine: str, reason: str,
                 kind: str = "failed") -> None:
    """The failure record the dead process could not write (imports torch: on this path only)."""
    from raysft.config import GenEvalConfig
    from raysft.evals.runner import record_failure
    from raysft.storage import native

    ckpt = native(Location(checkpoint.filesystem, checkpoint.path))
    record_failure(ckpt, GenEvalConfig(**settings), system_prompt, engine, reason, kind)


def record_run_ending(run_dir: Path | Location, rank: int, error: Exception) -> None:
    """Write down the run-ending error this rank met, before it is raised (whatever the other ranks do). Where the
    run directory cannot take it, the error is raised unrecorded: Ray then retries, as for any other error."""
    try:
        (location(run_dir) / f"{RUN_ENDING_PREFIX}{rank}.json").write_text(
            json.dumps({"rank": rank, "type": type(error).__name__, "message": str(error)}))
    except OSError:
        return
    RECORDED.set()


def recorded_run_ending(run_dir: Path | Location) -> Exception | None:
    """The run-ending error of the lowest rank that recorded one, as its own class; None if none did."""
    records = [json.loads(f.read_text()) for f in _records(run_dir)]
    if not records:
        return None
    first = min(records, key=lambda r: r["rank"])
    return run_ending_type(first["type"])(first["message"])


def clear_run_ending_records(run_dir: Path | Location) -> None:
    """Before a launch: an earlier launch's record is no error of this one."""
    for f in _records(run_dir):
        f.delete()


def _records(run_dir: Path | Location) -> list[Location]:
    run = location(run_dir)
    if not run.is_dir():
        return []
    return [f for f in run.children() if f.name.startswith(RUN_ENDING_PREFIX) and f.name.endswith(".json")]
