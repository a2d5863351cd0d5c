"""The sharded layout: every worker writes its own shards with torch.distributed.checkpoint (DCP),
`__<rank>_0.distcp`, plus the index `.metadata` from rank 0; replicated tensors (HSDP) are written once.

Loading reshards to any number of workers and any sharding strategy; on remote storage each rank reads just its
byte ranges. The index (a pickle) and the saved values are read through raysft.checkpoint.dcp_read, which admits
only DCP's own metadata classes and plain data, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raysft.checkpoint.background import chain, checkpoint_group, run_now
from raysft.checkpoint.dcp_read import SafeLoadPlanner, UnsafeCheckpointData, dcp_reader
from raysft.checkpoint.manifest import HashingWriter
from raysft.checkpoint.state import CheckpointError, TrainingObjects
from raysft.checkpoint.trainable import check_saved_tensors, state_dict_options
from raysft.hf.dtypes import dtype_name
from raysft.hf.shards import DCP_INDEX, is_dcp_shard
from raysft.hf.tensors import Stored
from raysft.storage import Location


def save(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    """Collective: each rank writes __<rank>_0.distcp (the planner writes a replicated tensor once), hashing it on
    the way."""
    model_sd, optim_sd = get_state_dict(objs.model, objs.optimizer, options=state_dict_options(objs.model))
    state = {"model": model_sd, "optimizer": optim_sd}
    files = _HashingFileSystem()
    writer = FileSystemWriter(out_dir)
    writer.fs = files
    if not asynchronous:
        return run_now(lambda: (dcp.save(state, storage_writer=writer), files.hashes)[1])
    # staged to CPU memory now, written by a background thread that synchronizes over its own gloo group
    written = dcp.async_save(state, storage_writer=writer, process_group=checkpoint_group(), async_stager=_stager())
    return chain([written], lambda: files.hashes)


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem, hashing each shard file as DCP writes it: {name: sha256} in `hashes`."""

    def __init__(self):
        self.hashes: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not is_dcp_shard(str(path)):
                yield stream
                return
            hashing = HashingWriter(stream)
            yield hashing
            self.hashes[Path(path).name] = hashing.hexdigest()


# torch 2.11's DefaultStager closes its StateDictStager after every stage, so a second save with it fails
# (pytorch#183413, fixed by #183424); 2.13 keeps it, and its cache, across saves
_STAGER_REUSABLE = torch.__version__ >= "2.13"  # torch.__version__ is a TorchVersion: compared as a version


@functools.cache
def _stager() -> DefaultStager | BlockingAsyncStager | None:
    """One stager for the process. It keeps the CPU copy it stages into (pinned on CUDA) from one save to the next,
    so the part of an async save that blocks training is a copy into memory that exists already, not a fresh
    allocation of the whole state (on CPU, page faults cost more than the copy). The price: that copy stays.

    Before torch 2.13, on a GPU: the older BlockingAsyncStager, which caches a pinned copy the same way (without
    it every async save allocates its copy afresh, while training waits: docs/BENCHMARKS.md, "Async save"). It
    pins, so it needs CUDA; a CPU run on such a torch gets None: DCP's default, a fresh copy each save."""
    if not _STAGER_REUSABLE:
        return BlockingAsyncStager(cache_staged_state_dict=True) if torch.cuda.is_available() else None
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    """Collective: fill this topology's shards from the checkpoint's."""
    options = state_dict_options(objs.model)  # LoRA: the adapters only; DCP refuses a checkpoint that lacks one
    model_sd, optim_sd = get_state_dict(objs.model, objs.optimizer, options=options)
    reader = dcp_reader(ckpt_dir)
    index = read_index(ckpt_dir, reader)  # a refused index, said plainly (DCP's own reading would bury it)
    check_saved_tensors(objs.model, model_tensors(index, ckpt_dir), f"{ckpt_dir}/{DCP_INDEX}")
    try:
        # the optimizer's state only: its parameter groups stay this launch's (restore_trainer_state)
        dcp.load({"model": model_sd, "optimizer": {"state": optim_sd["state"]}}, storage_reader=reader,
                 planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures (in a BaseException); name the dir
        raise CheckpointError(f"{ckpt_dir}: cannot load the sharded state: {_first_failure(e)}") from e
    set_state_dict(objs.model, objs.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def read_index(ckpt_dir: Path | Location, reader: FileSystemReader | None = None) -> Metadata:
    """The DCP index of a sharded checkpoint, read without running anything from it (raysft.checkpoint.dcp_read)."""
    try:
        return (reader or dcp_reader(ckpt_dir)).read_metadata()
    except (OSError, UnsafeCheckpointData) as e:
        raise CheckpointError(f"{ckpt_dir}: cannot read the sharded checkpoint's index: {e}") from e


def model_tensors(index: Metadata, ckpt_dir: Path | Location) -> dict[str, Stored]:
    """The model tensors a DCP index lists, as raysft.hf.tensors describes stored tensors."""
    return {key.removeprefix("model."): Stored(f"{ckpt_dir}/{DCP_INDEX}", tuple(m.size), dtype_name(m.properties.dtype))
            for key, m in index.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def _first_failure(e: BaseException) -> BaseException:
    """DCP's CheckpointException holds each rank's exception, its message their tracebacks: say the first."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values())) if isinstance(failures, dict) and failures else e
