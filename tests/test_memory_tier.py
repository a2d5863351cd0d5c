"""The memory tier (checkpoint.memory_every_n_steps) under plain torch.distributed, its faults and resumes:
tests/memory_tier_support.py says how nodes and faults are stood in for."""

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import STEPS
from memory_tier_support import (
    FAULT_AT,
    assert_same_run,
    continue_copy,
    launch_on_own_node,
    launch_two_a_node,
    memory_config,
    no_room,
    node_dir,
    tier_patched,
)

from raysft.checkpoint.discovery import RUN_FILE, read_run_id
from raysft.training.metrics import read_metrics


def launch_counting_held_steps(ctx, cfg, counts: Path) -> dict:
    """launch_on_own_node under umask 0, noting in `counts`, once each snapshot has landed (its own part written,
    its partner's copy received), how many steps the rank's node holds (what the tier's host memory is planned on)
    and the modes of what the tier made ("<directories>/<files>", each set of modes joined by ","). Step 4's
    snapshot is held in the tier's thread until step 6 begins, so step 5's is passed over."""
    import threading

    from raysft.checkpoint.memory import STEP_PREFIX, MemoryTier
    from raysft.training.trainer import Trainer

    real, real_step = MemoryTier._write_and_copy, Trainer.train_step
    step6 = threading.Event()

    def write_and_copy(self, step, *args) -> None:
        if step == 4:
            step6.wait(timeout=60)
        real(self, step, *args)
        made = [p for p in self.dir.parent.rglob("*")] + [self.dir.parent]
        dirs = ",".join(sorted({f"{p.stat().st_mode & 0o777:o}" for p in made if p.is_dir()}))
        files = ",".join(sorted({f"{p.stat().st_mode & 0o777:o}" for p in made if p.is_file()}))
        with counts.open("a") as f:
            f.write(f"{sum(p.name.startswith(STEP_PREFIX) for p in self.dir.iterdir())} {dirs}/{files}\n")

    def train_step(self, *args, **kwargs):
        if self.state.step == 5:
            step6.set()
        return real_step(self, *args, **kwargs)

    MemoryTier._write_and_copy, Trainer.train_step = write_and_copy, train_step
    umask = os.umask(0)
    try:
        return launch_on_own_node(ctx, cfg)
    finally:
        os.umask(umask)
        MemoryTier._write_and_copy, Trainer.train_step = real, real_step


