"""The process group's backend, and the one-value collectives the training loop and the checkpointer agree
through."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist


def process_group_backend(device_type: str, cpu_offload: bool) -> str:
    """The backend both launchers give init_process_group: NCCL on GPUs, gloo on the CPU. With parallel.cpu_offload
    on a GPU, the gradients FSDP offloads and their norms are CPU tensors whose collectives NCCL cannot run, so the
    group maps each device to its own backend (torch dispatches a collective by its tensors' device), as
    torchtitan does for offloading; Ray's TorchConfig takes the same string."""
    if device_type == "cpu":
        return "cpu:gloo" if cpu_offload else "gloo"
    return f"{device_type}:nccl,cpu:gloo" if cpu_offload else "nccl"


def uses_nccl() -> bool:
    """Whether the default group runs NCCL, alone or beside gloo ("cuda:nccl,cpu:gloo")."""
    return any(part.rpartition(":")[2] == "nccl" for part in str(dist.get_backend()).split(","))


def default_device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl() else torch.device("cpu")


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
