"""Where a checkpoint's parts are written and how a finished one is committed: a `Sink`.

- `DirectorySink`: every rank writes its part straight into one staging directory inside the run
  (`<run>/.staging/<name>`, on the run's local or shared filesystem); once the manifest is written, rank 0 renames
  it to `<run>/<name>`: each byte is written once, and a directory named like a checkpoint is always whole. Without
  Ray it also prunes (`checkpoint.keep`, or `keep_best`: retention.py); under Ray, `on_commit` registers the
  checkpoint where it lies (`checkpoint_upload_mode=NO_UPLOAD`) and Ray prunes by the same rule.
- `UploadSink`: without Ray, on remote storage (s3://, ...): each rank writes node-local scratch and uploads its own
  files into `<run>/<name>/`; rank 0 uploads the manifest last, once every rank's upload succeeded.
- `ScratchSink`: each rank writes node-local scratch and hands it to a `report` callback (Ray's upload to remote
  storage); the scratch copy is removed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from raysft.checkpoint.discovery import checkpoint_name
from raysft.checkpoint.manifest import MANIFEST_FILE, fsync
from raysft.checkpoint.retention import LOWEST_EVAL_LOSS, prune
from raysft.distributed.collectives import count_ranks, from_rank0
from raysft.errors import CheckpointSaveError
from raysft.storage import Location

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
    """Where this node's workers write checkpoint parts before they leave the node; a worker killed in a save
    leaves its part here, so a relaunch clears it (`clear_scratch`)."""
    run_id = hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]
    root = Path(tempfile.gettempdir()) / f"raysft-{run_name}-{run_id}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def clear_scratch(root: Path) -> None:
    """Remove checkpoint parts that workers of an earlier launch left on this node when they were killed."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)


class _Names:
    """The checkpoint names of this launch: those in the run when it started, and each new one. Every rank makes
    the same choices in the same order, so all agree without talking."""

    def __init__(self, taken: frozenset[str]):
        self.taken = set(taken)

    def next(self, step: int) -> str:
        name = checkpoint_name(step, self.taken)
        self.taken.add(name)
        return name


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
    the rename (rank 0 gets the directory), and `on_report(metrics)` for progress without a checkpoint. Rank 0
    clears the staging parts a killed launch left when the sink is made (before any rank stages: the launch's
    collectives come between). With `single_writer` (live replica groups, each a world of one, any of which may be
    the writer of a step), none is cleared then, which could be another group's save: a stage clears what a dead
    writer left under its own name.
    """

    shared = True

    def __init__(self, run_dir: Path, rank: int, keep: int = 0, taken: frozenset[str] = frozenset(),
                 on_commit: Callable[[Path | None, dict], None] | None = None,
                 on_report: Callable[[dict], None] | None = None, keep_best: int = 0,
                 best: tuple[str, str] = LOWEST_EVAL_LOSS, single_writer: bool = False):
        self.run_dir, self.rank, self.keep, self.keep_best = Path(run_dir), rank, keep, keep_best
        self.best = best  # keep_best's metric and mode (checkpoint.best_metric)
        self.names = _Names(taken)
        self.on_commit, self.on_report, self.single_writer = on_commit, on_report, single_writer
        if rank == 0 and not single_writer:
            shutil.rmtree(self.run_dir / STAGING_DIR, ignore_errors=True)

    def stage(self, step: int) -> Path:
        staged = self.run_dir / STAGING_DIR / self.names.next(step)
        if self.single_writer:
            shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True, exist_ok=True)
        return staged

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        final = self.run_dir / staged.name

        def rename() -> str | None:
            try:
                os.replace(staged, final)
                fsync(self.run_dir)  # the rename itself is durable
            except OSError as e:
                return f"{final}: {e}"
            with contextlib.suppress(OSError):  # the staging area, once empty, goes too
                staged.parent.rmdir()
            if self.keep or self.keep_best:
                prune(self.run_dir, self.keep, self.keep_best, self.best)
            return None

        error = from_rank0(rename)
        if error:
            self.discard(staged)
            raise CheckpointSaveError(f"committing the checkpoint of step {step} failed: {error}")
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


class UploadSink:
    """Each rank uploads its own files from node-local scratch into `<run>/<name>/`; rank 0 uploads the manifest
    last, once every rank's upload succeeded, so a checkpoint without one is never loaded. Prunes to `keep`."""

    shared = False

    def __init__(self, run_dir: Location, rank: int, keep: int, scratch: Path, taken: frozenset[str] = frozenset(),
                 keep_best: int = 0, best: tuple[str, str] = LOWEST_EVAL_LOSS):
        self.run_dir, self.rank, self.keep, self.scratch, self.keep_best = run_dir, rank, keep, scratch, keep_best
        self.best = best
        self.names = _Names(taken)
        self.staged: dict[Path, str] = {}
        clear_scratch(scratch)

    def stage(self, step: int) -> Path:
        name = self.names.next(step)
        self.scratch.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        self.staged[staged] = name
        return staged

    def commit(self, staged: Path, step: int, metrics: dict, wrote: bool) -> None:
        final = self.run_dir / self.staged.pop(staged)
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
                    prune(self.run_dir, self.keep, self.keep_best, self.best)
        except OSError as e:
            error = e
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        failed = count_ranks(error is not None)
        if failed:
            raise CheckpointSaveError(f"{final}: uploading the checkpoint of step {step} failed on {failed} rank(s)"
                                      f"{f': {error}' if error else ''}; the previous checkpoint is still the latest")

    def discard(self, staged: Path) -> None:
        self.staged.pop(staged, None)
        shutil.rmtree(staged, ignore_errors=True)

    def report(self, metrics: dict, step: int) -> None:
        pass