def launch_with_short_memory(ctx, cfg, failing_rank: int, where: str, at_step: int, written: Path) -> dict:
    """launch_on_own_node, every snapshot taken, with `failing_rank`'s snapshot of `at_step` failing for want of
    room: writing its own file (where="own") or receiving its partner's copy (where="copy"), as a full /dev/shm
    fails them. Each rank notes in `written` the steps it wrote."""
    step_of = {}

    def write(real, path, buffer, slots, extra, header):
        step_of["now"] = header["step"]
        if ctx.rank == failing_rank and where == "own" and header["step"] == at_step:
            raise no_room(path)
        real(path, buffer, slots, extra, header)
        with written.open("a") as f:
            f.write(f"{ctx.rank} {header['step']}\n")

    def map_new(real, path, size):
        if ctx.rank == failing_rank and where == "copy" and step_of.get("now") == at_step:
            raise no_room(path)
        return real(path, size)

    def map_file(real, path):  # its own file gone as it is sent (where="read"), as a reclaim by mistake leaves it
        if ctx.rank == failing_rank and where == "read" and step_of.get("now") == at_step:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real(path)

    with tier_patched(write_part=write, map_new=map_new, map_file=map_file):
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
    """launch_on_own_node, every snapshot taken, with rank 1's process killed while the tier's writer writes its
    part of the snapshot of `at_step`, after its first bytes."""
    def write_bytes(real, f, data, digest=None):
        real(f, data[:4096], digest)
        if ctx.rank == 1 and Path(f.name).parent.name == f"step_{at_step:08d}":
            f.flush()
            os._exit(9)
        real(f, data[4096:], digest)

    with tier_patched(write_bytes=write_bytes):
        return launch_on_own_node(ctx, cfg)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_snapshots_every_step_change_nothing_are_the_users_alone_count_skips_and_leave_nothing_behind(
        tmp_path, gloo_pool, uninterrupted):
    """...and a node never holds more than 2 steps (its own parts and its partner's copies), the newest whole one
    included while the next is written: `raysft plan` counts the tier's host memory on that. Under a umask that
    lets everyone read, every directory the tier makes is 0700 and every file 0600. A snapshot passed over (the
    first, while its staging buffer is allocated; step 5's, while step 4's is still being written) is counted in
    the metrics and named once in the log."""
    cfg = memory_config(tmp_path, "every-step", **{"train.log_every_n_steps": 1})
    counts = tmp_path / "held_steps.txt"
    gloo_pool.run(launch_counting_held_steps, cfg, counts)
    lines = [line.split() for line in counts.read_text().splitlines()]
    held = [int(n) for n, _ in lines]
    assert len(held) >= 2 * 3 and max(held) == 2, held  # on both ranks, 3 snapshots or more
    modes = {mode for _, mode in lines}
    assert modes == {"700/600"}, modes
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert [p.name for p in (tmp_path / "shm").iterdir()] == [".raysft.lock"]  # the run's snapshots went with it
    records = read_metrics(cfg.run_dir)
    skipped = {m["step"]: m["memory_snapshots_skipped"] for m in records if "loss" in m}
    assert skipped[1] == 0 and skipped[2] == 1 and skipped[6] == 2 and skipped[STEPS] == 2, skipped
    events = [m for m in records if m.get("event") == "memory_snapshot_skipped"]
    assert [(m["step"], m["reason"].split(" (")[0]) for m in events] == [
        (1, "the staging buffer is being allocated"), (5, "the previous snapshot is still being written")]
    end = next(m for m in records if m.get("event") == "memory_tier_end")
    assert (end["snapshots"], end["skipped"], end["off"]) == (STEPS - 2, 2, None)
    assert json.loads((cfg.run_dir / RUN_FILE).read_text())["run_id"].isalnum()


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
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
    records = read_metrics(cfg.run_dir)
    resumes = [m for m in records if m.get("event") == "resume"]
    assert resumes == [{**resumes[0], "step": FAULT_AT, "tier": "memory"}]
    # the staging buffer was allocated as the state was restored: the first step after the resume is snapshotted
    # (before, it was passed over while the buffer was made, and a second fault there cost that step too)
    after = records[records.index(resumes[0]):]
    assert not [m for m in after if m.get("event") == "memory_snapshot_skipped" and "allocated" in m["reason"]], after
    assert next(m for m in after if m.get("step") == FAULT_AT + 1 and "loss" in m)["memory_snapshots_skipped"] == 0
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert not (Path(cfg.checkpoint.memory_dir) / read_run_id(cfg.run_dir)).exists()


