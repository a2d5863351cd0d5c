"""Checkpoint names in a run directory, and finding the one to resume from."""

from __future__ import annotations

from pathlib import Path

from raysft.checkpoint.manifest import incomplete_reason
from raysft.parallel.collectives import from_rank0
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


def find_resume_dir(run_dir: Path | Location) -> tuple[Path | Location | None, list[tuple[str, str]]]:
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


def existing_checkpoint_names(run_dir: Path | Location) -> frozenset[str]:
    """Collective: the checkpoint directories already in the run (rank 0 looks), fixed for this launch."""
    return frozenset(from_rank0(lambda: [p.name for p in checkpoint_dirs(run_dir)]))

