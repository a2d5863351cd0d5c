"""The memory tier: the whole training state in host memory as often as every step, where a restarted worker group
finds it, with each rank's part also on another node, so that a fault costs the steps since the last snapshot
rather than those since the last stored checkpoint.

Each rank writes its own part of a step, `<memory_dir>/<run id>/<node>/step_<step>/rank_<rank>.safetensors`: its
shards of the weights and optimizer state as they are in memory (no gathering, no planner), and in the file's
header the trainer state (step, data cursor, schedule, step guard, loss scale), every rank's RNG state and the
layout the shards were cut for. The directory is node-local shared memory (/dev/shm by default): it outlives the
worker processes, and nobody's objects hold it, so no Ray object store and no actor is in the way. A file is
written under a temporary name and renamed, so a rank killed mid-snapshot leaves no file of that step; a step is
usable only when every rank's file of it is found, on some node.

The copy off the node: once its file is written, each rank sends it to its partner, the rank of the same place on
the next node, over a gloo group of the tier's own, in the tier's background thread (a bounded rate if set); the
partner keeps it beside its own. Files are sent from and received into their mapped pages, so a copy costs no
buffer of its size in the process; a node keeps 2 steps, the newest whole one and the one being written, the
others removed before the next is written (what `raysft plan` counts). Under HYBRID_SHARD a rank's replica on
another node holds the same shards, so no copy is sent: the replica's file stands in for it (only the RNG state
differs, and every file carries every rank's).

Resume (collective): every rank lists what its node holds (`newest_whole`); the newest step whose every part is
held somewhere wins if it is newer than the stored checkpoint; a rank whose part is on another node receives it
from a rank there (`fetch`: with no room for it, the stored checkpoint is used); each rank loads its part
(`restore`). Shards are cut by the layout, so a snapshot resumes on the same number of workers and the same
sharding only; otherwise, and when no step is whole, the stored checkpoint is used, and the log says why.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from raysft.checkpoint.memory_files import commit, map_file, map_new, read_header, temporary, write_part
from raysft.checkpoint.state import (
    TrainingObjects,
    TrainState,
    gather_rng_states,
    restore_trainer_state,
    trainer_state_dict,
)
from raysft.checkpoint.trainable import state_dict_options
from raysft.errors import CheckpointError
from raysft.parallel.collectives import default_device

FORMAT = 1
STEP_PREFIX = "step_"


def node_dir(memory_dir: str | Path, run_id: str, node: str) -> Path:
    """This node's snapshots of the run: one directory per run id (a run started over gets a new one), one per node
    inside it (nodes on one host, as in tests, keep theirs apart)."""
    return Path(memory_dir) / run_id / node


def remove_run(memory_dir: str | Path, run_id: str) -> None:
    """Every snapshot of the run on this host: at the end of a run, whatever ended it."""
    shutil.rmtree(Path(memory_dir) / run_id, ignore_errors=True)


@dataclass(frozen=True)
class Held:
    """A rank's part of a step, found in a node's directory."""

    step: int
    rank: int  # whose part it is
    holder: int  # the rank of the node that has the file
    replica: int  # the shard coordinate under HYBRID_SHARD (replicas share it), else the rank
    replicated: bool
    world_size: int
    layout: str  # the sharding the shards were cut for


class MemoryTier:
    """Snapshots of the training state in node-local memory (`snapshot`, every `every` steps) and the resume from
    them (`restore`). Collective where the methods say so; the constructor is (it makes the tier's gloo group and
    learns every rank's node)."""

    def __init__(self, objs: TrainingObjects, every: int, memory_dir: str, run_id: str, node: str, layout: str,
                 replica: int, replicated: bool, copy_mb_per_s: float = 0.0, log=None):
        self.objs, self.every, self.run_id, self.layout = objs, every, run_id, layout
        self.replica, self.replicated, self.copy_mb_per_s, self.log = replica, replicated, copy_mb_per_s, log
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dir = node_dir(memory_dir, run_id, node)
        self.group = dist.new_group(backend="gloo")  # apart from training's and the checkpoint writer's
        nodes: list = [None] * self.world_size
        dist.all_gather_object(nodes, node)
        self.nodes = nodes
        replicas: list = [None] * self.world_size
        dist.all_gather_object(replicas, replica)
        self.replicas = replicas  # each rank's shard coordinate: replicas (HYBRID_SHARD) share theirs
        self.send_to, self.recv_from = (None, None) if replicated else partners(nodes, self.rank)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysft-memory")
        self.pending: Future | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.failed: str | None = None  # why snapshots stopped (host memory short, say)
        self.whole: int | None = None  # the newest step whole on every node: kept while the next one is written

    # --- taking snapshots ---------------------------------------------------------------------------------------

    def snapshot(self, state: TrainState, held: list[tuple[float, dict, torch.Tensor]] = ()) -> bool:
        """Collective: take a snapshot of the state at `state.step` if one is due and the previous one is written on
        every rank (else this step's is passed over: the tier keeps up at the pace the host allows). The copy into
        host memory happens now; writing the file and sending the copy off the node happen in the background.

        `held`: the steps' metrics not yet reduced and logged (raysft.training.metrics.StepTotals rows), kept with
        the snapshot so that a resume from it logs them too."""
        if not self.every or state.step % self.every or self.failed:
            return False
        if not self._previous_written():
            return False
        tensors = self._stage()
        if held:
            tensors["metrics.values"] = torch.stack([values for _, _, values in held]).cpu()
        header = {"format": FORMAT, "run_id": self.run_id, "step": state.step, "rank": self.rank,
                  "world_size": self.world_size, "layout": self.layout, "replica": self.replica,
                  "replicated": self.replicated, "trainer_state": trainer_state_dict("memory", self.objs, state),
                  "metrics_rows": [[start, host] for start, host, _ in held]}
        rng = gather_rng_states()
        event = None
        if any(t.is_pinned() for t in tensors.values()):
            event = torch.cuda.Event()
            event.record()
        self.pending = self.writer.submit(self._write_and_copy, state.step, {**tensors, **_prefixed("rng.", rng)},
                                          header, event, self.whole)
        self.whole = state.step  # once written: every rank has agreed to write it, and the next one waits for it
        return True

    def _previous_written(self) -> bool:
        """Collective: whether the previous snapshot is written on every rank. If it failed on some rank (host
        memory short, say), the tier turns off on every rank at once, with one event naming the rank and the
        error: the stored checkpoints go on."""
        done = self.pending is None or self.pending.done()
        error = self.pending.exception() if self.pending is not None and done else None
        flags = torch.tensor([int(done), int(error is None)], device=default_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # training's group: the tier's is the writer thread's
        if flags[1]:
            return bool(flags[0])
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        self.failed = "; ".join(f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None)
        if self.log is not None:
            self.log.event("memory_tier_off", reason=self.failed,
                           hint="the stored checkpoints go on; check the free space of checkpoint.memory_dir")
        return False

    def _stage(self) -> dict[str, torch.Tensor]:
        """This rank's shards, copied into buffers kept from one snapshot to the next (pinned host memory for a GPU
        run: the device-to-host copy is queued on the stream and the step goes on)."""
        model_sd, optim_sd = get_state_dict(self.objs.model, self.objs.optimizer,
                                            options=state_dict_options(self.objs.model))
        staged = {}
        for name, value in _flatten(model_sd, optim_sd).items():
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self.buffers[name] = buffer
            buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            staged[name] = buffer
        return staged

    def _write_and_copy(self, step: int, tensors: dict[str, torch.Tensor], header: dict,
                        event: torch.cuda.Event | None, whole: int | None) -> None:
        if event is not None:
            event.synchronize()
        path, error = self._file(step, self.rank), None
        try:
            self.keep_only(whole, step)  # the newest whole step stays while this one is written: 2 at most
            write_part(path, tensors, header)
        except Exception as e:  # noqa: BLE001 - raised below; the partner still takes part in the exchange,
            path, error = None, e  # or its thread would wait for ours
        self._exchange(step, path)
        if error is not None:
            raise error

    def _file(self, step: int, rank: int) -> Path:
        return self.dir / f"{STEP_PREFIX}{step:08d}" / f"rank_{rank}.safetensors"

    def _exchange(self, step: int, path: Path | None) -> None:
        """Send this rank's file of `step` (None: it could not be written) to its partner on the next node, and keep
        the one of the rank whose partner this is, at copy_mb_per_s if set. Every rank runs the same exchange for
        the same step (the snapshots are agreed collectively), so the sends and receives pair up; a side that has
        nothing to send, or no room to receive, says so first, and the exchange ends on both sides without it."""
        if self.send_to is None:
            return
        data = map_file(path) if path is not None else torch.empty(0, dtype=torch.uint8)
        size, incoming = torch.tensor([data.numel() if path is not None else -1]), torch.zeros(1, dtype=torch.int64)
        _pair(size, self.send_to, incoming, self.recv_from, self.group)
        target, received, error = self._file(step, self.recv_from), None, None
        if incoming.item() >= 0:
            try:
                received = map_new(target, int(incoming.item()))
            except OSError as e:
                error = e
        accepted, partner_accepted = torch.tensor([int(received is not None)]), torch.zeros(1, dtype=torch.int64)
        _pair(accepted, self.recv_from, partner_accepted, self.send_to, self.group)  # the other way round
        data = data if partner_accepted.item() else data[:0]
        into = received if received is not None else torch.empty(0, dtype=torch.uint8)
        chunk = 64 << 20
        for start in range(0, max(data.numel(), into.numel()), chunk):
            began = time.monotonic()
            _pair(data[start:start + chunk], self.send_to, into[start:start + chunk], self.recv_from, self.group)
            if self.copy_mb_per_s:
                sent = min(chunk, max(0, data.numel() - start))
                time.sleep(max(0.0, sent / (self.copy_mb_per_s * 1e6) - (time.monotonic() - began)))
        if received is not None:
            del received, into
            commit(target)
        if error is not None:
            raise error

    def keep_only(self, *steps: int | None) -> None:
        """Remove this node's snapshots but those of `steps`. By step, not by what the directory lists: the ranks of
        a node share it, and another rank's step being written is no reason to remove the newest whole one."""
        keep = {f"{STEP_PREFIX}{step:08d}" for step in steps if step is not None}
        for old in self.dir.glob(f"{STEP_PREFIX}*"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def resumed(self, step: int | None) -> None:
        """After the resume's decision (every rank has listed what it holds): the node keeps the snapshot resumed
        from, if any, and nothing else. Snapshots newer than the step resumed from (those a fault left when the
        stored checkpoint was used) would otherwise stay, listed as newer than every snapshot to come."""
        self.keep_only(step)
        self.whole = step

    def finish(self) -> None:
        """Wait for the snapshot being written (its failure only turns the tier off: the stored tier goes on)."""
        if self.pending is not None:
            self.pending.exception()

    def close(self, remove: bool = False) -> None:
        """Collective: stop taking snapshots; with `remove`, every node's snapshots of the run go (once every rank
        is done with them)."""
        self.finish()
        self.writer.shutdown()
        if remove:
            dist.barrier(self.group)
            shutil.rmtree(self.dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.dir.parent.rmdir()  # the run's directory, once its last node is gone from it

    # --- resuming ------------------------------------------------------------------------------------------------

    def newest_whole(self) -> tuple[int | None, str, dict[int, Held]]:
        """Collective: the newest step every rank's part of which is held on some node, with where each part is;
        or None and why not. The same on every rank."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, self._held())
        parts: dict[int, dict[int, list[Held]]] = {}
        for found in everyone:
            for held in found:
                parts.setdefault(held.step, {}).setdefault(held.rank, []).append(held)
        why = "no snapshot in memory"
        for step in sorted(parts, reverse=True):
            chosen, why = self._sources(step, parts[step])
            if chosen is not None:
                return step, "", chosen
        return None, why, {}

    def _held(self) -> list[Held]:
        """What this rank's node holds of the run (every rank of a node lists the same; that is harmless)."""
        found = []
        for path in sorted(self.dir.glob(f"{STEP_PREFIX}*/rank_*.safetensors")):
            header = read_header(path)
            if header is None or header.get("run_id") != self.run_id or header.get("format") != FORMAT:
                continue
            found.append(Held(header["step"], header["rank"], self.rank, header["replica"], header["replicated"],
                              header["world_size"], header["layout"]))
        return found

    def _sources(self, step: int, parts: dict[int, list[Held]]) -> tuple[dict[int, Held] | None, str]:
        """For each rank of this launch, the part it loads and who holds it (itself if its node has it), or why the
        step cannot be used."""
        any_part = next(iter(parts.values()))[0]
        if any_part.world_size != self.world_size or any_part.layout != self.layout:
            return None, (f"the snapshot of step {step} was cut for {any_part.world_size} workers ({any_part.layout}),"
                          f" this launch has {self.world_size} ({self.layout}): a snapshot resumes only on the "
                          "layout it was taken on")
        chosen = {}
        for rank in range(self.world_size):
            candidates = parts.get(rank, [])
            if any_part.replicated:  # a replica's part holds the same shards
                candidates = [h for hs in parts.values() for h in hs if h.replica == self.replicas[rank]]
            if not candidates:
                return None, f"no node holds rank {rank}'s part of step {step} (nor a copy of it)"
            local = [h for h in candidates if self.nodes[h.holder] == self.nodes[rank]]
            chosen[rank] = (local or sorted(candidates, key=lambda h: h.holder))[0]
        return chosen, ""

    def fetch(self, step: int, sources: dict[int, Held]) -> str:
        """Collective: every part held only on another node than its rank's is sent to that rank (and kept on its
        node, for a fault to come). Returns "" once every rank has its part at hand, else why not, the same on
        every rank (a rank with no room left for its part, say): the stored checkpoint is used then."""
        moves = [(rank, held) for rank, held in sorted(sources.items()) if self.nodes[held.holder] != self.nodes[rank]]
        outgoing = [(rank, map_file(self._file(step, held.rank))) for rank, held in moves if held.holder == self.rank]
        source = next((held.holder for rank, held in moves if rank == self.rank), None)
        size = torch.zeros(1, dtype=torch.int64)
        _run([*(dist.P2POp(dist.isend, torch.tensor([d.numel()]), r, self.group) for r, d in outgoing),
              *([dist.P2POp(dist.irecv, size, source, self.group)] if source is not None else [])])
        path, incoming, error = self._file(step, self.rank), None, None
        if source is not None:
            try:
                incoming = map_new(path, int(size))
            except OSError as e:
                error = f"rank {self.rank} has no room for its part of step {step}: {type(e).__name__}: {e}"
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        if any(errors):
            del incoming
            temporary(path).unlink(missing_ok=True)
            return "; ".join(e for e in errors if e)
        _run([*(dist.P2POp(dist.isend, d, r, self.group) for r, d in outgoing),
              *([dist.P2POp(dist.irecv, incoming, source, self.group)] if source is not None else [])])
        del incoming, outgoing
        dist.barrier(self.group)
        if source is not None:
            commit(path)
        return ""

    def restore(self, step: int, sources: dict[int, Held]) -> tuple[TrainState, list]:
        """Collective: load the snapshot of `step` (every part at hand: `fetch`), each rank its own part. Returns
        the state to go on from and the metrics rows held with it."""
        held_here = self.nodes[sources[self.rank].holder] == self.nodes[self.rank]
        path = self._file(step, sources[self.rank].rank if held_here else self.rank)
        header, tensors = read_header(path), load_file(path)
        model_sd, optim_sd = get_state_dict(self.objs.model, self.objs.optimizer,
                                            options=state_dict_options(self.objs.model))
        for name, target in _flatten(model_sd, optim_sd).items():
            local = target.to_local() if isinstance(target, DTensor) else target
            if name not in tensors or tensors[name].shape != local.shape:
                raise CheckpointError(f"{path}: {name} does not fit this rank's shard of the model: a snapshot of "
                                      "another model; launch again with --fresh")
            local.detach().copy_(tensors[name])
        set_state_dict(self.objs.model, self.objs.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=state_dict_options(self.objs.model))
        rng = {k.removeprefix("rng."): v for k, v in tensors.items() if k.startswith("rng.")}
        torch.set_rng_state(rng[f"cpu.{self.rank}"])
        if f"cuda.{self.rank}" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng[f"cuda.{self.rank}"])
        values = tensors.get("metrics.values")
        held = [(start, host, values[i]) for i, (start, host) in enumerate(header["metrics_rows"])]
        return restore_trainer_state(header["trainer_state"], self.objs), held


def partners(nodes: list[str], rank: int) -> tuple[int | None, int | None]:
    """(the rank this one sends its part to, the rank it receives a part from): the rank of the same place on the
    next node, and on the previous one, nodes in the order of their first rank; (None, None) on one node."""
    order = list(dict.fromkeys(nodes))
    if len(order) == 1:
        return None, None
    ranks_of = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    mine = ranks_of[nodes[rank]]
    place = mine.index(rank)
    position = order.index(nodes[rank])
    nxt, prev = ranks_of[order[(position + 1) % len(order)]], ranks_of[order[position - 1]]
    return nxt[place % len(nxt)], prev[place % len(prev)]


def _pair(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int, group: dist.ProcessGroup) -> None:
    """Send and receive at once (each rank does both: blocking sends would wait for each other in a ring)."""
    _run([*([dist.P2POp(dist.isend, send.contiguous(), to, group)] if send.numel() else []),
          *([dist.P2POp(dist.irecv, recv, frm, group)] if recv.numel() else [])])


def _run(ops: list[dist.P2POp]) -> None:
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _flatten(model_sd: dict, optim_sd: dict) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd.get("state", {}).items():
        flat.update({f"optim.{fqn}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return flat


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}
