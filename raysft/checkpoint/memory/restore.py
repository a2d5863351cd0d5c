"""A rank's side of a resume from memory, once discovery (raysft.checkpoint.memory.discovery) has said which parts it
reads and they are on its node: read and check them (`read`), then apply them (`apply`).

Reading is kept apart from applying so that a snapshot is applied only once every rank's read has passed: a part
that does not fit the model, holds NaN or inf, or misses its RNG state sets the whole snapshot aside, and the model
is still as it was, for the stored checkpoint to load.

On the same number of workers each rank gets back its own RNG state and metrics rows (every part carries every
rank's); on another, as after a stored checkpoint's resume on another world size, the RNG streams keep their fresh
seeding (they have no counterpart). The metrics rows every old rank held are handed back as the snapshot carries
them (HeldRows): the training loop regroups them over its ranks (raysft.training.metrics.StepTotals.hold), so the rows
of the steps before the snapshot are logged as they would have been.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import DTensor

from raysft.checkpoint.memory.discovery import Plan
from raysft.checkpoint.memory.files import (
    checksum_problem,
    finite_problem,
    flatten,
    header_problem,
    read_header,
    state_dicts,
)
from raysft.checkpoint.memory.reshard import assemble
from raysft.checkpoint.state import TrainingObjects, TrainState, restore_trainer_state
from raysft.checkpoint.trainable import state_dict_options


@dataclass
class HeldRows:
    """The metrics rows every old rank held, not yet reduced and logged, as a snapshot carries them: [start, host]
    per rank and step, and the device values per rank and step; `same_world` whether the ranks are the same."""

    rows: list[list]
    values: list[list[list[float]]]
    same_world: bool


@dataclass
class Found:
    """A snapshot this rank has read and checked, ready to `apply` once every rank's has passed."""

    step: int
    same_world: bool
    header: dict  # a part's: the trainer state, and every rank's metrics rows
    tensors: dict[str, torch.Tensor]  # this rank's shards by state-dict name, and its RNG states ("rng.<kind>.<rank>")


def read(plan: Plan, rank: int, world_size: int, paths: dict[int, Path], state: dict[str, torch.Tensor],
         new_places: int, place: int) -> tuple[Found | None, str | None]:
    """This rank's shards of the snapshot from its parts (`paths`: old place -> file on this node), checked against
    its state dict `state` (names, shapes, dtypes), for NaN and inf and, on the same world size, for its RNG state;
    or None and why not."""
    first = paths[min(paths)]
    header = read_header(first)
    problem = "not a whole snapshot file" if header is None else header_problem(header, first)
    if problem:
        return None, f"{first}: {problem}"
    for path in sorted(set(paths.values())):  # every byte as it was written, before any is used
        own = header if path == first else read_header(path)
        problem = "not a whole snapshot file" if own is None else header_problem(own, path) or \
            checksum_problem(path, own)
        if problem:
            return None, f"{path}: {problem}"
    same_world = plan.old_world == world_size
    if plan.same_cut:
        tensors = load_file(first)
        problem = _fit_problem(tensors, state)
    else:
        tensors, problem = assemble(state, paths, plan.old_places, new_places, place)
        if tensors is not None and same_world:
            with safe_open(first, framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("rng.")})  # noqa: SIM118
    if problem is None and same_world and f"rng.cpu.{rank}" not in tensors:
        problem = f"no RNG state of rank {rank}"
    problem = problem or finite_problem(tensors)
    return (None, f"{first}: {problem}") if problem else (Found(plan.step, same_world, header, tensors), None)


def apply(objs: TrainingObjects, found: Found, rank: int) -> tuple[TrainState, HeldRows]:
    """Collective: copy the shards into the model and optimizer, and the RNG states back (same world size). Returns
    the state to go on from and the metrics rows held with the snapshot."""
    model_sd, optim_sd = state_dicts(objs)
    for name, target in flatten(model_sd, optim_sd).items():
        local = target.to_local() if isinstance(target, DTensor) else target
        local.detach().copy_(found.tensors[name])
    set_state_dict(objs.model, objs.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=state_dict_options(objs.model))
    if found.same_world:
        torch.set_rng_state(found.tensors[f"rng.cpu.{rank}"])
        if f"rng.cuda.{rank}" in found.tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(found.tensors[f"rng.cuda.{rank}"])
    header = found.header
    held = HeldRows(header["metrics_rows"], header["metrics_values"], found.same_world)
    return restore_trainer_state(header["trainer_state"], objs), held


def _fit_problem(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str | None:
    """Why a part's tensors are not this rank's shards of the model (another model, or another cut)."""
    expected = {name: v.to_local() if isinstance(v, DTensor) else v for name, v in state.items()}
    stored = {k for k in tensors if not k.startswith("rng.")}
    if stored != set(expected):
        extra, missing = sorted(stored - set(expected)), sorted(set(expected) - stored)
        return f"its tensors are not this model's: {'missing ' + missing[0] if missing else 'unknown ' + extra[0]}"
    for name, t in expected.items():
        if tensors[name].shape != t.shape or tensors[name].dtype != t.dtype:
            return (f"{name} is {tuple(tensors[name].shape)} {tensors[name].dtype}, this rank's shard is "
                    f"{tuple(t.shape)} {t.dtype}")
    return None
