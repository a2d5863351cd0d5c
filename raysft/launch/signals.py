"""How a launch ends on a signal.

SIGTERM is how a job scheduler, Kubernetes or `ray job stop` ends a run: the workers checkpoint the step they are at
(the training loop's stop request, taken like a preemption notice), and the process exits with EXIT_SIGTERM within
run.stop_grace_s, saying how to resume. Ctrl-C (SIGINT) is a person who wants the terminal back: the launch stops
within seconds without a new checkpoint, and a second Ctrl-C ends the process at once. Neither prints a traceback.

Under Ray the driver gets the signal and the workers do not: the driver raises a flag in a small actor that rank 0
asks at the loop's notice checks. Under torchrun every rank gets SIGTERM from torchrun's agent, and the ranks agree
on the step to stop at in the same check.

A signal to the whole job (Slurm's scancel, a container runtime signalling the process group) also reaches the
local Ray the driver started, and its workers: they end at once, and no checkpoint can be taken. The driver then
does not wait out Ray's client (which ends the process with an error a minute later): the stop request fails or
times out, or Ray Train's `fit` fails on its gone actors, whichever comes first, and the driver exits 143 saying
that no checkpoint was taken and why; the run resumes from its last one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

EXIT_SIGTERM = 143  # 128 + SIGTERM, what a shell reports for a process that SIGTERM ended
EXIT_SIGINT = 130  # 128 + SIGINT
T = TypeVar("T")


class Stopped(Exception):
    """The launch was stopped by a signal. `checkpointed`: the workers saved the step they were at; `result`: what
    the stopped call returned, if it did."""

    def __init__(self, signum: int, checkpointed: bool, detail: str = "", result: object = None):
        self.signum, self.checkpointed, self.result = signum, checkpointed, result
        self.exit_code = EXIT_SIGTERM if signum == signal.SIGTERM else EXIT_SIGINT
        super().__init__(detail)


def stop_message(signum: int, run_dir: object, checkpoint: object | None, detail: str = "") -> str:
    """The lines a stopped launch ends with: what stopped it, what is saved, and how to go on."""
    name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    saved = f"checkpoint saved: {checkpoint}" if checkpoint else "no checkpoint was taken at the stop"
    return (f"raysft: stopped by {name}{f' ({detail})' if detail else ''}; {saved}\n"
            f"raysft: to resume, run the same command again (run directory {run_dir})")


def exit_process(code: int) -> None:
    """End the process without Python's interpreter finalization, after flushing the standard streams and logs.

    Two kinds of process need it. A torchrun worker: on torch 2.11-2.13 a gloo process group outlives
    `destroy_process_group` once a model was `fully_shard`-ed (its `pt_gloo_runloop` threads are still there after a
    `gc.collect()`); if one of them drops the last reference to a finished collective's tensor while the interpreter
    finalizes, the process aborts with "terminate called without an active exception" (pytorch#179291). A driver
    that a signal stopped: the thread waiting in Ray's `fit` is still inside Ray's client, which aborts in the same
    way when the interpreter tears it down. Everything raysft writes is closed by the time either calls this."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class DriverSignals:
    """The driver's SIGTERM and Ctrl-C handling around a blocking call (Ray Train's `fit`).

    `run(fn)` runs fn in a thread and waits for it in the main thread, where the handlers run (Ray Train would
    otherwise take SIGINT for itself, and Ray's SIGTERM handler exits the driver mid-call). On SIGTERM, `on_term()`
    asks the workers to checkpoint and stop, in a thread of its own so the grace counts even if it hangs; fn's
    return is then raised as Stopped(checkpointed=True), or, if fn has not returned within `grace_s`, if on_term
    raised, or if fn raised after the signal, Stopped(checkpointed=False). On a first Ctrl-C, Stopped at once; on a
    second one the process ends where it is."""

    def __init__(self, grace_s: float, on_term: Callable[[], None]):
        self.grace_s, self.on_term = grace_s, on_term
        self.term_at: float | None = None
        self.interrupts = 0
        self._previous: dict[int, object] = {}
        self._asked: dict = {}  # "asked": on_term returned; "failed": what it raised

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM:
            self.term_at = self.term_at or time.monotonic()
            return
        self.interrupts += 1
        if self.interrupts > 1:
            exit_process(EXIT_SIGINT)

    def run(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is not threading.main_thread():
            return fn()  # only the main thread gets signals (a driver run from a thread leaves them to its caller)
        box: dict = {}
        thread = threading.Thread(target=_into(box, "value", "error", fn), name="raysft-fit", daemon=True)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        try:
            thread.start()
            self._wait(thread)
        finally:
            if self.term_at is None and not self.interrupts:  # else a second Ctrl-C during the shutdown still counts
                for signum, previous in self._previous.items():
                    signal.signal(signum, previous)
        if "error" in box:
            if self.term_at is not None:  # failed after the signal: Ray's own processes may have had it too
                raise Stopped(signal.SIGTERM, checkpointed=False,
                              detail=f"the run failed after the signal: {_first_line(box['error'])}") from box["error"]
            raise box["error"]
        if self.term_at is not None:
            raise Stopped(signal.SIGTERM, checkpointed=True, result=box["value"])
        return box["value"]

    def _wait(self, thread: threading.Thread) -> None:
        """Wait for `thread` in the main thread; on SIGTERM, ask for the stop in another thread (Ray may be gone:
        a signal to the whole job reaches its processes too), so the grace still counts."""
        asking = None
        while thread.is_alive():
            thread.join(0.2)
            if self.interrupts:
                raise Stopped(signal.SIGINT, checkpointed=False)
            if self.term_at is not None and asking is None:
                asking = threading.Thread(target=_into(self._asked, "asked", "failed", self.on_term),
                                          name="raysft-stop-request", daemon=True)
                asking.start()
            if "failed" in self._asked:
                raise Stopped(signal.SIGTERM, checkpointed=False,
                              detail=f"the workers could not be asked to checkpoint: {self._asked['failed']}")
            if self.term_at is not None and time.monotonic() - self.term_at > self.grace_s:
                raise Stopped(signal.SIGTERM, checkpointed=False,
                              detail=f"the workers did not checkpoint within run.stop_grace_s={self.grace_s:g}")


def _into(box: dict, value_key: str, error_key: str, fn: Callable[[], T]) -> Callable[[], None]:
    """fn, as a thread's target: its return value or its exception into `box`."""
    def target() -> None:
        try:
            box[value_key] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the main thread
            box[error_key] = e

    return target


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


class WorkerSignals:
    """A torchrun worker's SIGTERM and Ctrl-C: SIGTERM raises `requested` for the training loop's next notice check
    and ends the process with EXIT_SIGTERM if it has not ended `grace_s` later; Ctrl-C raises KeyboardInterrupt, and a
    second one ends the process at once."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.interrupts = 0
        signal.signal(signal.SIGTERM, self._term)
        signal.signal(signal.SIGINT, self._interrupt)

    def _term(self, signum: int, frame) -> None:
        if not self.requested.is_set():
            self.requested.set()
            watchdog = threading.Timer(self.grace_s, exit_process, args=(EXIT_SIGTERM,))
            watchdog.daemon = True
            watchdog.start()

    def _interrupt(self, signum: int, frame) -> None:
        self.interrupts += 1
        if self.interrupts > 1:
            exit_process(EXIT_SIGINT)
        raise KeyboardInterrupt
