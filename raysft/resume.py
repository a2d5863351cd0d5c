"""Which run a launch continues and from which checkpoint.

A run is its directory `<run.storage_path>/<run.name>`, local or on remote storage (raysft.storage). Launching again
with the same name continues it, so what defines the run (the data, the model, the seed of the data order) is
recorded on the first launch and must match on every later one; `fresh` starts over and keeps the old directory
under another name. Everything else may change between launches: workers, sharding, checkpointing, and
hyperparameters such as train.max_steps (to train longer) or train.lr, which apply from the resumed step on.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from raysft.checkpoint import incomplete_reason
from raysft.config import ConfigError, TrainConfig
from raysft.storage import Location, location, native

CHECKPOINT_PREFIX = "checkpoint_"  # + zero-padded step: names sort by step
RUN_FILE = "raysft_run.json"
# Without these, a checkpoint's weights and data cursor would mean something else: another model, or another order
# of the samples (the seed), so samples would be skipped or seen twice.
RUN_DEFINING_KEYS = ("model.path", "model.config", "model.tokenizer", "train.seed")
DATA_KEY = "data"  # the tokenized store's fingerprint: data files' contents, tokenizer, template, length


def claim_run_dir(config: TrainConfig, data_fingerprint: str, fresh: bool = False) -> Path | Location | None:
    """Check that this launch may use the run directory, and record what defines the run on first use.

    Returns where an existing run was moved to with `fresh`, else None. Raises ConfigError, before anything is
    written, when the run exists and was started with other run-defining settings, or when the directory holds
    files but no raysft_run.json: raysft writes into, and `fresh` moves, only a directory raysft created.
    """
    run_dir = location(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory: pick another run.name")
    if run_dir.children() and not (run_dir / RUN_FILE).is_file():
        raise ConfigError(
            f"{run_dir} exists and is not a raysft run directory (no {RUN_FILE}); raysft neither writes into nor "
            "moves (--fresh) a directory it did not create: pick another run.name or run.storage_path")
    moved = None
    if fresh and run_dir.children():
        moved = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%dT%H%M%S')}")
        run_dir.move_dir(moved)
    identity = run_identity(config, data_fingerprint)
    path = run_dir / RUN_FILE
    if path.is_file():
        recorded = json.loads(path.read_text())
        changed = [k for k in identity if recorded.get(k) != identity[k]]
        if changed:
            key = changed[0]
            what = ("the training data (the contents of data.paths, the tokenizer, the chat template or "
                    "data.max_seq_len) differs" if key == DATA_KEY else
                    f"it was started with {key}={recorded.get(key)!r}, this launch has {identity[key]!r}")
            raise ConfigError(
                f"run '{config.run.name}' in {run_dir} exists and {what}; launching again continues a run, so "
                f"{', '.join(changed)} must match. Keep the run's settings, pick another run.name, or start over "
                f"with --fresh (the old run is kept beside it as {run_dir.name}.replaced-<time>)")
        return native(moved) if moved else None
    run_dir.mkdir()
    path.write_text(json.dumps(identity, indent=1))
    return native(moved) if moved else None


def run_identity(config: TrainConfig, data_fingerprint: str) -> dict:
    values = config.to_dict()
    identity = {DATA_KEY: data_fingerprint}
    for key in RUN_DEFINING_KEYS:
        section, name = key.split(".")
        identity[key] = values[section][name]
    return identity


def choose_resume_dir(run_dir: Path | Location, rank: int) -> tuple[Path | Location | None, list[tuple[str, str]]]:
    """Collective: the run's newest complete checkpoint, and the (path, reason) of each newer, incomplete one
    skipped. Rank 0 checks each against its manifest (sizes, and checksums as `incomplete_reason` says); None if
    there is none (a fresh start).

    Complete is what counts, not registered: a worker that dies just after a save can take Ray's record of it
    along (the report was not yet collected), but its directory, with every file its manifest lists, is a whole
    checkpoint, and starting from an older one would lose the steps between.
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


def checkpoint_dirs(run_dir: Path | Location) -> list[Path | Location]:
    """The run's checkpoint directories, oldest first (their names sort by step)."""
    return [native(d) for d in location(run_dir).dirs(CHECKPOINT_PREFIX)]


def checkpoint_name(step: int, taken: frozenset[str] = frozenset()) -> str:
    """checkpoint_<step, 8 digits>; a step saved again after resuming from an older checkpoint gets .1, .2, ...
    (Ray would merge it into the old directory, and pruning one entry would delete both)."""
    name = base = f"{CHECKPOINT_PREFIX}{step:08d}"
    n = 0
    while name in taken:
        n += 1
        name = f"{base}.{n}"
    return name


def clear_scratch(root: Path) -> None:
    """Remove checkpoint parts that workers of an earlier launch left on this node when they were killed."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
