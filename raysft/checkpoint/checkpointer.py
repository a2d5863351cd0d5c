"""The Checkpointer: the one object training talks to about its state, across both tiers. It owns when to save, the
layout (full or sharded, "auto" picks by size), one save at a time written in the background with checkpoint.async,
committing it through a Sink; the memory tier's snapshots (raysft.checkpoint.memory) and their removal once the run
ends; and, at a launch, which whole state to go on from, the snapshot or the stored checkpoint, and restoring it.
Plain torch.distributed: the same code checkpoints under Ray and under torchrun."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from raysft.checkpoint.discovery import read_run_id, read_set_aside, step_of
from raysft.checkpoint.layouts import PendingSave, load, start_save
from raysft.checkpoint.memory import MemoryTier, remove_run
from raysft.checkpoint.memory.restore import Found, HeldRows
from raysft.checkpoint.sinks import Sink
from raysft.checkpoint.state import TrainingObjects, TrainState
from raysft.config import CheckpointConfig, TrainConfig
from raysft.data.dataloader import DataCursor
from raysft.distributed.collectives import all_ranks, any_rank, count_ranks, from_rank0
from raysft.distributed.layout import ParallelDims
from raysft.errors import CheckpointSaveError, NonFiniteStateError
from raysft.storage import Location

FULL_SAVE_MAX_BYTES = 16 * 2**30  # "auto": the largest checkpoint that rank 0 writes alone (full)


def choose_mode(mode: str, model: nn.Module, asynchronous: bool = False) -> str:
    """Collective for "auto": rank 0 decides (auto_mode, with its host's available memory), the same answer on every
    rank."""
    if mode != "auto":
        return mode
    # what a checkpoint holds (LoRA: the adapters); a DTensor's numel is the full size, the same on every rank
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    workers = dist.get_world_size()
    return from_rank0(lambda: auto_mode(12 * numel, available_memory_bytes(), workers, asynchronous))


def auto_mode(state_bytes: int, available_bytes: int, workers: int, asynchronous: bool) -> str:
    """Full (the directory transformers loads as it is) unless its cost grows with the run: rank 0 writes a full
    checkpoint alone, so beyond FULL_SAVE_MAX_BYTES of fp32 weights and AdamW moments (fp32: 3 × 4 bytes per parameter)
    the workers' own shards are written side by side instead; one worker writes everything either way. A
    synchronous full save holds one whole tensor at a time on rank 0, an async one the whole state (and a copy
    more): async keeps full only while a quarter of the host's available memory holds it."""
    if asynchronous and 4 * state_bytes > available_bytes:
        return "sharded"
    return "sharded" if workers > 1 and state_bytes > FULL_SAVE_MAX_BYTES else "full"


def available_memory_bytes() -> int:
    """What the host can still give this process: MemAvailable on Linux, free pages elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def first_non_finite(objs: TrainingObjects) -> str | None:
    """The name of the first of this rank's parameter shards and optimizer-state tensors that holds a NaN or inf,
    if any: one pass over the local tensors and one read of their flags, no communication."""
    tensors = list(objs.model.named_parameters())
    names = {id(p): name for name, p in tensors}
    for param, state in objs.optimizer.state.items():
        tensors += [(f"optimizer {key} of {names.get(id(param), '?')}", v) for key, v in state.items()
                    if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not tensors:
        return None
    local = [(t.to_local() if isinstance(t, DTensor) else t).detach() for _, t in tensors]
    flags = torch.stack([torch.isfinite(t).all().to(local[0].device) for t in local])
    if bool(flags.all()):
        return None
    return tensors[int((~flags).nonzero()[0, 0])][0]


def check_finite(objs: TrainingObjects, step: int) -> None:
    """Collective: raise NonFiniteStateError on every rank if any rank's weights or optimizer state hold a NaN or
    inf, naming the first such tensor on each of those ranks."""
    bad = first_non_finite(objs)
    if not count_ranks(bad is not None):
        return
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, bad)
    where = "; ".join(f"rank {rank}: {name}" for rank, name in enumerate(found) if name)
    raise NonFiniteStateError(f"step {step}: not saving a checkpoint of non-finite values ({where}). The earlier "
                              "checkpoints are kept; resume from one with a lower train.lr")


NOTICE_CHECK_S = 1.0  # how often the ranks look for a preemption notice or a stop request (a barrier each)


@dataclass(frozen=True)
class Due:
    """Whether a step saves and why, the same on every rank: its cadence (checkpoint.every_n_steps, the last step),
    a preemption notice, or a stop request (the loop returns after that save)."""

    scheduled: bool = False
    preempted: bool = False
    stop: bool = False

    @property
    def save(self) -> bool:
        return self.scheduled or self.preempted or self.stop

    @property
    def urgent(self) -> bool:
        """Committed before training goes on: the node or the process is about to go."""
        return self.preempted or self.stop


@dataclass(frozen=True)
class Resume:
    """The newest whole training state a launch goes on from (Checkpointer.newest): the memory tier's snapshot when
    it is newer than the stored checkpoint, else the stored checkpoint, else neither (a fresh start)."""

    snapshot: Found | None = None
    stored: Path | Location | None = None

    @property
    def found(self) -> bool:
        return self.snapshot is not None or self.stored is not None


def open_memory_tier(cfg: TrainConfig, objs: TrainingObjects, dims: ParallelDims, device: torch.device,
                     log) -> MemoryTier | None:
    """Collective: the memory tier of this run on this worker's node (its node: `dims`), for a Checkpointer to own;
    None without checkpoint.memory_every_n_steps."""
    if not cfg.checkpoint.memory_every_n_steps:
        return None
    run_id, set_aside = from_rank0(lambda: (read_run_id(cfg.run_dir), read_set_aside(cfg.run_dir)))
    return MemoryTier(objs, cfg.checkpoint, run_id, dims, cfg.parallel.sharding, device, log, set_aside)


def remove_snapshots(run_dir: Path | Location, cfg: CheckpointConfig) -> str | None:
    """The memory tier's snapshots of the run on this host, once the run ended however it did (the workers remove
    them themselves at a normal end or a stop: Checkpointer.close): of no use then, and node-local shared memory is
    freed by nobody else. Returns the run's id, for a launcher to remove them on its other hosts too; None when
    nothing of the run was snapshotted (no memory tier, or no record of the run)."""
    if not cfg.memory_every_n_steps:
        return None
    try:
        run_id = read_run_id(run_dir)
    except (OSError, ValueError):
        return None
    remove_run(cfg.memory_dir, run_id)
    return run_id


class Checkpointer:
    """Decides when to save (`due`: the cadence, preemption notices, stop requests) and saves the training state
    into a Sink, one save at a time, in the background with checkpoint.async; takes the memory tier's snapshots
    (`memory`, from open_memory_tier); at a launch, finds the newest whole state (`newest`) and restores it. Collective
    where its methods say so.

    `preemption_deadline` is collective and returns the same on every rank: None, or the time (epoch seconds) by
    which a node of this run will be taken away. A save is due as soon as it is heard of, and once more when the
    deadline is nearer than two steps and a save, so that only the steps after that are redone. `stop_requested` is
    local (a SIGTERM reached this process or its driver, raysft.launch.signals): when it holds on any rank, every rank
    saves the step it is at, as for a preemption notice."""

    def __init__(self, cfg: CheckpointConfig, objs: TrainingObjects, sink: Sink, log, rank: int,
                 device: torch.device | None = None,
                 preemption_deadline: Callable[[], float | None] = lambda: None,
                 stop_requested: Callable[[], bool] = lambda: False, memory: MemoryTier | None = None):
        self.cfg, self.objs, self.sink, self.log, self.rank = cfg, objs, sink, log, rank
        self.memory = memory
        self.device = device or torch.device("cpu")  # of the notice checks' all-reduce: the process group's
        self.mode = choose_mode(cfg.mode, objs.model, cfg.async_save)
        self.pending: tuple[PendingSave, dict] | None = None  # a checkpoint still being written, its metrics
        self.preemption_deadline, self.stop_requested = preemption_deadline, stop_requested
        self.deadline: float | None = None  # of an announced preemption
        self.last_chance_taken = False
        self.save_s = 0.0  # how long the preemption checkpoint took, to time the last one
        self.next_notice_check = 0  # the step after which the ranks look next (the first one, and then see below)
        self.checked_at = (0, time.perf_counter())  # (step, time) of the last check

    def load(self, ckpt_dir: Path | Location) -> TrainState:
        return load(ckpt_dir, self.objs)

    def newest(self, stored: Path | Location | None) -> Resume:
        """Collective: the whole training state this launch goes on from: the memory tier's newest whole snapshot if
        it is newer than the stored checkpoint `stored` (the run's newest complete one: discovery.find_resume_dir),
        else `stored`. Nothing is applied yet (`restore` does), so that what needs the starting weights (a
        reference pass) reads them first."""
        snapshot = self.memory.find(step_of(stored) if stored else None) if self.memory is not None else None
        return Resume(snapshot, stored)

    def restore(self, resume: Resume, seed: int) -> tuple[TrainState, HeldRows | None]:
        """Collective: the training objects set to `resume`'s state, or a fresh state at step 0 (its data order from
        `seed`) when it found none; an event in the run's log says which. Returns the state, and the metrics rows
        every old rank held with a snapshot, not yet logged (the training loop regroups them over its ranks)."""
        world_size = dist.get_world_size()
        if resume.snapshot is not None:
            state, held = self.memory.restore(resume.snapshot)
            self.log.event("resume", step=state.step, tier="memory", world_size=world_size)
        elif resume.stored is not None:
            state, held = self.load(resume.stored), None
            self.log.event("resume", step=state.step, checkpoint=str(resume.stored), world_size=world_size)
        else:
            self.log.event("start", world_size=world_size, checkpoint_mode=self.mode)
            return TrainState(step=0, cursor=DataCursor(seed=seed)), None
        if state.step == 0:  # the base's checkpoint: its optimizer state is that of no step (Checkpointer.save)
            self.objs.optimizer.state.clear()
        if self.memory is not None:  # the next snapshot's buffer, for the state just restored
            self.memory.prepare()
        return state, held

    def snapshot(self, state: TrainState, held: list[tuple[float, dict, torch.Tensor]]) -> None:
        """Collective with a memory tier: its snapshot of the step just taken, if one is due; `held` are the metrics
        rows not yet logged, kept with it (MemoryTier.snapshot)."""
        if self.memory is not None:
            self.memory.snapshot(state, held)

    def holds_too_many(self, step: int, held: int) -> bool:
        """Whether the metrics rows held must be logged before this step's snapshot (MemoryTier.holds_too_many)."""
        return self.memory is not None and self.memory.holds_too_many(step, held)

    def snapshot_metrics(self) -> dict:
        """The memory tier's part of each step's metrics: the snapshots passed over so far (never silent)."""
        return {"memory_snapshots_skipped": self.memory.skipped} if self.memory is not None else {}

    def close(self, at_step: int) -> None:
        """Collective, when this launch's training ends: commit the pending save, and remove the run's snapshots
        (ended by the launch itself, the stored checkpoint is the newest)."""
        self.finish(at_step)
        if self.memory is not None:
            self.memory.close(remove=True)

    def start_notice_checks(self, step: int) -> None:
        """The loop starts (or resumes) at `step`: step times for the notice checks are measured from here."""
        self.checked_at = (step, time.perf_counter())

    def due(self, step: int, stop: int, step_s: float) -> Due:
        """Collective: whether the step just taken (of `step_s` seconds) saves, and why; `stop` is the launch's last
        step."""
        preempted, stop_requested = self._notices(step, step_s)
        return Due(step % self.cfg.every_n_steps == 0 or step == stop, preempted, stop_requested)

    def save(self, state: TrainState, metrics: dict, urgent: bool = False) -> None:
        """Collective: snapshot the state and write it (in the background with checkpoint.async); `finish` or a
        later `poll` commits it, or this call when `urgent` (Due.urgent)."""
        urgent_start = time.perf_counter()
        self.finish()  # one save at a time: the previous one must be complete
        check_finite(self.objs, state.step)  # what is snapshotted now is what every layout writes
        start = time.perf_counter()
        staged = self.sink.stage(state.step)
        untouched = not self.objs.optimizer.state  # the base (eval.at_start): before the first step
        try:
            pending = start_save(staged, self.mode, self.objs, state, self.cfg.async_save, shared=self.sink.shared)
        except BaseException:
            self.sink.discard(staged) if self.sink.shared else shutil.rmtree(staged, ignore_errors=True)
            raise
        finally:
            if untouched:  # torch's get_optimizer_state_dict stepped it once on zero gradients: Adam's bias
                self.objs.optimizer.state.clear()  # correction would count that step; the save holds its copy
        self.pending = (pending, {**metrics, "step": state.step, "save_blocking_s": time.perf_counter() - start,
                                  "save_started": start})
        if urgent:  # durable and reported before the node or the process goes
            self.finish(state.step)
            self.save_s = time.perf_counter() - urgent_start
        elif not self.cfg.async_save:
            self.finish()

    def poll(self, at_step: int) -> None:
        """Collective: commit the pending save if every rank has finished writing it."""
        if self.pending is not None and all_ranks(self.pending[0].done()):
            self.finish(at_step)

    def finish(self, at_step: int | None = None) -> None:
        """Collective: wait for the pending save (raising CheckpointSaveError on every rank if it failed on any),
        then commit it."""
        if self.pending is None:
            return
        (pending, metrics), self.pending = self.pending, None
        try:
            wrote = pending.finish()
        except CheckpointSaveError:
            self.sink.discard(pending.out_dir)
            raise
        save_s = time.perf_counter() - metrics.pop("save_started")
        size_gb = pending.bytes_written / 1e9 if self.rank == 0 else 0.0  # rank 0 wrote the manifest: every size
        metrics.update(save_s=save_s, save_gb=size_gb, save_gb_per_s=size_gb / save_s)
        self.sink.commit(pending.out_dir, pending.step, metrics, wrote)
        self.log.event("checkpoint", step=pending.step, mode=self.mode,
                       blocking_s=round(metrics["save_blocking_s"], 3), save_s=round(save_s, 3),
                       gb=round(size_gb, 4), gb_per_s=round(size_gb / save_s, 3),
                       reported_at_step=pending.step if at_step is None else at_step)

    def _notices(self, step: int, step_s: float) -> tuple[bool, bool]:
        """Collective: (whether to checkpoint for a preemption, whether to checkpoint and stop on a stop request).

        A preemption checkpoint is due when Ray has just announced that a node of this run will be drained, or when
        that deadline is nearer than two more steps and a save. Training goes on after each; when the node goes,
        Ray restarts the workers elsewhere from the latest.

        Asking Ray and agreeing on a stop are barriers, so they happen about every NOTICE_CHECK_S seconds, not every
        step: at each check rank 0 turns its measured step time into the number of steps to the next check, and one
        all-reduce carries that and every rank's stop request, so that every rank checks at the same step whatever
        its own clock says, and all stop together."""
        if step < self.next_notice_check:
            return self._last_chance_due(step, step_s), False
        stop = self._schedule_notice_check(step)
        if self.deadline is not None:
            return self._last_chance_due(step, step_s), stop
        self.deadline = self.preemption_deadline()
        if self.deadline is not None:
            self.log.event("preemption_notice", step=step, seconds_left=self._seconds_left())
        return self.deadline is not None, stop

    def _last_chance_due(self, step: int, step_s: float) -> bool:
        """Collective once a notice came: whether the deadline is nearer than two more steps and a save. Once it
        is, the last chance is taken or let go: a save that the last one's time says would not land before the
        node goes is not begun (the notice's checkpoint stays the newest)."""
        if self.deadline is None or self.last_chance_taken or math.isinf(self.deadline):
            return False
        if not any_rank(time.time() + 2 * (step_s + self.save_s) >= self.deadline):  # clocks differ a bit
            return False
        self.last_chance_taken = True
        if any_rank(time.time() + self.save_s >= self.deadline):
            self.log.event("preemption_too_late_to_save", step=step, seconds_left=self._seconds_left(),
                           save_s=round(self.save_s, 1))
            return False
        self.log.event("preemption_last_checkpoint", step=step, seconds_left=self._seconds_left())
        return True

    def _schedule_notice_check(self, step: int) -> bool:
        """Collective: schedule the next check (rank 0's step time decides); whether a stop is requested on any rank."""
        now = time.perf_counter()
        steps_s = (now - self.checked_at[1]) / max(1, step - self.checked_at[0])
        every = max(1, min(1000, int(NOTICE_CHECK_S / max(steps_s, 1e-6)))) if self.rank == 0 else 0
        agreed = torch.tensor([every, int(self.stop_requested())], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # rank 0's is the only non-zero step count
        self.next_notice_check, self.checked_at = step + int(agreed[0].item()), (step, now)
        return bool(agreed[1].item())

    def _seconds_left(self) -> float | None:
        return None if math.isinf(self.deadline) else round(self.deadline - time.time(), 1)
