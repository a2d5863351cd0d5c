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
from typing import BinaryIO


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
    writes into, such as data.store_dir), every build of `final` holds a shared lock on `.<name>.lock` beside it,
    and a build that finds that lock free removes the build directories of `final` that killed processes left."""
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
    (flock), so it dies with its process however that process ends."""
    with open(final.parent / f".{final.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # a live build of `final`: its directory is not debris
        else:
            for leftover in final.parent.glob(f".{glob.escape(final.name)}{BUILD_MARK}*"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield


def scratch_file(prefix: str, suffix: str = "") -> Path:
    """A new local file for a remote file's working copy (metrics.jsonl is appended to locally, then uploaded)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(name)
