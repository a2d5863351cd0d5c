"""Live fault tolerance on the trainer's side: this worker is a replica group of one (its own process group of world
size 1) that trains in a torchft quorum with the other groups. Each step starts with a quorum of the live groups;
the step's global batch, chosen by the data cursor alone, is split over the quorum's groups by their participating
rank alone; the gradients and the loss are summed across the quorum by torchft's managed all-reduce; and each group
applies the step when its part of it succeeded (`should_commit`, which torchft decides per group). A group dying
mid-step fails the others' all-reduce: none applies it, and the next quorum does it again on the same batch, so
every applied step sums the gradients of the same samples as a run without the fault. A group that did not apply a
step the others applied (an error of its own) is behind at the next quorum, as is a group that joins (a
replacement): torchft heals it from a live group's whole training state before its next step, through
raysft.distributed.heal_transport.

The launch gives the trainer a LiveReplicas; the trainer asks it for each step (`step`), whether this group writes
(`writes`: the group at participating rank 0 writes the metrics and the checkpoints), registers its state for heals
(`attach`), and ends with every group (`finish`)."""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from raysft.checkpoint.state import TrainingObjects, TrainState, restore_trainer_state, trainer_state_dict
from raysft.data.dataloader import GlobalBatchSampler
from raysft.training.metrics import MetricsLogger, StepResult

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
STOP_POLL_S = 1.0  # how often a group asks whether the run was asked to stop (Ray: an actor call)
ENDING_POLL_S = 0.2  # the pause between ending rounds while a group is missing
MAX_COMMIT_FAILURES = 10  # a step that fails this many times in a row (an error every round) fails the worker


class Trainer(Protocol):
    """What a live replica group reads and sets of raysft.training.trainer.Trainer."""

    objs: TrainingObjects
    state: TrainState
    end_step: int  # the launch's last step
    log: MetricsLogger
    sampler: GlobalBatchSampler
    objective_step: object  # raysft.training.sft.SFTStep: forward_backward(model, batch, backward, share=...)


