"""Where a run keeps its files: a local or NFS directory, or a URI on any pyarrow filesystem (s3://, gs://, ...).

`location(path_or_uri)` maps what the config says to a pyarrow FileSystem and a path on it, the way Ray Train
does for `RunConfig(storage_path=...)`, and `Location` offers the few operations raysft needs on a run directory.
Object stores have no rename and no append: small files are written whole (an object appears complete or not at
all), and directories are moved by copying each object on the server, then deleting the old ones.

A URI's filesystem is resolved once per process (for s3:// that may ask the store for the bucket's region). The
driver hands its own to the workers (`use_filesystem`), so every process talks to the same endpoint; credentials
are never part of it and come from each process's environment (AWS_* variables, ~/.aws, an instance role).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raysft.storage.files import hash_stream

_RESOLVED: dict[str, tuple[pafs.FileSystem, str]] = {}  # URI → (filesystem, path on it), per process


def is_remote(path_or_uri: str) -> bool:
    """Whether a configured path is a URI of a non-local filesystem (s3://, gs://, hdfs://, ...)."""
    scheme, sep, _ = str(path_or_uri).partition("://")
    return bool(sep) and scheme != "file"


def use_filesystem(uri: str, filesystem: pafs.FileSystem, path: str) -> None:
    """Resolve `uri` to this filesystem and path from now on in this process (workers get the driver's)."""
    _RESOLVED[uri] = (filesystem, path)


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of a remote URI, resolved on first use (pyarrow's from_uri, as Ray does)."""
    if uri not in _RESOLVED:
        try:
            _RESOLVED[uri] = pafs.FileSystem.from_uri(uri)
        except (OSError, ValueError, TypeError) as e:  # an unknown scheme, an unreachable store, no such bucket
            raise OSError(f"{uri}: cannot open this storage location: {e}") from e
    return _RESOLVED[uri]


def location(where: str | os.PathLike | Location) -> Location:
    """A Location for a local path (expanded and made absolute) or a URI."""
    if isinstance(where, Location):
        return where
    text = os.fspath(where)
    if is_remote(text):
        fs, path = resolve(text)
        return Location(fs, path.rstrip("/"), text.partition("://")[0] + "://")
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    return Location(pafs.LocalFileSystem(), str(Path(text).expanduser().resolve()))


def native(loc: Location) -> Path | Location:
    """A Path where the location is local (what local code and users expect), else the Location."""
    return loc.local or loc


@dataclass(frozen=True)
class Location:
    """A file or directory on a pyarrow filesystem. `str()` gives the path, or the URI on remote storage."""

    fs: pafs.FileSystem
    path: str  # on fs: no scheme
    scheme: str = ""  # "s3://" etc. for messages; "" when local

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, f"{self.path}/{name}", self.scheme)

    def __str__(self) -> str:
        return self.scheme + self.path

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.fs, self.path.rsplit("/", 1)[0], self.scheme)

    @property
    def local(self) -> Path | None:
        return Path(self.path) if isinstance(self.fs, pafs.LocalFileSystem) else None

    def with_name(self, name: str) -> Location:
        return self.parent / name

    # --- looking ---

    def _type(self) -> pafs.FileType:
        return self.fs.get_file_info(self.path).type

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def children(self) -> list[Location]:
        """What the directory holds, files and directories, sorted by name; [] if it does not exist."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted((Location(self.fs, i.path, self.scheme) for i in infos), key=lambda c: c.name)

    def dirs(self, prefix: str = "") -> list[Location]:
        """Subdirectories whose name starts with prefix, sorted by name."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted((Location(self.fs, i.path, self.scheme) for i in infos
                       if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix)), key=lambda c: c.name)

    def files(self) -> dict[str, int]:
        """Every file below this directory (recursively): {path relative to it: size in bytes}."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True, recursive=True))
        start = len(self.path) + 1
        return {i.path[start:]: i.size for i in infos if i.type == pafs.FileType.File}

    def size(self) -> int:
        info = self.fs.get_file_info(self.path)
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self}: no such file")
        return info.size

    # --- small files, read and written whole ---

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """Readers see the old content or the new, never a part: renamed into place where the filesystem can
        rename, else one object written whole."""
        if self.local is None:  # object stores need no parent directories
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)
            return
        self.fs.create_dir(self.parent.path)
        tmp = self.with_name(f".{self.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # writers never share one
        with self.fs.open_output_stream(tmp.path) as f:
            f.write(data)
        self.fs.move(tmp.path, self.path)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def sha256(self) -> str:
        h = hashlib.sha256()
        with self.fs.open_input_stream(self.path) as f:
            hash_stream(f, h)
        return h.hexdigest()

    # --- directories, whole files ---

    def mkdir(self) -> None:
        self.fs.create_dir(self.path)

    def delete(self, missing_ok: bool = True) -> None:
        """Delete a file."""
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def move_dir(self, dest: Location) -> None:
        """Rename where the filesystem can; on object stores copy every object on the server side, then delete
        the originals (not atomic: a move cut short leaves both, and nothing is lost)."""
        if self.local is not None:
            self.fs.move(self.path, dest.path)
            return
        for name in self.files():
            self.fs.copy_file(f"{self.path}/{name}", f"{dest.path}/{name}")
        self.fs.delete_dir(self.path)

    def upload(self, src: Path) -> None:
        """Copy a local file here, whole."""
        if self.local is not None:
            self.fs.create_dir(self.parent.path)
        with src.open("rb") as f, self.fs.open_output_stream(self.path) as out:
            shutil.copyfileobj(f, out, 1 << 20)

    def download(self, dest: Path) -> str:
        """Copy this file to a local path; returns its sha256, computed on the way (no second read)."""
        h = hashlib.sha256()
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_input_stream(self.path) as f, dest.open("wb") as out:
            hash_stream(f, h, copy_to=out)
        return h.hexdigest()
