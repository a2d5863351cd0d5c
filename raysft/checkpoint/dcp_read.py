"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP keeps its index in `.metadata`, a pickle, and stores non-tensor values (the optimizer's param groups) as
`torch.save` bytes that its default planner loads with `weights_only=False`. Whoever can write a checkpoint
directory could thus run code in every process that resumes from, exports or chats with it; the manifest beside
the files is unsigned, so it proves completeness, not origin. Here the index is unpickled by an unpickler that
admits only the classes DCP's index is made of (and the torch and pathlib values inside them), file names in it
must stay inside the checkpoint, and the byte values are loaded with `weights_only=True`. Every DCP read in raysft
goes through `dcp_reader` and `SafeLoadPlanner`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from raysft.storage import Location, location

# (module, name) of everything a `.metadata` written by torch 2.x refers to, besides torch dtypes.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name: torch.strided
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointData(pickle.UnpicklingError):
    """A checkpoint file would make the unpickler call or build something a DCP index never holds."""


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file: io.IOBase, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointData(
            f"{self.where}: refusing to unpickle {module}.{name}: a DCP index holds only torch.distributed."
            "checkpoint metadata, so this file was not written by torch (a tampered checkpoint?). Nothing from it "
            "was run")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointData(f"{self.where}: refusing a persistent id in a DCP index")


def load_index(file: io.IOBase, where: str) -> Metadata:
    """Unpickle a DCP `.metadata` with only DCP's own classes admitted, and check that it is an index whose files
    are inside the checkpoint."""
    try:
        metadata = _IndexUnpickler(file, where).load()
    except UnsafeCheckpointData:
        raise
    except Exception as e:  # a truncated or garbled pickle
        raise UnsafeCheckpointData(f"{where}: not a DCP index: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointData(f"{where}: not a DCP index (a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not path or "/" in path or "\\" in path or path in (".", ".."):
            raise UnsafeCheckpointData(f"{where}: names a file outside the checkpoint: {path!r}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader for a local directory, with `.metadata` read by `load_index`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_index(f, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, loading non-tensor values (the optimizer's param groups) as plain data only: the same
    as `DefaultLoadPlanner.load_bytes`, with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointData(f"{fqn}: refusing a saved value that is not plain data (nothing from it was "
                                       f"run): {e}") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_reader(ckpt_dir: Path | Location) -> FileSystemReader:
    """DCP's reader for a local directory; on remote storage one that reads byte ranges from it. Both read
    `.metadata` with `load_index`."""
    ckpt = location(ckpt_dir)
    return SafeFileSystemReader(ckpt.local) if ckpt.local is not None else StorageReader(ckpt)


class _ArrowFiles(FileSystemBase):
    """DCP's file operations on a pyarrow filesystem, for reading (checkpoints are written locally and uploaded
    by Ray)."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise NotImplementedError(f"{path}: raysft reads checkpoints from remote storage, it does not write them")
        with self.fs.open_input_file(str(path)) as f:  # random access: ranged reads, nothing downloaded up front
            yield f

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise NotImplementedError

    def mkdir(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    def rm_file(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


class StorageReader(SafeFileSystemReader):
    """Loads a DCP checkpoint straight from remote storage: each rank fetches only the byte ranges of the tensor
    pieces its own shards need, one ranged read per piece, instead of every node downloading the checkpoint.
    `bytes_read` counts them."""

    def __init__(self, ckpt: Location):
        super().__init__(ckpt.path)
        self.fs = _ArrowFiles(ckpt.fs)
        self.path = ckpt.path
        self.bytes_read = 0

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        data = file.read_at(sinfo.length, sinfo.offset)
        self.bytes_read += len(data)
        return io.BytesIO(data)