@pytest.mark.slow  # continues a run whose worker was killed (a fault, a pool restart): not in make test-fast
def test_with_both_copies_of_a_part_lost_the_stored_checkpoint_is_used_and_the_log_says_why(
        tmp_path, gloo_pool, uninterrupted, faulted):
    cfg = continue_copy(faulted, tmp_path)
    part = (node_dir(cfg, "node1") / f"step_{FAULT_AT:08d}" / "rank_1.safetensors").read_bytes()
    for node in ("node0", "node1"):  # rank 1's part of every step held: the copy on node 0 and its own
        for path in node_dir(cfg, node).glob("step_*/rank_1.safetensors"):
            path.unlink()
    torn = node_dir(cfg, "node1") / f"step_{FAULT_AT:08d}" / "rank_1.safetensors"
    torn.write_bytes(part[:len(part) // 2])  # rank 1's own part cut off (a copy that died mid-send, say): no part

    gloo_pool.run(launch_on_own_node, cfg)
    records = read_metrics(cfg.run_dir)
    not_used = [m for m in records if m.get("event") == "memory_tier_not_used"]
    assert len(not_used) == 1 and not_used[0]["reason"].startswith("no node holds rank 1's part of step")
    ignored = [m for m in records if m.get("event") == "memory_part_ignored"]
    assert [(m["file"], m["reason"]) for m in ignored] == [(str(torn), "not a whole snapshot file")]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.mark.slow  # continues a run whose worker was killed (a fault, a pool restart): not in make test-fast
def test_a_run_started_over_never_resumes_from_the_old_runs_snapshots_and_reclaims_them(tmp_path, gloo_pool,
                                                                                        faulted):
    """--fresh sets the whole run aside: its directory is kept under another name, and its snapshots in node memory
    are reclaimed by the new run's first launch on each node (at once: they are never resumed from)."""
    cfg = continue_copy(faulted, tmp_path, **{"train.max_steps": 2})
    old_id = read_run_id(cfg.run_dir)
    assert list((Path(cfg.checkpoint.memory_dir) / old_id).rglob("rank_*.safetensors"))
    gloo_pool.run(launch_on_own_node, cfg, True)  # --fresh: the old run is kept aside, a new one starts
    records = read_metrics(cfg.run_dir)
    assert read_run_id(cfg.run_dir) != old_id
    assert not [m for m in records if m.get("event") == "resume"] and records[0]["event"] == "start"
    assert [p.name for p in Path(cfg.checkpoint.memory_dir).iterdir()] == [".raysft.lock"]


@pytest.mark.slow  # continues a run whose worker was killed (a fault, a pool restart): not in make test-fast
def test_a_part_of_another_run_under_this_runs_name_is_never_used(tmp_path, gloo_pool, uninterrupted, faulted):
    """The run id in a part's header is checked, not only the directory it lies in: the faulted run's snapshots
    moved under a new id (as if written there by another run) are named as another run's and not resumed from."""
    cfg = continue_copy(faulted, tmp_path)
    old_id = read_run_id(cfg.run_dir)
    record = json.loads((cfg.run_dir / RUN_FILE).read_text())
    (cfg.run_dir / RUN_FILE).write_text(json.dumps({**record, "run_id": "f" * 32}))
    shutil.move(Path(cfg.checkpoint.memory_dir) / old_id, Path(cfg.checkpoint.memory_dir) / ("f" * 32))
    gloo_pool.run(launch_on_own_node, cfg)
    records = read_metrics(cfg.run_dir)
    ignored = {m["reason"] for m in records if m.get("event") == "memory_part_ignored"}
    assert ignored == {f"a part of run {old_id}, not of this run ({'f' * 32})"}
    assert [(m["step"], m.get("tier")) for m in records if m.get("event") == "resume"] == [(6, None)]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.mark.slow  # continues a run whose worker was killed (a fault, a pool restart): not in make test-fast
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


@pytest.mark.slow  # continues a run whose worker was killed (a fault, a pool restart): not in make test-fast
def test_with_no_room_for_a_part_sent_at_the_resume_the_stored_checkpoint_is_used_and_the_log_says_why(
        tmp_path, gloo_pool, uninterrupted, faulted):
    cfg = continue_copy(faulted, tmp_path)
    shutil.rmtree(node_dir(cfg, "node1"))  # rank 1's part of step 8 is on node 0 only: it must be sent over
    gloo_pool.run(launch_without_room_to_receive, cfg)
    records = read_metrics(cfg.run_dir)
    no_room = [f"rank 1 has no room for its part of step {step}: OSError: [Errno 28] No space left on device: "
               f"'{node_dir(cfg, 'node1')}/step_{step:08d}/rank_1.safetensors'" for step in (FAULT_AT, FAULT_AT - 1)]
    # step 8 set aside, then step 7 (node 0 holds it whole too), for the same want of room
    assert [(m["step"], m["reason"]) for m in records if m.get("event") == "memory_snapshot_set_aside"] == \
        list(zip((FAULT_AT, FAULT_AT - 1), no_room, strict=True))
    assert [m["reason"] for m in records if m.get("event") == "memory_tier_not_used"] == ["; ".join(no_room)]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [6]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.mark.slow  # three runs: make test-fast leaves them out
@pytest.mark.parametrize("failing_rank, where", [(1, "own"), (0, "copy"), (0, "read")])
def test_host_memory_short_on_one_rank_turns_the_tier_off_on_every_rank_and_the_run_goes_on(
        tmp_path, gloo_pool, uninterrupted, failing_rank, where):
    """One rank's snapshot of step 5 fails for want of room (its own file, or the copy of its partner's), or its
    file is gone as it is sent: no rank waits for it, every rank stops taking snapshots, the log says once which
    rank failed and why, and the run ends as the run without the tier does, leaving nothing behind. (Before, the
    partner of a rank whose file was gone waited for it until memory_timeout_s, then the run failed.)"""
    cfg = memory_config(tmp_path, "short")
    written = tmp_path / "written.txt"
    gloo_pool.run(launch_with_short_memory, cfg, failing_rank, where, 5, written)
    off = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "memory_tier_off"]
    error = "FileNotFoundError: [Errno 2]" if where == "read" else "OSError: [Errno 28] No space left"
    assert len(off) == 1 and off[0]["reason"].startswith(f"rank {failing_rank} (node{failing_rank}): {error}")
    steps = [int(line.split()[1]) for line in written.read_text().splitlines()]
    assert max(steps) == 5 and sorted(set(steps)) == [2, 3, 4, 5]  # seen at step 6's check: none after
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert [p.name for p in (tmp_path / "shm").iterdir()] == [".raysft.lock"]


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_rank_killed_mid_snapshot_leaves_no_part_and_the_step_before_is_resumed(
        tmp_path, gloo_pool, uninterrupted):
    cfg = memory_config(tmp_path, "mid-snapshot")
    with pytest.raises(RuntimeError, match=r"died .*\{1: 9\}"):
        gloo_pool.run(launch_killed_mid_snapshot, cfg, FAULT_AT)
    cut = node_dir(cfg, "node1") / f"step_{FAULT_AT:08d}"
    assert [p.name for p in cut.iterdir()] == [".rank_1.safetensors.tmp"]  # what the kill left of the part
    assert (cut / ".rank_1.safetensors.tmp").stat().st_size >= 4096
    gloo_pool.run(launch_on_own_node, cfg)
    resumes = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]
    assert resumes == [{**resumes[0], "step": FAULT_AT - 1, "tier": "memory"}]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.fixture(scope="module")
