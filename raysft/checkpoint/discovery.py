"""Checkpoint names in a run directory, finding the one to resume from, and pruning old ones."""

from __future__ import annotations

import contextlib
from pathlib import Path

from raysft.checkpoint.manifest import MANIFEST_FILE, incomplete_reason
from raysft.collectives import from_rank0
from raysft.storage import Location, location, native

CHECKPOINT_PREFIX = "checkpoint_"  # + zero-padded step: names sort by step


def checkpoint_name(step: int, taken: frozenset[str] | set[str] = frozenset()) -> str:
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
    def newest_complete() -> tuple[str | None, list[tuple[str, str]]]:
        skipped = []
        for candidate in reversed(checkpoint_dirs(run_dir)):
            reason = incomplete_reason(candidate)
            if reason is None:
                return candidate.name, skipped
            skipped.append((str(candidate), reason))
        return None, skipped

    name, skipped = from_rank0(newest_complete)
    return (run_dir / name if name else None), skipped


def existing_checkpoint_names(run_dir: Path | Location, rank: int) -> frozenset[str]:
    """Collective: the checkpoint directories already in the run (rank 0 looks), fixed for this launch."""
    return frozenset(from_rank0(lambda: [p.name for p in checkpoint_dirs(run_dir)]))


def prune(run_dir: Path | Location, keep: int, keep_best: int = 0) -> None:
    """Delete the oldest complete checkpoints beyond `keep`, or with `keep_best` all but the best by eval loss and
    the latest (raysft.retention); never the latest; local or on remote storage. Best effort: a checkpoint that
    could not be deleted is only one more kept."""
    from raysft.retention import to_prune  # it reads checkpoints through this package

    complete = [d for d in location(run_dir).dirs(CHECKPOINT_PREFIX) if (d / MANIFEST_FILE).is_file()]
    for old in to_prune(complete, keep, keep_best):
        with contextlib.suppress(OSError):
            old.fs.delete_dir(old.path)
