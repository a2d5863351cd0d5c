"""The generation evaluations of a run's checkpoints, into metrics.jsonl and the trackers, each once.

An evaluation ends outside the training loop (a Ray validation task, or rank 0 in-process after a save under
torchrun) and leaves its record beside the checkpoint, and a copy in `<run>/gen_evals/` that outlives the checkpoint
(raysft.checkpoint.gen_record). Rank 0 of the trainer looks for new records there every POLL_S seconds (no
collective: the other ranks never wait for it) and at the end of the launch, and logs each as one event at the
checkpoint's step: `gen_eval` with gen/<scorer> and where its per-sample table is, `gen_eval_failed` with why, or
`gen_eval_skipped` (a checkpoint saved while an earlier one's evaluation ran: eval.every_checkpoint) with why.
Under Ray the evaluation of the last checkpoints ends after the workers have: the driver logs those
(`log_remaining`) once Ray Train's fit has returned, which it does after every evaluation ended. A record already in
metrics.jsonl (by checkpoint and finish time) is never logged again, so a relaunch logs only what is new.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from raysft.checkpoint.gen_record import eval_dir, run_records
from raysft.config import TrainConfig
from raysft.storage import Location, location
from raysft.training.metrics import METRICS_FILE, MetricsLogger, read_metrics
from raysft.training.trackers import Trackers

POLL_S = 5.0  # how often rank 0 looks for new records (a directory listing and a small read per record)
EVENTS = ("gen_eval", "gen_eval_failed", "gen_eval_skipped")
TABLE_ROWS = 100  # rows of the per-sample table a tracker shows (the whole table stays beside the checkpoint)


class GenEvalLog:
    """Rank 0's view of the run's evaluation records (<run>/gen_evals/): `poll` logs the ones not logged yet."""

    def __init__(self, run_dir: Path | Location, log: MetricsLogger):
        self.run_dir, self.log = run_dir, log
        self.logged = logged_records(log.path) if log.path else set()
        self.scored = {name for event, name, _ in self.logged if event == "gen_eval"}  # whose record is not read again
        self.next_poll = 0.0

    def pending(self) -> list[tuple[str, str, dict]]:
        """(checkpoint name, event, record) of every record not logged yet, in the checkpoints' order."""
        return [(name, event_of(kind, record), record)
                for name, kind, record in run_records(self.run_dir, skip=self.scored)
                if (event_of(kind, record), name, record["finished"]) not in self.logged]

    def poll(self, now: bool = False) -> int:
        """Log the new records (at most every POLL_S seconds unless `now`); how many."""
        if not now and time.monotonic() < self.next_poll:
            return 0
        self.next_poll = time.monotonic() + POLL_S
        found = self.pending()
        for name, event, record in found:
            self._log(name, event, record)
        return len(found)

    def _log(self, name: str, event: str, record: dict) -> None:
        self.logged.add((event, name, record["finished"]))
        if event == "gen_eval":
            self.scored.add(name)
        common = {"step": record["step"], "checkpoint": name, "finished": record["finished"]}
        if event == "gen_eval_skipped":
            self.log.event(event, f"step {record['step']}: not evaluated: {record['reason']}", **common,
                           reason=record["reason"])
            return
        if event == "gen_eval_failed":
            self.log.event(event, f"step {record['step']}: {record['kind'].replace('_', ' ')}: {record['reason']}",
                           **common, outcome=record["kind"], reason=record["reason"])
            return
        table = eval_dir(location(self.run_dir) / name) / record["table"]
        self.log.event(event, f"step {record['step']}: {scores_text(record['metrics'], record.get('stderr', {}))} "
                              f"({record['samples']} samples, {record['seconds']:.1f} s)",
                       **common, **record["metrics"], samples=record["samples"], engine=record["engine"],
                       started=record["started"], seconds=record["seconds"], table=str(table),
                       **({"stderr": record["stderr"], "cut": record["cut"]} if "stderr" in record else {}))
        if self.log.trackers is None:
            return
        if not table.is_file():  # its checkpoint pruned meanwhile: the scores alone
            self.log.trackers.log(record["step"], record["metrics"])
            return
        with _local_copy(table) as path:
            rows = [json.loads(line) for line in path.read_text().splitlines()[:TABLE_ROWS] if line.strip()]
            self.log.trackers.log_eval(record["step"], record["metrics"], rows, path, name)


