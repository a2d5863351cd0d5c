"""The memory tier (checkpoint.memory_every_n_steps) under plain torch.distributed: a reused pair of gloo processes
stands in for two nodes, each rank on a node of its own (WorkerContext.node), with the snapshots in tmp_path rather
than /dev/shm. A worker killed mid-run is a real process death (the pool starts fresh processes); a lost node is
its directory of snapshots gone."""

import contextlib
import errno
import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STEPS, final_weights, run_config, step_losses

from raysft.checkpoint.discovery import RUN_FILE, read_run_id
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics

FAULT_AT = 8  # persistent checkpoints at 3, 6, 9, 12: a fault after step 8 loses 2 steps without the tier


def memory_config(tmp_path: Path, name: str, **sets):
    return run_config(tmp_path, name, **{"checkpoint.mode": "full", "checkpoint.memory_every_n_steps": 1,
                                         "checkpoint.memory_dir": str(tmp_path / "shm"), **sets})


def launch_on_own_node(ctx, cfg, fresh: bool = False, die_after: int = 0) -> dict:
    """A launch with each rank on a node of its own; with die_after, rank 1's process dies as step die_after + 1
    begins, once the snapshot of step die_after is written and copied (rank 0 then waits in the step's collective
    until the pool ends it)."""
    from raysft.training.trainer import Trainer

    ctx.node = f"node{ctx.rank}"
    real_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if die_after and self.state.step == die_after:
            self.memory.finish()
            if ctx.rank == 1:
                os._exit(9)
        return real_step(self, *args, **kwargs)

    Trainer.train_step = train_step
    try:
        return launch(ctx, cfg, fresh)
    finally:
        Trainer.train_step = real_step


def launch_counting_held_steps(ctx, cfg, counts: Path) -> dict:
    """launch_on_own_node, noting in `counts` how many steps the rank's node holds once each snapshot has landed
    (its own part written, its partner's copy received): what the tier's host memory is planned on."""
    from raysft.checkpoint.memory import STEP_PREFIX, MemoryTier

    real_exchange = MemoryTier._exchange

    def exchange(self, *args) -> None:
        real_exchange(self, *args)
        with counts.open("a") as f:
            f.write(f"{sum(p.name.startswith(STEP_PREFIX) for p in self.dir.iterdir())}\n")

    MemoryTier._exchange = exchange
    try:
        return launch_on_own_node(ctx, cfg)
    finally:
        MemoryTier._exchange = real_exchange


@contextlib.contextmanager
def tier_patched(every_snapshot: bool = True, **replacements):
    """In a pool process: raysft.checkpoint.memory's functions named in `replacements` replaced, each replacement
    called with the real one first; with every_snapshot, each step first waits for the snapshot before it is
    written, so that every snapshot due is taken and a fault lands at the step the test names."""
    from raysft.checkpoint import memory
    from raysft.training.trainer import Trainer

    real = {name: getattr(memory, name) for name in replacements}
    real_step = Trainer.train_step

    def train_step(self, *args, **kwargs):
        if self.memory is not None:
            self.memory.finish()
        return real_step(self, *args, **kwargs)

    for name, replacement in replacements.items():
        setattr(memory, name, functools.partial(replacement, real[name]))
    if every_snapshot:
        Trainer.train_step = train_step
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(memory, name, function)
        Trainer.train_step = real_step


