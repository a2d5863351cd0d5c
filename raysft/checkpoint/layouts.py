"""Saving and loading a checkpoint of either layout (raysft.checkpoint.full, raysft.checkpoint.sharded), both made
complete by the manifest written last. A run may switch layouts across a resume; either loads on any number of
workers and any sharding strategy, from local or remote storage."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from raysft.checkpoint import full, sharded
from raysft.checkpoint.background import chain, run_now
from raysft.checkpoint.full import OPTIMIZER_META_FILE
from raysft.checkpoint.manifest import MANIFEST_FILE, durable_file_list, write_manifest
from raysft.checkpoint.state import (
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    TrainingObjects,
    TrainState,
    gather_rng_states,
    read_trainer_state,
    restore_rng_state,
    restore_trainer_state,
    write_run_files,
)
from raysft.distributed.collectives import count_ranks
from raysft.errors import CheckpointSaveError
from raysft.hf.shards import OPTIMIZER_FILE
from raysft.storage import Location

# each: save(out_dir, objs, asynchronous) -> Future of {file: sha256} hashed while written; load(ckpt_dir, objs)
BACKENDS = {"full": full, "sharded": sharded}
TRAINING_FILES = (OPTIMIZER_FILE, OPTIMIZER_META_FILE, RNG_FILE, STATE_FILE, MANIFEST_FILE)  # not for inference


class PendingSave:
    """A checkpoint whose files may still be being written in the background. `finish` is collective: it waits,
    makes sure every rank succeeded (a background failure is raised on all ranks, never lost) and then writes the
    manifest that makes the checkpoint complete."""

    def __init__(self, out_dir: Path, step: int, futures: list[Future], owner: int | None = None):
        self.out_dir, self.step, self.futures, self.owner = out_dir, step, futures, owner
        self.bytes_written = 0  # on rank 0 once finished: the size of the whole checkpoint, every rank's files
        # writing in the background: flushing, listing and hashing the files happen there too, off training's path
        writing = not all(f.done() for f in futures)
        self.listing = chain(futures, self._list_files) if writing else None

    def _list_files(self) -> dict[str, dict]:
        """This rank's files, flushed, with the sha256 of those the backend hashed while writing them."""
        hashed = {}
        for future in self.futures:
            hashed.update(future.result() or {})
        return durable_file_list(self.out_dir, self.owner, hashed)

    def done(self) -> bool:
        return all(f.done() for f in self.futures) and (self.listing is None or self.listing.done())

    def finish(self) -> bool:
        """Returns whether this rank wrote files."""
        error = None
        for future in [*self.futures, *([self.listing] if self.listing else [])]:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = error or e
        self._raise_if_any_rank_failed(error)
        try:
            mine = self.listing.result() if self.listing else self._list_files()
        except OSError as e:
            mine, error = {}, e
        everyone: list[dict] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is not None and error is None:
            try:
                write_manifest(self.out_dir, self.step, everyone)
                self.bytes_written = sum(e["size"] for part in everyone for e in part.values())
            except (OSError, CheckpointError) as e:
                error = e
        self._raise_if_any_rank_failed(error)
        return bool(mine)

    def _raise_if_any_rank_failed(self, error: BaseException | None) -> None:
        failed = count_ranks(error is not None)
        if failed:
            raise CheckpointSaveError(
                f"{self.out_dir}: writing the checkpoint of step {self.step} failed on {failed} rank(s)"
                f"{f': {error}' if error else ''}. The previous checkpoint is still the latest complete one; "
                "launching again resumes from it once the cause (a full disk?) is fixed") from error


def start_save(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState,
               asynchronous: bool = False, shared: bool = False) -> PendingSave:
    """Collective: snapshot this rank's part of the training state and write it into out_dir: a directory of this
    rank's own, or with `shared` one that every rank writes into (each then lists only the files it wrote). With
    asynchronous, the writing (and hashing) happens in the background and training may go on; either way, call
    `finish()` on the result, on every rank, before the checkpoint is used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    futures = [BACKENDS[mode].save(out_dir, objs, asynchronous)]
    rng = gather_rng_states()
    if dist.get_rank() == 0:  # small files, written now
        futures.append(run_now(lambda: write_run_files(out_dir, mode, objs, state, rng)))
    return PendingSave(out_dir, state.step, futures, owner=dist.get_rank() if shared else None)


def save(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState) -> bool:
    """Collective, synchronous: write a complete checkpoint part. Returns whether this rank wrote files."""
    return start_save(out_dir, mode, objs, state).finish()


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> TrainState:
    """Collective: restore everything from a complete checkpoint of either layout, on any topology, local or on
    remote storage."""
    state = read_trainer_state(ckpt_dir)
    launched = [{k: v for k, v in group.items() if k != "params"} for group in objs.optimizer.param_groups]
    BACKENDS[state["mode"]].load(ckpt_dir, objs)  # the checkpoint's optimizer state into this launch's groups
    for group, settings in zip(objs.optimizer.param_groups, launched, strict=True):
        group.update(settings)  # as launched, to the type (a broadcast from rank 0 turns the betas into a list)
    restore_rng_state(ckpt_dir, same_world=state["world_size"] == dist.get_world_size())
    return restore_trainer_state(state, objs)
