"""Local files written safely: a directory built beside its final name and renamed into place, a hash computed
as the bytes stream past, a scratch file for a remote file's working copy."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, BinaryIO


def hash_stream(stream: BinaryIO, h: hashlib._Hash, copy_to: BinaryIO | None = None) -> None:
    """Feed a readable stream into a hash in 1 MiB chunks, copying each to copy_to on the way if given."""
    while chunk := stream.read(1 << 20):
        h.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)


BUILD_MARK = ".raysft-build-"  # in the name of every build directory: what `reclaim` may remove, and nothing else


@contextlib.contextmanager
def built_then_renamed(final: Path, replace: Callable[[Path], bool] = lambda existing: True,
                       reclaim: bool = False) -> Iterator[Path]:
    """A new directory beside `final` to build in, renamed onto `final` when the block completes: a crash never
    leaves a half-built directory under the final name. An existing `final` is removed first if `replace(final)`
    says so (else the rename fails with OSError). If the block or the rename fails, the new directory goes.

    A process killed outright (SIGKILL, OOM) leaves its build directory. With `reclaim` (for a directory only raysft
    writes into, such as data.store_dir), every build of `final` holds a shared lock on `.<name>.lock` beside it
    (removed by the last build to finish), and a build that finds that lock free removes the build directories of
    `final` that killed processes left."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with _builds_of(final) if reclaim else contextlib.nullcontext():
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{BUILD_MARK}", dir=final.parent))
        try:
            yield tmp
            if final.exists() and replace(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextlib.contextmanager
def _builds_of(final: Path) -> Iterator[None]:
    """Held shared while this process builds `final`. Taken exclusively first, when no live process builds
    `final`: then every build directory of `final` there is a dead one's, and goes. The lock is the kernel's
    (flock), so it dies with its process however that process ends; the last build to finish removes its file."""
    path = final.parent / f".{final.name}.lock"
    with _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as alone:
        if alone is not None:
            for leftover in final.parent.glob(f".{glob.escape(final.name)}{BUILD_MARK}*"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
    with _locked(path, fcntl.LOCK_SH) as lock:
        try:
            yield
        finally:
            _remove_if_unused(lock, path)


@contextlib.contextmanager
def _locked(path: Path, operation: int) -> Iterator[IO | None]:
    """The file at `path`, created if need be, flock-ed with `operation` (None: LOCK_NB and another process holds
    it). A file its last holder removed while this one waited is not the lock any more: then the new one is taken."""
    while True:
        f = open(path, "a")  # closed below, or by the with block
        try:
            fcntl.flock(f, operation)
        except BlockingIOError:
            f.close()
            yield None
            return
        if _is_at(f, path):
            break
        f.close()
    with f:
        yield f


def _remove_if_unused(lock: IO, path: Path) -> None:
    """Remove the lock file once no other build holds it: under an exclusive lock, so no build holds or takes it
    while it goes (one that opened it meanwhile finds it gone and takes a new one)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another build of `final` holds it, and removes it when it is done
    if _is_at(lock, path):
        path.unlink()


def _is_at(f: IO, path: Path) -> bool:
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)


def scratch_file(prefix: str, suffix: str = "") -> Path:
    """A new local file for a remote file's working copy (metrics.jsonl is appended to locally, then uploaded)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(name)