def no_room(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def launch_with_short_memory(ctx, cfg, failing_rank: int, where: str, at_step: int, written: Path) -> dict:
    """launch_on_own_node, every snapshot taken, with `failing_rank`'s snapshot of `at_step` failing for want of
    room: writing its own file (where="own") or receiving its partner's copy (where="copy"), as a full /dev/shm
    fails them. Each rank notes in `written` the steps it wrote."""
    step_of = {}

    def write(real, path, tensors, header):
        step_of["now"] = header["step"]
        if ctx.rank == failing_rank and where == "own" and header["step"] == at_step:
            raise no_room(path)
        real(path, tensors, header)
        with written.open("a") as f:
            f.write(f"{ctx.rank} {header['step']}\n")

    def map_new(real, path, size):
        if ctx.rank == failing_rank and where == "copy" and step_of.get("now") == at_step:
            raise no_room(path)
        return real(path, size)

    with tier_patched(write_part=write, map_new=map_new):
        return launch_on_own_node(ctx, cfg)


def launch_without_room_to_receive(ctx, cfg) -> dict:
    """launch_on_own_node, with rank 1's node out of room for a part sent to it at the resume."""
    def map_new(real, path, size):
        if ctx.rank == 1:
            raise no_room(path)
        return real(path, size)

    with tier_patched(every_snapshot=False, map_new=map_new):
        return launch_on_own_node(ctx, cfg)


def launch_killed_mid_snapshot(ctx, cfg, at_step: int) -> dict:
    """launch_on_own_node, every snapshot taken, with rank 1's process killed while it writes its part of the
    snapshot of `at_step` (part of the file is on disk under its temporary name)."""
    from raysft.checkpoint.memory_files import temporary

    def write(real, path, tensors, header):
        if ctx.rank == 1 and header["step"] == at_step:
            temporary(path).parent.mkdir(parents=True, exist_ok=True)
            temporary(path).write_bytes(b"\0" * 4096)
            os._exit(9)
        real(path, tensors, header)

    with tier_patched(write_part=write):
        return launch_on_own_node(ctx, cfg)


def launch_two_a_node(ctx, cfg, die_at: int = 0) -> dict:
    """A launch of 4 ranks, 2 a node (they share the node's directory), every snapshot taken; with die_at, node
    1's ranks die as they begin to write their parts of the snapshot of step die_at (node 0's then wait for their
    partners' copies until the pool ends them)."""
    ctx.node = f"node{ctx.rank // 2}"

    def write(real, path, tensors, header):
        if ctx.rank >= 2 and header["step"] == die_at:
            os._exit(9)
        real(path, tensors, header)

    with tier_patched(write_part=write):
        return launch(ctx, cfg, False)


def node_dir(cfg, node: str) -> Path:
    return Path(cfg.checkpoint.memory_dir) / read_run_id(cfg.run_dir) / node


def assert_same_run(cfg, uninterrupted, out: Path) -> None:
    ref_losses, ref_weights = uninterrupted
    last = dict(step_losses(cfg.run_dir))  # a step trained twice (before the fault and after) counts once
    assert sorted(last.items()) == ref_losses
    weights = final_weights(cfg.run_dir, out)
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_snapshots_every_step_change_nothing_and_leave_nothing_behind(tmp_path, gloo_pool, uninterrupted):
    """...and a node never holds more than 2 steps (its own parts and its partner's copies), the newest whole one
    included while the next is written: `raysft plan` counts the tier's host memory on that."""
    cfg = memory_config(tmp_path, "every-step")
    counts = tmp_path / "held_steps.txt"
    gloo_pool.run(launch_counting_held_steps, cfg, counts)
    held = [int(n) for n in counts.read_text().split()]
    assert len(held) >= 2 * 3 and max(held) == 2, held  # on both ranks, 3 snapshots or more
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert not any((tmp_path / "shm").iterdir())  # the run ended: its snapshots went with it
    assert json.loads((cfg.run_dir / RUN_FILE).read_text())["run_id"].isalnum()


@pytest.fixture(scope="module")
def faulted(gloo_pool, tmp_path_factory):
    """A run whose rank 1 died after step 8, its run directory and snapshots as the fault left them; each test
    continues a copy of it (one fault, and one restart of the pool's processes, for all)."""
    tmp = tmp_path_factory.mktemp("faulted")
    cfg = memory_config(tmp, "faulted")
    with pytest.raises(RuntimeError, match=r"died .*\{1: 9\}"):
        gloo_pool.run(launch_on_own_node, cfg, False, FAULT_AT)
    return cfg


def continue_copy(faulted, tmp_path: Path, **sets):
    """The faulted run and its snapshots copied under tmp_path, with the config that continues it."""
    cfg = memory_config(tmp_path, "continued", **sets)
    shutil.copytree(faulted.run_dir, cfg.run_dir)
    shutil.copytree(faulted.checkpoint.memory_dir, cfg.checkpoint.memory_dir)
    return cfg


def test_a_dead_worker_on_a_lost_node_resumes_from_the_copy_on_the_other_node_losing_no_step(
        tmp_path, gloo_pool, uninterrupted, faulted):
    """Rank 1 died after step 8; its node's snapshots are gone with it. The relaunch finds step 8 whole (rank 0's
    part on node 0, rank 1's in the copy node 0 received), rank 1 gets its part sent over, and the run goes on
    from step 8 (not from the stored checkpoint of step 6) to the uninterrupted run's losses and weights."""
    cfg = continue_copy(faulted, tmp_path)
    held = sorted(p.relative_to(node_dir(cfg, "node0")).as_posix()
                  for p in node_dir(cfg, "node0").rglob("rank_*.safetensors"))
    assert f"step_{FAULT_AT:08d}/rank_0.safetensors" in held and f"step_{FAULT_AT:08d}/rank_1.safetensors" in held
    shutil.rmtree(node_dir(cfg, "node1"))  # the node is lost with its memory

    gloo_pool.run(launch_on_own_node, cfg)
    resumes = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]
    assert resumes == [{**resumes[0], "step": FAULT_AT, "tier": "memory"}]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert not (Path(cfg.checkpoint.memory_dir) / read_run_id(cfg.run_dir)).exists()