@contextlib.contextmanager
def _local_copy(where: Location) -> Iterator[Path]:
    """A file as a local path (downloaded to a temporary file from remote storage), for a tracker's upload."""
    if where.local is not None:
        yield where.local
        return
    with tempfile.TemporaryDirectory(prefix="raysft-table-") as tmp:
        where.download(Path(tmp) / where.name)
        yield Path(tmp) / where.name


def event_of(kind: str, record: dict) -> str:
    """The event of a record of kind "result" or "failure" (failed, timed out, or skipped)."""
    if kind == "result":
        return "gen_eval"
    return "gen_eval_skipped" if record.get("kind") == "skipped" else "gen_eval_failed"


def logged_records(metrics_path: Path) -> set[tuple[str, str, float]]:
    """(event, checkpoint name, finish time) of every evaluation event in a metrics.jsonl."""
    if not metrics_path.is_file():
        return set()
    found = set()
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line a killed process cut short
        if isinstance(row, dict) and row.get("event") in EVENTS:
            found.add((row.get("event"), row.get("checkpoint"), row.get("finished")))
    return found


def log_remaining(cfg: TrainConfig) -> int:
    """On the driver once training ended: log the records rank 0 did not see (the evaluations that ended after the
    workers), opening the run's trackers only if there are any. How many."""
    log = MetricsLogger(cfg.run_dir, cfg.train.max_steps, cfg.train.log_every_n_steps)
    follower = GenEvalLog(cfg.run_dir, log)
    if not follower.pending():
        return 0
    if cfg.metrics.trackers:
        log.trackers = Trackers(cfg, resume_step=None)
    try:
        return follower.poll(now=True)
    finally:
        log.close()


def gen_scores(run_dir: Path | Location) -> list[dict]:
    """The run's gen_eval and gen_eval_failed events in metrics.jsonl, in order (`raysft report`, `raysft train`'s
    closing lines)."""
    if not (location(run_dir) / METRICS_FILE).is_file():
        return []
    return [row for row in read_metrics(run_dir) if row.get("event") in EVENTS]


def scores_text(metrics: dict, stderr: dict | None = None) -> str:
    """Each gen/<scorer> score, without its prefix, with its standard error where there is one."""
    stderr = stderr or {}
    return ", ".join(f"{k.removeprefix('gen/')} {v:.3f}" + (f" ± {stderr[k]:.3f}" if k in stderr else "")
                     for k, v in metrics.items() if k.startswith("gen/"))


def score_line(events: list[dict], eval_set: str) -> str:
    """The run's scores before and after: its first and last evaluated checkpoints (with eval.at_start, the first is
    the base at step 0), and how many evaluations failed."""
    done = [e for e in events if e["event"] == "gen_eval"]
    failed = sum(e["event"] == "gen_eval_failed" for e in events)
    skipped = sum(e["event"] == "gen_eval_skipped" for e in events)
    note = f"; {failed} failed (gen_eval_failed in {METRICS_FILE})" if failed else ""
    note += f"; {skipped} skipped while an earlier one ran (eval.every_checkpoint)" if skipped else ""
    if not done:
        return f"generation eval ({eval_set}): no checkpoint scored{note}"

    def scores(e: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("gen/"))

    first, last = done[0], done[-1]
    before = f"step {first['step']}{' (the base)' if first['step'] == 0 else ''}: {scores(first)}"
    if first is last:
        return f"generation eval ({eval_set}, {last['samples']} prompts): {before}{note}"
    return (f"generation eval ({eval_set}, {last['samples']} prompts): {before} -> step {last['step']}: "
            f"{scores(last)}{note}")