class LiveReplicas:
    """torchft's Manager for this replica group (`replica_id`, one of `groups`), with the Lighthouse at `lighthouse`
    and the group's store at store_addr:store_port (Ray's TorchftConfig sets MASTER_ADDR and MASTER_PORT per group;
    None reads them), advertised to the other groups as `host` (default: this host's name). `stop_requested` is
    asked at most every STOP_POLL_S; its answer is the quorum's (any group's request ends the run there, for every
    group at the same step)."""

    def __init__(self, replica_id: int, groups: int, lighthouse: str, device: torch.device, timeout_s: float = 30.0,
                 store_addr: str | None = None, store_port: int | None = None,
                 stop_requested: Callable[[], bool] = lambda: False, join_timeout_s: float = 10.0,
                 host: str | None = None, quorum_timeout_s: float = 600.0):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
        logging.getLogger("torchft").setLevel(logging.WARNING)  # and its Python side every commit
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from raysft.distributed.heal_transport import SafeHTTPTransport

        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(pg=pg, min_replica_size=1, load_state_dict=None, state_dict=None,
                               replica_id=f"raysft_{replica_id}", rank=0, world_size=1, store_addr=store_addr,
                               store_port=store_port, lighthouse_addr=lighthouse, use_async_quorum=False,
                               timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                               max_retries=MAX_COMMIT_FAILURES, hostname=host or socket.gethostname(),
                               checkpoint_transport=SafeHTTPTransport(timeout, host))
        self.replica_id, self.groups, self.device = replica_id, groups, device
        self.lighthouse, self.join_timeout_s, self.quorum_timeout_s = lighthouse, join_timeout_s, quorum_timeout_s
        self.members: list[int] = []  # the groups of the current round's quorum
        self.participants: list[tuple[int, int]] = []  # each applied step's (participating rank, participants)
        self.ending = False  # once a quorum agreed to end the run: every later round is an ending one
        self._stop_requested, self._stop_asked = stop_requested, -math.inf

    def attach(self, trainer: Trainer) -> None:
        """Register the trainer's whole state for heals: weights, optimizer, the trainer state a checkpoint holds
        (step, data cursor, schedule, loss scale, step guard) and the RNG."""
        objs = trainer.objs

        def state() -> dict:
            # an optimizer before its first step has no state, and torch's get_optimizer_state_dict would make one
            # with a step of zero gradients (counted by Adam's bias correction): none is sent then
            optimizer = get_optimizer_state_dict(objs.model, objs.optimizer, options=FULL) if objs.optimizer.state \
                else {}
            return {"model": get_model_state_dict(objs.model, options=FULL), "optimizer": optimizer,
                    "trainer": trainer_state_dict("live", objs, trainer.state), "rng": torch.get_rng_state()}

        def load(healed: dict) -> None:
            set_model_state_dict(objs.model, healed["model"], options=FULL)
            if healed["optimizer"]:
                set_optimizer_state_dict(objs.model, objs.optimizer, healed["optimizer"], options=FULL)
            restored = restore_trainer_state(healed["trainer"], objs)
            trainer.state.step, trainer.state.skipped_steps = restored.step, restored.skipped_steps
            trainer.state.cursor.load(restored.cursor)  # in place: the sampler holds this cursor
            torch.set_rng_state(healed["rng"])

        self.manager.register_state_dict_fn("trainer", load, state)

    def step(self, trainer: Trainer, backward: Callable[[torch.Tensor], None]) -> StepResult | None:
        """Forward and backward of this group's share of one global batch, its gradients and loss summed across
        the quorum; returns once this group committed the step (a group of the quorum that did not is behind at
        the next quorum and heals from one that did). Until then the step is done again, by the next quorum, on the
        same batch. None: the quorum agreed to end the run at this step (a stop request, or a group at its end);
        the trainer then calls `finish`."""
        if not self.participants:
            self._hear_every_group()
        while True:
            behind, asked = trainer.state.step, time.perf_counter()
            self.manager.start_quorum()  # a group that is behind heals here, before its forward
            if trainer.state.step != behind:
                trainer.log.event("healed", step=trainer.state.step, from_step=behind,
                                  quorum_s=round(time.perf_counter() - asked, 3))  # the heal and the quorum's wait
            self.ending = self.ending or trainer.state.step >= trainer.end_step  # healed to the end
            ending, _ = self._vote()
            if ending:
                if self.manager.should_commit():
                    return None
                continue
            rank, count = self.manager.participating_rank(), self.manager.num_participants()
            cursor = copy.copy(trainer.state.cursor)
            batch: np.ndarray = trainer.sampler.next_batch()
            model = trainer.objs.model
            result = trainer.objective_step.forward_backward(model, batch, backward, share=(rank, count))
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            works = [self.manager.allreduce(local_tensor(g), reduce_op=ReduceOp.SUM) for g in grads]
            loss = result.loss.detach().reshape(1).clone()
            works.append(self.manager.allreduce(loss, reduce_op=ReduceOp.SUM))
            for work in works:
                work.wait()
            if self.manager.should_commit():
                self.participants.append((rank, count))
                result.loss = loss.reshape(())
                result.host["live_groups"] = self.members  # the groups of this step, in its metrics row
                return result
            trainer.objs.optimizer.zero_grad(set_to_none=True)
            trainer.state.cursor.load(cursor)

    def finish(self, saved: Callable[[], bool], save: Callable[[], None]) -> None:
        """This group is at the end of the run (or of the launch): ending rounds until one holds every group, each
        at this step (a replacement heals to it in a round) and each seeing its checkpoint `saved`. The writer of a
        round that holds every group `save`s it when it is missing (its writer died after the step, or a stop came
        between saves). Then no group is left behind to heal from nobody, and every group reads the same run
        directory for what follows (Ray's registration, a barrier of all workers). RuntimeError when no such round
        came within the quorum timeout."""
        self.ending = True
        deadline = time.monotonic() + self.quorum_timeout_s
        while True:
            self.manager.start_quorum()
            _, all_saved = self._vote(saved())
            full = self.members == list(range(self.groups))
            if full and not all_saved and self.writes():
                save()
            if self.manager.should_commit() and full and all_saved:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run's last quorum did not hold all {self.groups} replica groups with its "
                                   f"last step saved within {self.quorum_timeout_s:g} s (live.quorum_timeout_s); "
                                   f"the groups heard last: {self.members}")
            if not full:
                time.sleep(ENDING_POLL_S)  # the missing group is being replaced: seconds

    def _hear_every_group(self) -> None:
        """Before this group's first quorum: wait, up to the Lighthouse's join timeout, until the Lighthouse hears
        every group, which at a launch start at different times. A quorum asked for sooner forms without the groups
        not heard yet (correct, they heal into the next, but their first steps are the others' alone). A replacement
        finds the live groups heard at once. The count is read from the Lighthouse's status page; a page that no
        longer gives it is not waited on."""
        deadline = time.monotonic() + self.join_timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.lighthouse}/status", timeout=5) as page:
                    heard = re.search(r"\[(\d+) heartbeating\]", page.read().decode())
            except OSError:
                return
            if heard is None or int(heard[1]) >= self.groups:
                return
            time.sleep(0.05)

    def _vote(self, saved: bool = False) -> tuple[bool, bool]:
        """Collective over the quorum, after start_quorum: whether any group ends the run in this round (it was
        asked to stop, or it is at its end), and whether every group sees the last step `saved`; self.members:
        the groups in the round. A failed all-reduce leaves this group's own votes: the round is then not committed
        either way, and the next one decides."""
        if not self.ending and time.monotonic() - self._stop_asked >= STOP_POLL_S:
            self._stop_asked = time.monotonic()
            self.ending = self._stop_requested()
        votes = torch.zeros(2 + self.groups, device=self.device)  # ending, saved, then one slot per group
        votes[0], votes[1], votes[2 + self.replica_id] = float(self.ending), float(saved), 1.0
        self.manager.allreduce(votes, reduce_op=ReduceOp.SUM).wait()
        self.ending = bool(votes[0].item() > 0)
        self.members = [i for i, present in enumerate(votes[2:].tolist()) if present > 0]
        return self.ending, int(votes[1].item()) == len(self.members)

    def writes(self) -> bool:
        """Whether this group writes the run's metrics and checkpoints: the group at participating rank 0."""
        return self.manager.participating_rank() == 0

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor torchft reduces in place: a DTensor's local part, which in a group of one is the whole."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