def test_with_both_copies_of_a_part_lost_the_stored_checkpoint_is_used_and_the_log_says_why(
        tmp_path, gloo_pool, uninterrupted, faulted):
    cfg = continue_copy(faulted, tmp_path)
    for node in ("node0", "node1"):  # rank 1's part of every step held: the copy on node 0 and its own
        for path in node_dir(cfg, node).glob("step_*/rank_1.safetensors"):
            path.unlink()
    torn = node_dir(cfg, "node1") / f"step_{FAULT_AT:08d}" / "rank_1.safetensors"
    shutil.copy(node_dir(cfg, "node0") / f"step_{FAULT_AT:08d}" / "rank_0.safetensors", torn)
    torn.write_bytes(torn.read_bytes()[:1000])  # a file cut off (by a kill mid-write, say) is no part

    gloo_pool.run(launch_on_own_node, cfg)
    records = read_metrics(cfg.run_dir)
    not_used = [m for m in records if m.get("event") == "memory_tier_not_used"]
    assert len(not_used) == 1 and not_used[0]["reason"].startswith("no node holds rank 1's part of step")
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


def test_a_run_started_over_never_resumes_from_the_old_runs_snapshots(tmp_path, gloo_pool, faulted):
    cfg = continue_copy(faulted, tmp_path, **{"train.max_steps": 2})
    old_id = read_run_id(cfg.run_dir)
    assert list((Path(cfg.checkpoint.memory_dir) / old_id).rglob("rank_*.safetensors"))
    gloo_pool.run(launch_on_own_node, cfg, True)  # --fresh: the old run is kept aside, a new one starts
    records = read_metrics(cfg.run_dir)
    assert read_run_id(cfg.run_dir) != old_id
    assert not [m for m in records if m.get("event") == "resume"] and records[0]["event"] == "start"


def test_with_every_nodes_snapshots_gone_the_stored_checkpoint_is_used_and_the_log_says_why(
        tmp_path, gloo_pool, uninterrupted, faulted):
    """The memory that held the snapshots is gone on every node (the nodes rebooted, /dev/shm cleared)."""
    cfg = continue_copy(faulted, tmp_path)
    shutil.rmtree(Path(cfg.checkpoint.memory_dir))
    gloo_pool.run(launch_on_own_node, cfg)
    records = read_metrics(cfg.run_dir)
    assert [m["reason"] for m in records if m.get("event") == "memory_tier_not_used"] == ["no snapshot in memory"]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


def test_with_no_room_for_a_part_sent_at_the_resume_the_stored_checkpoint_is_used_and_the_log_says_why(
        tmp_path, gloo_pool, uninterrupted, faulted):
    cfg = continue_copy(faulted, tmp_path)
    shutil.rmtree(node_dir(cfg, "node1"))  # rank 1's part of step 8 is on node 0 only: it must be sent over
    gloo_pool.run(launch_without_room_to_receive, cfg)
    records = read_metrics(cfg.run_dir)
    assert [m["reason"] for m in records if m.get("event") == "memory_tier_not_used"] == [
        f"rank 1 has no room for its part of step {FAULT_AT}: OSError: [Errno 28] No space left on device: "
        f"'{node_dir(cfg, 'node1')}/step_{FAULT_AT:08d}/rank_1.safetensors'"]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.mark.parametrize("failing_rank, where", [(1, "own"), (0, "copy")])
def test_host_memory_short_on_one_rank_turns_the_tier_off_on_every_rank_and_the_run_goes_on(
        tmp_path, gloo_pool, uninterrupted, failing_rank, where):
    """One rank's snapshot of step 5 fails for want of room (its own file, or the copy of its partner's): no rank
    waits for it, every rank stops taking snapshots, the log says once which rank failed and why, and the run ends
    as the run without the tier does, leaving nothing behind."""
    cfg = memory_config(tmp_path, "short")
    written = tmp_path / "written.txt"
    gloo_pool.run(launch_with_short_memory, cfg, failing_rank, where, 5, written)
    off = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "memory_tier_off"]
    assert len(off) == 1 and off[0]["reason"].startswith(f"rank {failing_rank}: OSError: [Errno 28] No space left")
    steps = [int(line.split()[1]) for line in written.read_text().splitlines()]
    assert max(steps) == 5 and sorted(set(steps)) == [1, 2, 3, 4, 5]  # seen at step 6's check: none after
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert not any((tmp_path / "shm").iterdir())


