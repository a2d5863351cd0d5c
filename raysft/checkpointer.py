"""The one home of checkpointing during training: when to save, where the parts go, the background write, the
manifest that makes a checkpoint complete, committing it, pruning, and finding the checkpoint to resume from.

The layouts themselves (full, sharded) live in raysft.checkpoint; where a finished checkpoint goes is a `Sink`:

- `DirectorySink`: every rank writes its part straight into one staging directory inside the run
  (`<run>/.staging/`, on the run's local or shared filesystem); once the manifest is written, rank 0 renames it to
  `<run>/checkpoint_<step>`: each byte is written once, and a directory named like a checkpoint is always whole.
  Without Ray it also prunes (`checkpoint.keep`, or `keep_best`: raysft.retention); under Ray, `on_commit`
  registers the checkpoint where it lies (`checkpoint_upload_mode=NO_UPLOAD`) and Ray prunes by the same rule.
- `ScratchSink`: each rank writes into a node-local scratch directory and hands it to `report`, which copies it
  (Ray's upload to remote storage such as s3://); the scratch copy is removed afterwards.
- `UploadSink`: the same without Ray: each rank uploads its own files, rank 0 the manifest last.

Everything here is plain torch.distributed: the same code checkpoints under Ray and under torchrun.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from raysft.checkpoint import (
    MANIFEST_FILE,
    CheckpointSaveError,
    PendingSave,
    TrainingObjects,
    TrainState,
    choose_mode,
    fsync,
    incomplete_reason,
    load,
    start_save,
)
from raysft.collectives import all_ranks, count_ranks
from raysft.config import CheckpointConfig
from raysft.retention import to_prune
from raysft.storage import Location, location, native

CHECKPOINT_PREFIX = "checkpoint_"  # + zero-padded step: names sort by step
STAGING_DIR = ".staging"


class Sink(Protocol):
    """Where checkpoint parts are written and how a complete checkpoint is handed over. All methods but `stage`
    are collective."""

    shared: bool
    """Whether every rank writes into the same directory (then each lists only its own files)."""

    def stage(self, step: int) -> Path:
        """The directory this rank writes its part of the checkpoint of `step` into."""

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        """The checkpoint in `staged` is complete on every rank (its manifest written): make it the latest."""

    def discard(self, staged: Path) -> None:
        """A save failed on some rank: remove what was written, so no part of it is taken for a checkpoint."""

    def report(self, metrics: dict, step: int) -> None:
        """Progress without a checkpoint."""


def scratch_root(run_name: str, run_dir: Path | Location) -> Path:
    """Where this node's workers write checkpoint parts for a ScratchSink; a worker killed in a save leaves its part
    here, so a relaunch clears it."""
    run_id = hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]
    root = Path(tempfile.gettempdir()) / f"raysft-{run_name}-{run_id}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def clear_scratch(root: Path) -> None:
    """Remove checkpoint parts that workers of an earlier launch left on this node when they were killed."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)


def checkpoint_name(step: int, taken: frozenset[str] = frozenset()) -> str:
    """checkpoint_<step, 8 digits>; a step saved again after resuming from an older checkpoint gets .1, .2, ...
    (the earlier directory of that step stays whole until it is pruned)."""
    name = base = f"{CHECKPOINT_PREFIX}{step:08d}"
    n = 0
    while name in taken:
        n += 1
        name = f"{base}.{n}"
    return name


def checkpoint_dirs(run_dir: Path | Location) -> list[Path | Location]:
    """The run's checkpoint directories, oldest first (their names sort by step)."""
    return [native(d) for d in location(run_dir).dirs(CHECKPOINT_PREFIX)]


def find_resume_dir(run_dir: Path | Location, rank: int) -> tuple[Path | Location | None, list[tuple[str, str]]]:
    """Collective: the run's newest complete checkpoint, and the (path, reason) of each newer, incomplete one
    skipped. Rank 0 checks each against its manifest; None if there is none (a fresh start).

    Complete is what counts, not registered with Ray: a worker that dies just after a save can take Ray's record
    of it along, but its directory, with every file its manifest lists, is a whole checkpoint, and starting from an
    older one would lose the steps between.
    """
    result: list = [None, []]
    if rank == 0:
        for candidate in reversed(checkpoint_dirs(run_dir)):
            reason = incomplete_reason(candidate)
            if reason is None:
                result[0] = candidate.name
                break
            result[1].append((str(candidate), reason))
    dist.broadcast_object_list(result, src=0)
    return (run_dir / result[0] if result[0] else None), result[1]


