"""Checkpoint names in a run directory, and finding the one to resume from."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import torch.distributed as dist

from raysft.checkpoint.manifest import hash_problem, listed_and_sized, share_by_size, to_hash
from raysft.distributed.collectives import first_of_ranks, from_rank0
from raysft.storage import Location, location, native

CHECKPOINT_PREFIX = "checkpoint_"  # + zero-padded step: names sort by step
RUN_FILE = "raysft_run.json"  # what defines the run, recorded at its first launch (raysft.launch.prelaunch)
RUN_ID_KEY = "run_id"  # in RUN_FILE: this run, not another of the same name started over with --fresh
SET_ASIDE_KEY = "set_aside"  # in RUN_FILE: the ids of the runs --fresh replaced (their snapshots are reclaimed)
LAUNCH_CONFIG_FILE = "raysft_config.json"  # the whole config of the run's latest launch (TrainConfig.to_dict)


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
    skipped; None if there is none (a fresh start).

    Complete is what counts, not registered with Ray: a worker that dies just after a save can take Ray's record
    of it along, but its directory, with every file its manifest lists, is a whole checkpoint, and starting from an
    older one would lose the steps between.
    """
    skipped = []
    for name in from_rank0(lambda: [d.name for d in reversed(checkpoint_dirs(run_dir))]):
        candidate = run_dir / name
        reason = verified_reason(candidate)
        if reason is None:
            return candidate, skipped
        skipped.append((str(candidate), reason))
    return None, skipped


def verified_reason(ckpt_dir: Path | Location) -> str | None:
    """Collective: why ckpt_dir is not a complete checkpoint (None if it is), as manifest.incomplete_reason says,
    with the reading shared: rank 0 checks the manifest and the sizes, then every rank hashes its share of the
    files (about the same bytes each), so a resume reads the checkpoint once over all ranks rather than through
    rank 0 while the others wait. Every rank gets the same answer: the first problem by rank."""
    ckpt = location(ckpt_dir)

    def plan() -> tuple[dict, str | None, list[list[str]]]:
        files, problem = listed_and_sized(ckpt)
        shares = [] if problem else share_by_size(files, to_hash(ckpt, files), dist.get_world_size())
        return files, problem, shares

    files, problem, shares = from_rank0(plan)
    if problem:
        return problem
    return first_of_ranks(hash_problem(ckpt, files, shares[dist.get_rank()]))


def step_of(ckpt_dir: Path | Location) -> int:
    """The step a checkpoint directory holds, from its name (checkpoint_<step>[.n])."""
    return int(ckpt_dir.name[len(CHECKPOINT_PREFIX):].split(".")[0])


def existing_checkpoint_names(run_dir: Path | Location) -> frozenset[str]:
    """Collective: the checkpoint directories already in the run (rank 0 looks), fixed for this launch."""
    return frozenset(from_rank0(lambda: [p.name for p in checkpoint_dirs(run_dir)]))


def new_run_id() -> str:
    return uuid.uuid4().hex


def read_run_id(run_dir: Path | Location) -> str:
    """The run's id from RUN_FILE; a run recorded before ids were (no RUN_ID_KEY) gets one made of its record and
    directory, the same at every launch."""
    record = (location(run_dir) / RUN_FILE).read_text()
    recorded = json.loads(record).get(RUN_ID_KEY)
    if isinstance(recorded, str) and recorded.isalnum():
        return recorded
    return "r" + hashlib.sha256(f"{run_dir}\n{record}".encode()).hexdigest()[:31]


def read_set_aside(run_dir: Path | Location) -> tuple[str, ...]:
    """The ids of the runs this one replaced (`--fresh`): none of their snapshots is ever resumed from."""
    ids = json.loads((location(run_dir) / RUN_FILE).read_text()).get(SET_ASIDE_KEY, [])
    return tuple(i for i in ids if isinstance(i, str) and i.isalnum()) if isinstance(ids, list) else ()