def test_a_rank_killed_mid_snapshot_leaves_no_part_and_the_step_before_is_resumed(
        tmp_path, gloo_pool, uninterrupted):
    cfg = memory_config(tmp_path, "mid-snapshot")
    with pytest.raises(RuntimeError, match=r"died .*\{1: 9\}"):
        gloo_pool.run(launch_killed_mid_snapshot, cfg, FAULT_AT)
    cut = node_dir(cfg, "node1") / f"step_{FAULT_AT:08d}"
    assert [p.name for p in cut.iterdir()] == [".rank_1.safetensors.tmp"]  # what the kill left of the part
    gloo_pool.run(launch_on_own_node, cfg)
    resumes = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]
    assert resumes == [{**resumes[0], "step": FAULT_AT - 1, "tier": "memory"}]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.fixture(scope="module")
def two_a_node(gloo_pool4, tmp_path_factory):
    """4 ranks, 2 a node: the uninterrupted run's losses and weights, and a run whose node 1 died as its ranks
    began to write their parts of step 8 (each test continues a copy of it)."""
    tmp = tmp_path_factory.mktemp("two-a-node")
    reference = run_config(tmp, "reference", **{"checkpoint.mode": "full"})
    gloo_pool4.run(launch_two_a_node, reference)
    faulted = memory_config(tmp, "faulted")
    with pytest.raises(RuntimeError, match=r"died .*[{ ][23]: 9"):
        gloo_pool4.run(launch_two_a_node, faulted, FAULT_AT)
    return (sorted(step_losses(reference.run_dir)), final_weights(reference.run_dir, tmp / "hf")), faulted


def test_ranks_sharing_a_node_keep_its_newest_whole_step_while_the_next_is_written(tmp_path, gloo_pool4, two_a_node):
    """Node 1 died while the snapshot of step 8 was being written: node 0 still holds step 7 whole, its own parts
    and the copies of node 1's (before, the second rank of a node to clear old steps removed it, taking the other
    rank's step 8 for the newest), so the relaunch, node 1's memory lost, loses 1 step, not 2."""
    reference, faulted = two_a_node
    cfg = continue_copy(faulted, tmp_path)
    held = sorted(p.relative_to(node_dir(cfg, "node0")).as_posix() for p in node_dir(cfg, "node0").rglob("rank_*"))
    assert [f"step_{FAULT_AT - 1:08d}/rank_{r}.safetensors" for r in range(4)] == held[:4], held
    shutil.rmtree(node_dir(cfg, "node1"))
    gloo_pool4.run(launch_two_a_node, cfg)
    records = read_metrics(cfg.run_dir)
    assert [(m["step"], m.get("tier")) for m in records if m.get("event") == "resume"] == [(FAULT_AT - 1, "memory")]
    assert not [m for m in records if m.get("event") == "memory_tier_off"]
    assert_same_run(cfg, reference, tmp_path / "hf")


def test_snapshots_newer_than_the_stored_step_resumed_from_are_cleared_and_new_ones_written_beside_nothing_stale(
        tmp_path, gloo_pool4, two_a_node):
    """No node holds node 1's parts of step 7 (its memory lost, node 0's copies too): the relaunch resumes from
    the stored checkpoint of step 6, and node 0's snapshots of steps 7 and 8, newer than that, go. The run's new
    snapshots of steps 7, 8... are written without a hitch (before, a rank cleared the step its node's other rank
    was writing, as older than the stale ones: the write failed and the tier turned off)."""
    reference, faulted = two_a_node
    cfg = continue_copy(faulted, tmp_path)
    shutil.rmtree(node_dir(cfg, "node1"))
    for rank in (2, 3):
        (node_dir(cfg, "node0") / f"step_{FAULT_AT - 1:08d}" / f"rank_{rank}.safetensors").unlink()
    gloo_pool4.run(launch_two_a_node, cfg)
    records = read_metrics(cfg.run_dir)
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert not [m for m in records if m.get("event") == "memory_tier_off"]
    assert_same_run(cfg, reference, tmp_path / "hf")
    assert not (Path(cfg.checkpoint.memory_dir) / read_run_id(cfg.run_dir)).exists()


def test_partners_are_the_same_place_on_the_next_node():
    from raysft.checkpoint.memory import partners

    two_by_two = ["a", "a", "b", "b"]
    assert [partners(two_by_two, r) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    three = ["a", "b", "c"]
    assert [partners(three, r) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    assert partners(["a", "a"], 1) == (None, None)
    assert STEPS == 12