def existing_checkpoint_names(run_dir: Path | Location, rank: int) -> frozenset[str]:
    """Collective: the checkpoint directories already in the run (rank 0 looks), fixed for this launch."""
    names = [[p.name for p in checkpoint_dirs(run_dir)] if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return frozenset(names[0])


class ScratchSink:
    """Parts in node-local scratch directories, handed to `report(metrics, dir_or_None, step)`, then removed."""

    shared = False

    def __init__(self, report: Callable[[dict, Path | None, int], None], root: Path):
        self._report, self.root = report, root

    def stage(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"ckpt-{step}-", dir=self.root))

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        try:
            self._report(metrics, staged if wrote else None, step)
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def report(self, metrics: dict, step: int) -> None:
        self._report(metrics, None, step)


class DirectorySink:
    """Parts written straight into `<run>/.staging/<name>`, renamed into place by rank 0 when complete.

    `keep`: prune the oldest complete checkpoints beyond this many (never the latest); 0 leaves pruning to whoever
    registers the checkpoints (`on_commit`, Ray). `on_commit(final_dir or None, metrics)` runs on every rank after
    the rename (rank 0 gets the directory), and `on_report(metrics)` for progress without a checkpoint.
    """

    shared = True

    def __init__(self, run_dir: Path, rank: int, keep: int = 0, taken: frozenset[str] = frozenset(),
                 on_commit: Callable[[Path | None, dict], None] | None = None,
                 on_report: Callable[[dict], None] | None = None, keep_best: int = 0):
        self.run_dir, self.rank, self.keep, self.keep_best = Path(run_dir), rank, keep, keep_best
        self.taken = set(taken)
        self.on_commit, self.on_report = on_commit, on_report

    def clear_staging(self) -> None:
        """Rank 0, at the start of a launch: parts that a killed launch left behind."""
        shutil.rmtree(self.run_dir / STAGING_DIR, ignore_errors=True)

    def stage(self, step: int) -> Path:
        name = checkpoint_name(step, frozenset(self.taken))
        self.taken.add(name)  # the same on every rank: each makes the same choices in the same order
        staged = self.run_dir / STAGING_DIR / name
        staged.mkdir(parents=True, exist_ok=True)
        return staged

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        final = self.run_dir / staged.name
        error: list = [None]
        if self.rank == 0:
            try:
                os.replace(staged, final)
                fsync(self.run_dir)  # the rename itself is durable
                with contextlib.suppress(OSError):  # the staging area, once empty, goes too
                    staged.parent.rmdir()
                if self.keep or self.keep_best:
                    self._prune()
            except OSError as e:
                error[0] = f"{final}: {e}"
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            self.discard(staged)
            raise CheckpointSaveError(f"committing the checkpoint of step {step} failed: {error[0]}")
        if self.on_commit is not None:
            self.on_commit(final if self.rank == 0 else None, metrics)

    def discard(self, staged: Path) -> None:
        dist.barrier()  # every rank has stopped writing
        if self.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
            with contextlib.suppress(OSError):
                staged.parent.rmdir()

    def report(self, metrics: dict, step: int) -> None:
        if self.on_report is not None:
            self.on_report(metrics)

    def _prune(self) -> None:
        complete = [d for d in checkpoint_dirs(self.run_dir) if (d / MANIFEST_FILE).is_file()]
        for old in to_prune(complete, self.keep, self.keep_best):
            shutil.rmtree(old, ignore_errors=True)


