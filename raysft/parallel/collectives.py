"""The one-value collectives the training loop and the checkpointer agree through."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_ranks(flag: bool) -> bool:
    """Collective: whether `flag` holds on every rank."""
    value = torch.tensor([int(flag)], device=default_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def any_rank(flag: bool) -> bool:
    """Collective: whether `flag` holds on some rank."""
    return not all_ranks(not flag)


def count_ranks(flag: bool) -> int:
    """Collective: on how many ranks `flag` holds."""
    value = torch.tensor([int(flag)], device=default_device())
    dist.all_reduce(value)
    return int(value.item())


T = TypeVar("T")


def from_rank0(compute: Callable[[], T]) -> T:
    """Rank 0's `compute()` (only rank 0 runs it), the same on every rank: what one process looks up for all. A
    `compute` that can fail must return its failure, never raise: the other ranks would wait here for ever."""
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_of_ranks(value: T | None) -> T | None:
    """Collective: the first rank's value that is not None (None if every rank's is): one answer for all when each
    rank found its own (a problem in the files it checked, say)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return next((v for v in everyone if v is not None), None)