def two_a_node(gloo_pool4, tmp_path_factory):
    """4 ranks, 2 a node: a run whose node 1 died as its ranks began to write their parts of step 8 (each test
    continues a copy of it)."""
    faulted = memory_config(tmp_path_factory.mktemp("two-a-node"), "faulted")
    with pytest.raises(RuntimeError, match=r"died .*[{ ][23]: 9"):
        gloo_pool4.run(launch_two_a_node, faulted, FAULT_AT)
    return faulted


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_ranks_sharing_a_node_keep_its_newest_whole_step_while_the_next_is_written(tmp_path, gloo_pool4,
                                                                                   two_a_node, uninterrupted4):
    """Node 1 died while the snapshot of step 8 was being written: node 0 still holds step 7 whole, its own parts
    and the copies of node 1's (before, the second rank of a node to clear old steps removed it, taking the other
    rank's step 8 for the newest), so the relaunch, node 1's memory lost, loses 1 step, not 2."""
    reference, faulted = uninterrupted4, two_a_node
    cfg = continue_copy(faulted, tmp_path)
    held = sorted(p.relative_to(node_dir(cfg, "node0")).as_posix() for p in node_dir(cfg, "node0").rglob("rank_*"))
    assert [f"step_{FAULT_AT - 1:08d}/rank_{r}.safetensors" for r in range(4)] == held[:4], held
    shutil.rmtree(node_dir(cfg, "node1"))
    gloo_pool4.run(launch_two_a_node, cfg)
    records = read_metrics(cfg.run_dir)
    assert [(m["step"], m.get("tier")) for m in records if m.get("event") == "resume"] == [(FAULT_AT - 1, "memory")]
    assert not [m for m in records if m.get("event") == "memory_tier_off"]
    assert_same_run(cfg, reference, tmp_path / "hf")


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_snapshots_newer_than_the_stored_step_resumed_from_are_cleared_and_new_ones_written_beside_nothing_stale(
        tmp_path, gloo_pool4, two_a_node, uninterrupted4):
    """No node holds node 1's parts of step 7 (its memory lost, node 0's copies too): the relaunch resumes from
    the stored checkpoint of step 6, and node 0's snapshots of steps 7 and 8, newer than that, go. The run's new
    snapshots of steps 7, 8... are written without a hitch (before, a rank cleared the step its node's other rank
    was writing, as older than the stale ones: the write failed and the tier turned off)."""
    reference, faulted = uninterrupted4, two_a_node
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