class UploadSink:
    """Without Ray, on remote storage (s3://, gs://, ...): each rank writes into node-local scratch and uploads its
    own files into `<run>/<name>/`; rank 0 uploads the manifest last, once every rank's upload succeeded, so a
    checkpoint without one is never loaded. Prunes to `keep`."""

    shared = False

    def __init__(self, run_dir: Location, rank: int, keep: int, scratch: Path, taken: frozenset[str] = frozenset(),
                 keep_best: int = 0):
        self.run_dir, self.rank, self.keep, self.scratch, self.keep_best = run_dir, rank, keep, scratch, keep_best
        self.taken = set(taken)
        self.names: dict[Path, str] = {}

    def stage(self, step: int) -> Path:
        name = checkpoint_name(step, frozenset(self.taken))
        self.taken.add(name)
        self.scratch.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        self.names[staged] = name
        return staged

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        final = self.run_dir / self.names.pop(staged)
        error = None
        try:
            for path in sorted(p for p in staged.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
                (final / str(path.relative_to(staged))).upload(path)
        except OSError as e:
            error = e
        failed = count_ranks(error is not None)
        try:
            if not failed and self.rank == 0:
                (final / MANIFEST_FILE).upload(staged / MANIFEST_FILE)
                if self.keep or self.keep_best:
                    complete = [d for d in self.run_dir.dirs(CHECKPOINT_PREFIX) if (d / MANIFEST_FILE).is_file()]
                    for old in to_prune(complete, self.keep, self.keep_best):
                        old.fs.delete_dir(old.path)
        except OSError as e:
            error = e
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        failed = count_ranks(error is not None)
        if failed:
            raise CheckpointSaveError(f"{final}: uploading the checkpoint of step {step} failed on {failed} rank(s)"
                                      f"{f': {error}' if error else ''}; the previous checkpoint is still the latest")

    def discard(self, staged: Path) -> None:
        self.names.pop(staged, None)
        shutil.rmtree(staged, ignore_errors=True)

    def report(self, metrics: dict, step: int) -> None:
        pass


class Checkpointer:
    """Saves the training state at the configured cadence into a Sink, one save at a time, in the background with
    checkpoint.async; loads it back. Collective where its methods say so."""

    def __init__(self, cfg: CheckpointConfig, objs: TrainingObjects, sink: Sink, log, rank: int):
        self.cfg, self.objs, self.sink, self.log, self.rank = cfg, objs, sink, log, rank
        self.mode = choose_mode(cfg.mode, objs.model)
        self.pending: tuple[PendingSave, dict] | None = None  # a checkpoint still being written, its metrics

    def load(self, ckpt_dir: Path | Location) -> TrainState:
        return load(ckpt_dir, self.objs)

    def due(self, step: int, stop: int) -> bool:
        return step % self.cfg.every_n_steps == 0 or step == stop

    def save(self, state: TrainState, metrics: dict) -> None:
        """Collective: snapshot the state and write it (in the background with checkpoint.async); `finish` or a
        later `poll` commits it."""
        self.finish()  # one save at a time: the previous one must be complete
        start = time.perf_counter()
        staged = self.sink.stage(state.step)
        try:
            pending = start_save(staged, self.mode, self.objs, state, self.cfg.async_save, shared=self.sink.shared)
        except BaseException:
            self.sink.discard(staged) if self.sink.shared else shutil.rmtree(staged, ignore_errors=True)
            raise
        self.pending = (pending, {**metrics, "step": state.step, "save_blocking_s": time.perf_counter() - start,
                                  "save_started": start})
        if not self.cfg.async_save:
            self.finish()

    def poll(self, at_step: int) -> None:
        """Collective: commit the pending save if every rank has finished writing it."""
        if self.pending is not None and all_ranks(self.pending[0].done()):
            self.finish(at_step)

    def finish(self, at_step: int | None = None) -> None:
        """Collective: wait for the pending save (raising CheckpointSaveError on every rank if it failed on any),
        then commit it."""
        if self.pending is None:
            return
        (pending, metrics), self.pending = self.pending, None
        try:
            wrote = pending.finish()
        except CheckpointSaveError:
            self.sink.discard(pending.out_dir)
            raise
        save_s = time.perf_counter() - metrics.pop("save_started")
        size_gb = pending.bytes_written / 1e9 if self.rank == 0 else 0.0  # rank 0 wrote the manifest: every size
        metrics.update(save_s=save_s, save_gb=size_gb, save_gb_per_s=size_gb / save_s)
        self.sink.commit(pending.out_dir, pending.step, metrics, wrote)
        self.log.event("checkpoint", step=pending.step, mode=self.mode,
                       blocking_s=round(metrics["save_blocking_s"], 3), save_s=round(save_s, 3),
                       gb=round(size_gb, 4), gb_per_s=round(size_gb / save_s, 3),
                       reported_at_step=pending.step if at_step is None else at_step)


