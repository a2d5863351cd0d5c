"""The one background writer thread, and futures for writes that already happened: every save, synchronous or
not, hands back a Future so that `PendingSave.finish` deals with failures the same way on every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist


@functools.cache
def background() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysft-checkpoint")


@functools.cache
def checkpoint_group() -> dist.ProcessGroup:
    """Collective on first use: a gloo group for background checkpoint traffic, apart from training's."""
    return dist.new_group(backend="gloo")


def chain(first: list[Future], then: Callable) -> Future:
    """A future of `then()`, run in the background writer once every one of `first` succeeded (else its error)."""
    def run():
        for future in first:
            future.result()
        return then()

    return background().submit(run)


def run_now(write: Callable) -> Future:
    """Run a synchronous write, keeping its error in the future: `PendingSave.finish` raises it on every rank
    (raised here, it would leave the other ranks waiting in the next collective)."""
    future: Future = Future()
    try:
        future.set_result(write())
    except Exception as e:  # noqa: BLE001 - delivered by finish()
        future.set_exception(e)
    return future
