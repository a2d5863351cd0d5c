"""The memory tier's object on each worker: snapshots as often as every step (`snapshot`), and the resume from the
newest whole one (`find`, then `restore`).

A snapshot: every rank's part of one step, `<memory_dir>/<run id>/<node>/step_<step>/rank_<rank>.safetensors`,
holding its shards of the weights and optimizer state as they are in memory (no gathering, no planner) and, in its
header, the trainer state, every rank's RNG state and metrics not yet logged, the layout the shards were cut for
and the launch attempt that wrote it. The step starts the copy into the staging buffer (.staging) and goes on; the
tier's thread writes the file (.files), sends it to another node (.transport) and keeps the node's newest whole
step beside the one being written (.directory).

Resume (collective): every rank lists what its node holds; the newest step of which one launch attempt left every
rank's part somewhere, cut for this launch's layout, wins if it is newer than the stored checkpoint; parts on
other nodes are sent to their ranks; each rank loads and checks its part (it fits the model, holds no NaN or
inf, its trainer state is sound), and only if every rank's does is it applied. A part that fails, or cannot be
sent, is set aside and the step tried with another copy, then the step before; when none is left, the stored
checkpoint is used, with the reasons in the log (`memory_snapshot_set_aside`, `memory_tier_not_used`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raysft.checkpoint.memory.directory import (
    HEARTBEAT_S,
    LIVE_FILE,
    arrive,
    check_memory_dir,
    directory_lock,
    forget_nodes,
    keep_only,
    make_private_dirs,
    resolve_memory_dir,
    room_problem,
    step_dir,
)
from raysft.checkpoint.memory.discovery import Held, Plan, list_parts, one_per_file, plan_resume
from raysft.checkpoint.memory.files import FORMAT, flatten, state_dicts, write_part
from raysft.checkpoint.memory.restore import Found, HeldRows, apply, read
from raysft.checkpoint.memory.staging import Stager
from raysft.checkpoint.memory.transport import Transport, partners
from raysft.checkpoint.state import TrainingObjects, TrainState, trainer_state_dict
from raysft.config import CheckpointConfig
from raysft.distributed.collectives import from_rank0
from raysft.distributed.layout import ParallelDims

MAX_HELD_ROWS = 8192  # metrics rows over every rank in a part's header (about 600 bytes each)


class MemoryTier:
    """Snapshots of the training state in node-local memory, and the resume from them. The constructor is collective
    (the tier's groups, the directory's checks); so are the methods that say so."""

    def __init__(self, objs: TrainingObjects, c: CheckpointConfig, run_id: str, dims: ParallelDims,
                 sharding: str, device: torch.device, log, set_aside: tuple[str, ...] = ()):
        self.objs, self.every, self.run_id, self.log = objs, c.memory_every_n_steps, run_id, log
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims, self.nodes = dims, dims.nodes  # this launch's layout, which a resume cuts a snapshot for
        self.cut = {"sharding": sharding, "replicate": dims.replicate, "shard": dims.shard, "sequence": dims.sequence}
        self.attempt = from_rank0(lambda: f"{time.time_ns():016x}{secrets.token_hex(4)}")  # sorts by time
        # a rank's replica on another node holds its shards: no copy is sent when every rank has one
        self.transport = Transport(self.nodes, self.rank, c.memory_timeout_s, c.memory_copy_mb_per_s,
                                   send_copies=not dims.replicated)
        # the files a step leaves on this node: each of its ranks' parts and the copies each receives (fixed for
        # the launch, so counted once, off the step path)
        self.node_files = sum(1 + (len(partners(self.nodes, r)[1]) if self.transport.send_to is not None else 0)
                              for r in range(self.world_size) if self.nodes[r] == self.nodes[self.rank])
        # the step path's agreements and the tier's gathers, without a wait for the device, each bounded
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=c.memory_timeout_s))
        self.stager = Stager(device)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysft-memory")
        self.pending: Future | None = None
        self.allocation: Future | None = None  # the staging buffer's, in the tier's thread
        self.whole: int | None = None  # the newest step whole on every node: kept while the next one is written
        self.taken = self.skipped = 0
        self.skip_reasons: set[str] = set()
        self.off: str | None = None  # why the tier is off (its directory refused, host memory short, ...)
        self.dir, self.live_fd = Path(), None
        problem = None
        try:
            root = resolve_memory_dir(c.memory_dir)
            problem = check_memory_dir(root)
            if problem is None:
                self.dir, self.live_fd = arrive(root, run_id, str(self.nodes[self.rank]), set_aside)
        except (OSError, TimeoutError) as e:
            problem = f"checkpoint.memory_dir: {type(e).__name__}: {e}"
        self.heartbeat = threading.Event()  # set at close
        if self.live_fd is not None:
            threading.Thread(target=self._beat, daemon=True, name="raysft-memory-heartbeat").start()
        problems = self._gather(problem)
        if any(problems):
            self._turn_off(problems, "no snapshot is written there; the stored checkpoints go on. Give "
                                     "checkpoint.memory_dir a directory of this user's own, or leave it empty "
                                     "(/dev/shm/raysft-<uid>)")
        if torch.cuda.is_available() and device.type == "cuda":
            objs.optimizer.register_step_pre_hook(lambda *_: self.stager.before_update())

    def _beat(self) -> None:
        """The run is alive on this node: its `.live` file touched every HEARTBEAT_S, however rare its snapshots, so
        that a launch of another run never reclaims it while Ray restarts its workers (raysft...directory.reclaim
        spares a run that wrote within RECLAIM_GRACE_S)."""
        live = self.dir.parent / LIVE_FILE
        while not self.heartbeat.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(live)

    # --- taking snapshots ---------------------------------------------------------------------------------------

    def snapshot(self, state: TrainState, held: list[tuple[float, dict, torch.Tensor]] = ()) -> bool:
        """Collective: take a snapshot of the state at `state.step` if one is due and the previous one is written on
        every rank; else it is passed over (counted, `skipped`), and the tier keeps up at the pace the host allows.
        The step only starts the copy into host memory; the rest happens in the tier's thread.

        `held`: the steps' metrics not yet reduced and logged (raysft.training.metrics.StepTotals rows), kept with
        the snapshot so that a resume from it logs them too."""
        if not self.every or self.off:
            return False
        if state.step % self.every:
            if self.pending is None and self.objs.optimizer.state:  # the same steps on every rank
                self._allocate(self._tensors())  # ahead of the first snapshot: its buffer is ready when it is due
            return False
        tensors = self._tensors()
        if not self._ready(tensors, state.step):
            return False
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and self.stager.cuda:
            rng["cuda"] = torch.cuda.get_rng_state()
        values = self.stager.small(torch.stack([v for _, _, v in held])) if held else None
        self.stager.copy(tensors)
        header = {"format": FORMAT, "run_id": self.run_id, "attempt": self.attempt, "step": state.step,
                  "rank": self.rank, "world_size": self.world_size, "layout": self.cut,
                  "replica": self.dims.shard_place(self.rank), "replicated": self.dims.replicated,
                  "trainer_state": trainer_state_dict("memory", self.objs, state),
                  "metrics_rows": [[start, host] for start, host, _ in held]}  # every rank's, once gathered
        self.pending = self.writer.submit(self._write_and_copy, state.step, header, rng, values, self.whole)
        self.whole = state.step  # once written: every rank has agreed to write it, and the next one waits for it
        self.taken += 1
        return True

    def holds_too_many(self, step: int, held: int) -> bool:
        """Whether the `held` metrics rows of each rank are too many to go with the snapshot due at `step` (every
        part carries every rank's: world size x held rows). safetensors refuses a header over 100 MB, so past
        MAX_HELD_ROWS the trainer logs them before the snapshot, and it carries none."""
        return bool(self.every) and not self.off and step % self.every == 0 and held * self.world_size > MAX_HELD_ROWS

    def prepare(self) -> None:
        """After a resume (from either tier): start allocating the staging buffer for the state just restored, in the
        tier's thread, so that the snapshot of the first step after it is taken rather than passed over while its
        buffer is made (a second fault there would otherwise cost that step too). A fresh start has no optimizer
        state before its first step: its first snapshot still waits for the buffer."""
        if self.every and not self.off and self.pending is None and self.objs.optimizer.state:
            self._allocate(self._tensors())

    def _tensors(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the weights and optimizer state, by name, as they are in memory."""
        return {name: v.to_local() if isinstance(v, DTensor) else v
                for name, v in flatten(*state_dicts(self.objs)).items()}

    def _idle(self) -> bool:
        return self.pending is None or self.pending.done()

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}
        self.pending = self.allocation = self.writer.submit(self.stager.allocate, shapes)

    def _ready(self, tensors: dict[str, torch.Tensor], step: int) -> bool:
        """Collective: whether every rank has written its previous snapshot and has a staging buffer for this one.
        If a previous one failed on some rank (host memory short, a partner that never answered), the tier turns
        off on every rank at once, with one event naming the rank and the error: the stored checkpoints go on."""
        idle = self._idle()
        error = self.pending.exception() if self.pending is not None and idle else None
        fits = self.stager.fits(tensors)
        if idle and error is None and not fits:
            self._allocate(tensors)
        # 0: ready; 1: the previous snapshot still being written; 2: the staging buffer being allocated;
        # 3: too little room in checkpoint.memory_dir for this step's files on this node
        waiting = 0 if idle and fits else 2 if not fits or not self.allocation.done() else 1
        short = None
        if not waiting and error is None:  # each rank's part and the copies its node's ranks receive
            part = sum(t.numel() * t.element_size() for t in tensors.values())
            short = room_problem(self.dir, str(self.nodes[self.rank]), self.node_files, self.node_files * part)
        flags = torch.tensor([int(error is not None), 3 if short and not waiting else waiting])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        if flags[0]:
            self._turn_off(self._gather(None if error is None else f"{type(error).__name__}: {error}"),
                           "the stored checkpoints go on; check the free space of checkpoint.memory_dir")
            return False
        if not flags[1]:
            return True
        detail = None
        if flags[1] == 3:  # which nodes are short, and by how much: the same words on every rank
            out: list = [None] * self.world_size
            dist.all_gather_object(out, short, group=self.control)
            detail = "; ".join(dict.fromkeys(x for x in out if x))
        reason = {1: "the previous snapshot is still being written",
                  2: "the staging buffer is being allocated (for the first snapshot, or for a state of new shapes)",
                  3: "too little free space in checkpoint.memory_dir for a step's parts (with the newest whole step "
                     "kept); snapshots go on once there is room"}[int(flags[1])]
        self.skipped += 1
        if reason not in self.skip_reasons and self.log is not None:  # each reason once; every skip is counted
            self.log.event("memory_snapshot_skipped", step=step, reason=reason,
                           **({"free": detail} if detail else {}),
                           hint="counted in each step's memory_snapshots_skipped; a snapshot every "
                                "checkpoint.memory_every_n_steps that the host can write in time is never skipped")
        self.skip_reasons.add(reason)
        return False

    def _write_and_copy(self, step: int, header: dict, rng: dict[str, torch.Tensor], values: torch.Tensor | None,
                        whole: int | None) -> None:
        """In the tier's thread: wait for the copy, gather every rank's RNG state and metrics held (a replica's part
        stands in for a lost rank's, so each part carries every rank's), write the part, send it off the node."""
        self.stager.landed()
        extra = {}
        for kind, state in rng.items():
            extra.update({f"rng.{kind}.{r}": t for r, t in enumerate(self.transport.all_gather(state))})
        header["metrics_rows"] = self.transport.all_gather_object(header["metrics_rows"])
        header["metrics_values"] = [t.tolist() for t in self.transport.all_gather(values)] if values is not None \
            else [[] for _ in range(self.world_size)]
        path, error = self._file(step, self.rank), None
        try:
            keep_only(self.dir, {s for s in (whole, step) if s is not None})  # 2 steps at most on the node
            make_private_dirs(path.parent)
            write_part(path, self.stager.buffer, self.stager.slots, extra, header)
            os.utime(self.dir.parent / LIVE_FILE)  # the run is alive on this node (raysft...directory.reclaim)
        except Exception as e:  # noqa: BLE001 - raised below; the partner still takes part in the exchange,
            path, error = None, e  # or its thread would wait for ours
        self.transport.exchange(path, lambda rank: self._new_file(step, rank))
        if error is not None:
            raise error

    def _file(self, step: int, rank: int) -> Path:
        return step_dir(self.dir, step) / f"rank_{rank}.safetensors"

    def _new_file(self, step: int, rank: int) -> Path:
        """Where a part received from another node goes, its step's directory made (0700)."""
        make_private_dirs(step_dir(self.dir, step))
        return self._file(step, rank)

    def _turn_off(self, problems: list, hint: str) -> None:
        """Off on every rank: no snapshot is taken or resumed from, and what the tier holds is freed at once (its
        staging buffer, this node's snapshots: a full /dev/shm must not stay full until the run ends)."""
        self.off = "; ".join(f"rank {r} ({self.nodes[r]}): {p}" for r, p in enumerate(problems) if p)
        if self.log is not None:
            self.log.event("memory_tier_off", reason=self.off, hint=hint)
        if self.live_fd is not None:  # (a directory refused is never touched)
            self.finish()  # this rank's writer done (each of its waits bounded), then its buffer and files go
            self.stager.release()
            keep_only(self.dir, set())

    def _gather(self, value) -> list:
        """Every rank's `value`, over the tier's control group (apart from the copies' group, which a failed
        exchange may have left broken)."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.control)
        return out

    def finish(self) -> None:
        """Wait for the snapshot being written (its failure only turns the tier off: the stored tier goes on). Each
        of its waits is bounded (checkpoint.memory_timeout_s)."""
        if self.pending is not None:
            self.pending.exception()

    def close(self, remove: bool = False) -> None:
        """Collective: stop taking snapshots; with `remove`, every node's snapshots of the run go (once every rank
        is done with them)."""
        self.heartbeat.set()
        self.finish()
        self.writer.shutdown()
        self.stager.release()
        if self.log is not None and self.every:
            self.log.event("memory_tier_end", snapshots=self.taken, skipped=self.skipped, off=self.off)
        if remove:
            with contextlib.suppress(RuntimeError):  # a rank gone: its node's files are removed by the next launch
                dist.barrier(group=self.control)  # every rank of the node done with them (its writer, first)
            if self.live_fd is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                run = self.dir.parent
                with contextlib.suppress(OSError, TimeoutError), directory_lock(run.parent):
                    if [p.name for p in run.iterdir()] == [LIVE_FILE]:  # its last node on this host
                        (run / LIVE_FILE).unlink()
                        run.rmdir()
        if self.live_fd is not None:
            os.close(self.live_fd)
            self.live_fd = None

    # --- resuming ------------------------------------------------------------------------------------------------

    def find(self, stored: int | None) -> Found | None:
        """Collective: the newest whole snapshot if it is newer than the stored checkpoint of step `stored` (None: no
        stored checkpoint), its parts at hand, read and checked on every rank, on this launch's layout (cut again if
        it was taken on another); else None, with the reason in the log. A part that fails its checks, or cannot
        be sent, is set aside and the step tried again with another copy of it, then the step before it (the
        node keeps the last whole one while the next is written), each set-aside logged; a broken exchange ends
        the search. Either way, the node then keeps only the snapshot resumed from: newer ones (left by a fault
        when the stored checkpoint is used) would otherwise be taken for newer than every snapshot to come."""
        if self.off:
            return None
        untouched = not self.objs.optimizer.state  # reading the state dicts gives a fresh optimizer its state
        parts = self._parts()
        found, set_aside, why, planned = None, set(), "", False
        reasons: dict[str, None] = {}  # each attempt's, in order, once
        while found is None:
            plan, why = plan_resume([h for h in parts if h not in set_aside], self.dims, self.cut,
                                    flatten(*state_dicts(self.objs)))
            planned = planned or plan is not None
            if plan is None or plan.step <= (stored or 0):
                if plan is not None:
                    why = f"the stored checkpoint of step {stored} is as new as the snapshot of step {plan.step}"
                break
            found, problem, bad = self._attempt(plan)
            if found is None:
                reasons[problem] = None
                if self.log is not None:
                    self.log.event("memory_snapshot_set_aside", step=plan.step, reason=problem)
                if bad is None:  # the exchange itself broke: no other copy is tried over it
                    break
                set_aside |= bad
        if found is None and (stored is not None or planned) and self.log is not None:
            self.log.event("memory_tier_not_used", reason="; ".join(reasons) or why, stored_step=stored or 0)
        keep_only(self.dir, {found.step} if found else set())
        gone = forget_nodes(self.dir.parent, {str(n) for n in self.nodes})  # by whichever rank of a host is first
        gone = sorted({n for each in self._gather(gone) for n in each})
        if gone and self.log is not None:
            self.log.event("memory_old_nodes_removed", nodes=gone)
        self.whole = found.step if found else None
        if found is None and untouched:  # (torch's _init_optim_state steps it once at lr 0): as it was, for a
            self.objs.optimizer.state.clear()  # fresh start or the stored checkpoint to fill
        return found

    def _parts(self) -> list[Held]:
        """Collective: the parts every node holds, gathered (each file that is no usable part logged)."""
        held, ignored = list_parts(self.dir, self.run_id, self.rank)
        everyone = self._gather((held, ignored))
        if self.log is not None:
            for path, problem in sorted({item for _, bad in everyone for item in bad}):
                self.log.event("memory_part_ignored", file=path, reason=problem)
        return one_per_file([h for found, _ in everyone for h in found], self.nodes)

    def _attempt(self, plan: Plan) -> tuple[Found | None, str, set[Held] | None]:
        """Collective: the plan's parts sent where they are read, then read and checked on every rank. Returns the
        snapshot, or None, why, and the parts to set aside before the next try (None: try no more), the same on
        every rank."""
        try:
            problem, broken = self._fetch(plan), False
        except Exception as e:  # noqa: BLE001 - a wait past memory_timeout_s, a connection lost: agreed below
            problem, broken = f"rank {self.rank}: sending the parts of step {plan.step} failed: " \
                              f"{type(e).__name__}: {e}", True
        outcomes = self._gather((problem, broken))  # the control group: the copies' group may be what failed
        if any(p for p, _ in outcomes):
            problem = "; ".join(dict.fromkeys(p for p, _ in outcomes if p))
            bad = None if any(b for _, b in outcomes) else \
                {h for sources in plan.sources.values() for h in sources.values()}
            return None, problem, bad
        found, problems = self._read(plan, self.dims)
        if any(problems):
            problem = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p) + \
                f" (the snapshot of step {plan.step} is set aside)"
            return None, problem, {h for r, p in enumerate(problems) if p for h in plan.sources[r].values()}
        return found, "", set()

    def _local(self, plan: Plan, rank: int, held: Held) -> Path:
        """Where `rank` reads `held`: on its node, where it lies or where it is sent (named by whose part it is)."""
        same_node = self.nodes[held.holder] == self.nodes[rank]
        return Path(held.path) if same_node else self._file(plan.step, held.rank)

    def _fetch(self, plan: Plan) -> str:
        """Collective: every part a rank reads that lies only on other nodes is sent to its node (once a node, to
        its first rank that needs it) and kept there, for a fault to come; "" once all have landed, else why not
        (the stored checkpoint is used then)."""
        moves, wanted = [], set()
        for rank in sorted(plan.sources):
            for held in plan.sources[rank].values():
                key = (self.nodes[rank], held.rank)
                if self.nodes[held.holder] != self.nodes[rank] and key not in wanted:
                    wanted.add(key)
                    target = self._new_file(plan.step, held.rank) if rank == self.rank else Path()
                    moves.append((rank, held.holder, Path(held.path), target))
        return self.transport.fetch(plan.step, moves)

    def _read(self, plan: Plan, dims: ParallelDims) -> tuple[Found | None, list[str | None]]:
        """Collective: each rank reads and checks its parts; this rank's snapshot, and every rank's problem (the
        snapshot is used only if there is none)."""
        paths = {place: self._local(plan, self.rank, held) for place, held in plan.sources[self.rank].items()}
        try:
            found, problem = read(plan, self.rank, self.world_size, paths, flatten(*state_dicts(self.objs)),
                                  dims.shard_group_size, dims.shard_place(self.rank))
        except Exception as e:  # noqa: BLE001 - a file changed or cut since it was listed: one reason among the ranks'
            found, problem = None, f"{type(e).__name__}: {e}"
        return found, self._gather(problem)

    def restore(self, found: Found) -> tuple[TrainState, HeldRows]:
        """Collective: apply the snapshot `find` returned, each rank its own shards. Returns the state to go on from
        and the metrics rows every rank held with it (raysft.checkpoint.memory.restore)."""
        return apply(self.objs, found, self.rank)
