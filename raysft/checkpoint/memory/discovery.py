"""Which snapshot a resume can use, and which file each rank reads: from what every node holds, without a byte of
the tensors read.

A part is one rank's shards, so it stands for its place in the shard group (replicas under HYBRID_SHARD and
NO_SHARD share a place and hold the same shards). A step is whole when one launch attempt left a part of every old
place on some node: parts of two attempts (two timelines of the run) are never combined. On the same cut (the same
shard-group size) each rank reads the part of its own place; on another (a node lost for good, or one that
returned) it reads the rows it needs from the parts whose rows overlap its own (raysft.checkpoint.memory.reshard).
A part on the rank's own node is preferred to one that must be sent.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raysft.checkpoint.memory.directory import STEP_PREFIX
from raysft.checkpoint.memory.files import header_problem, read_header
from raysft.checkpoint.memory.reshard import needed_places
from raysft.distributed.layout import ParallelDims


@dataclass(frozen=True)
class Held:
    """A part of a step, found in a node's directory."""

    step: int
    rank: int  # whose part it is
    holder: int  # a rank of the node that has the file
    path: str  # the file, on the holder's node
    attempt: str  # the launch attempt that wrote it
    place: int  # its rank's place in its shard group: replicas share it
    world_size: int
    cut: dict = field(hash=False)  # the parallel layout it was cut for: sharding and ParallelDims' sizes


@dataclass
class Plan:
    """The snapshot a resume reads: for each rank of this launch, the part of each old place it reads."""

    step: int
    old_world: int  # the workers it was taken on: the RNG states and metrics rows are each rank's on the same only
    old_places: int  # its shard-group size
    same_cut: bool  # each rank reads one part whole (the same shard-group size), else rows of several
    sources: dict[int, dict[int, Held]]  # rank -> old place -> the part


def list_parts(node_dir: Path, run_id: str, holder: int) -> tuple[list[Held], list[tuple[str, str]]]:
    """The parts of the run a node holds (listed by its rank `holder`), and each file that is no usable part, with
    why (a file cut off, a header that does not check out, another run's)."""
    found, ignored = [], []
    for path in sorted(node_dir.glob(f"{STEP_PREFIX}*/rank_*.safetensors")):
        header = read_header(path)
        problem = "not a whole snapshot file" if header is None else header_problem(header, path)
        if problem is None and header["run_id"] != run_id:
            problem = f"a part of run {header['run_id']}, not of this run ({run_id})"
        if problem is not None:
            ignored.append((str(path), problem))
            continue
        found.append(Held(header["step"], header["rank"], holder, str(path), header["attempt"], header["replica"],
                          header["world_size"], header["layout"]))
    return found, ignored


def one_per_file(parts: list[Held], nodes: Sequence[Hashable]) -> list[Held]:
    """Each file once, listed by the lowest rank of its node: the ranks of a node all list its directory, and a
    file set aside must not come back as another rank's (read again, or sent again, in vain)."""
    first: dict[tuple, Held] = {}
    for held in sorted(parts, key=lambda h: h.holder):
        first.setdefault((nodes[held.holder], held.path), held)
    return list(first.values())


def plan_resume(parts: list[Held], dims: ParallelDims, cut: dict,
                targets: dict[str, torch.Tensor]) -> tuple[Plan | None, str]:
    """The newest step one attempt left whole (this launch's `dims`, every rank's node among them, and `cut`, its
    state dict's `targets` for their global shapes), and what each rank reads of it; or None and why not (the
    newest step's reason). The same on every rank, given the same parts."""
    steps: dict[tuple[int, str], dict[int, list[Held]]] = {}
    for h in parts:
        steps.setdefault((h.step, h.attempt), {}).setdefault(h.place, []).append(h)
    why = None
    for (step, attempt) in sorted(steps, reverse=True):  # newest step first; of one step, the newest attempt first
        plan, problem = _plan_step(step, attempt, steps[(step, attempt)], dims, cut, targets)
        if plan is not None:
            return plan, ""
        why = why or problem
    return None, why or "no snapshot in memory"


def _plan_step(step: int, attempt: str, by_place: dict[int, list[Held]], dims: ParallelDims, cut: dict,
               targets: dict[str, torch.Tensor]) -> tuple[Plan | None, str]:
    held = [h for hs in by_place.values() for h in hs]
    cuts = {(h.world_size, json.dumps(h.cut, sort_keys=True)) for h in held}
    if len(cuts) > 1:
        return None, f"the parts of step {step} from launch attempt {attempt} were cut for different layouts"
    old = held[0]
    old_places = old.cut.get("shard", 0) * old.cut.get("sequence", 0)
    missing = [p for p in range(old_places) if p not in by_place]
    if old_places < 1 or missing:
        what = (f"rank {missing[0]}'s part of step {step} (nor a copy of it)" if old_places == old.world_size else
                f"the shards of place {missing[0] if missing else 0} of {old_places} of step {step} (no part of a "
                f"rank there, nor of a replica, nor a copy)")
        return None, f"no node holds {what} from launch attempt {attempt}"
    new_places = dims.shard_group_size
    same_cut = old_places == new_places
    sources = {}
    for rank in range(dims.world_size):
        place = dims.shard_place(rank)
        try:
            need = {place} if same_cut else needed_places(targets, old_places, new_places, place)
        except ValueError as e:
            return None, (f"the snapshot of step {step}, cut for {old.world_size} workers ({describe(old.cut)}), "
                          f"cannot be resharded for this launch's {dims.world_size} ({describe(cut)}): {e}")
        sources[rank] = {p: _nearest(by_place[p], dims.nodes, rank) for p in sorted(need)}
    return Plan(step, old.world_size, old_places, same_cut, sources), ""


def _nearest(candidates: list[Held], nodes: Sequence[Hashable], rank: int) -> Held:
    """A part on the rank's own node if there is one, else the one of the lowest holder."""
    local = [h for h in candidates if nodes[h.holder] == nodes[rank]]
    return (local or sorted(candidates, key=lambda h: (h.holder, h.rank)))[0]


def describe(cut: dict) -> str:
    return f"{cut.get('sharding')}, replicate {cut.get('replicate')} x shard {cut.get('shard')} x " \
           f"sequence {cut.get('sequence')}"
