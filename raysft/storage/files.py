"""Local files written safely: a directory built beside its final name and renamed into place, a hash computed
as the bytes stream past, a scratch file for a remote file's working copy."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def built_then_renamed(final: Path, replace: Callable[[Path], bool] = lambda existing: True) -> Iterator[Path]:
    """A new directory beside `final` to build in, renamed onto `final` when the block completes: a crash never
    leaves a half-built directory under the final name. An existing `final` is removed first if `replace(final)`
    says so (else the rename fails with OSError). If the block or the rename fails, the new directory goes."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists() and replace(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def scratch_file(prefix: str, suffix: str = "") -> Path:
    """A new local file for a remote file's working copy (metrics.jsonl is appended to locally, then uploaded)."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(name)