LAYOUTS = [["a", "a", "b", "b"], ["a", "b", "c"], ["a"] * 4 + ["b"] * 2, ["a", "a", "a", "b"], ["a", "a", "b", "c"],
           ["a", "b", "a", "b"], ["a"] * 3 + ["b"] * 2 + ["c"], ["a", "b"] + ["c"] * 5, ["a"] * 8 + ["b"] * 8]


@pytest.mark.parametrize("nodes", LAYOUTS, ids=lambda ns: "+".join(str(ns.count(n)) for n in dict.fromkeys(ns)))
def test_every_part_is_sent_off_its_node_and_every_send_has_its_receiver_on_any_layout(nodes):
    """Ray fills each node before the next, so uneven nodes are ordinary (6 workers on 4-GPU nodes: 4 + 2). Each
    rank sends to one rank on another node and receives from exactly the ranks that send to it (with 4 + 2, each
    of the 2 receives from 2): before, ranks 2 and 3 sent to ranks that waited for ranks 0 and 1 only, and their
    tier threads waited until gloo's timeout."""
    from raysft.checkpoint.memory import partners

    pairs = [partners(nodes, r) for r in range(len(nodes))]
    for rank, (to, _) in enumerate(pairs):
        assert nodes[to] != nodes[rank]
        assert sorted(r for r, (t, _) in enumerate(pairs) if t == to) == pairs[to][1]
    assert sum(len(frm) for _, frm in pairs) == len(nodes)
    order = list(dict.fromkeys(nodes))
    if len({nodes.count(n) for n in order}) == 1:  # even nodes: the same place on the next node, one each way
        assert all(len(frm) == 1 for _, frm in pairs)
    assert partners(["a", "a"], 1) == (None, [])


def test_the_staging_buffer_is_page_locked_for_the_ranks_own_device_from_the_tiers_thread(monkeypatch):
    """The tier's thread starts with device 0 current; under torchrun with every GPU visible, rank 1's buffer is
    registered with device 1 current, and as portable (a fake CUDA: this machine has none; tests/test_gpu.py
    copies through a real one)."""
    import threading
    from types import SimpleNamespace

    from raysft.checkpoint.memory import staging

    current, calls = threading.local(), []

    @contextlib.contextmanager
    def device(d):
        before = getattr(current, "index", 0)
        current.index = torch.device(d).index
        try:
            yield
        finally:
            current.index = before

    def register(ptr, size, flags):
        calls.append(("register", getattr(current, "index", 0), size, flags))
        return 0

    def unregister(ptr):
        calls.append(("unregister", getattr(current, "index", 0)))
        return 0

    monkeypatch.setattr(staging.torch.cuda, "device", device)
    monkeypatch.setattr(staging.torch.cuda, "cudart",
                        lambda: SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister))
    stager = staging.Stager.__new__(staging.Stager)  # without the side stream a real device would get
    stager.device, stager.cuda, stager.slots, stager.buffer, stager.event, stager._registered = \
        torch.device("cuda", 1), True, None, None, None, False
    thread = threading.Thread(target=stager.allocate, args=({"model.w": torch.empty(4, 8, device="meta")},))
    thread.start()
    thread.join()
    stager.release()
    assert calls == [("register", 1, 4 * 8 * 4, staging.HOST_REGISTER_PORTABLE), ("unregister", 1)]
    assert staging.HOST_REGISTER_PORTABLE == 1  # cudaHostRegisterPortable
