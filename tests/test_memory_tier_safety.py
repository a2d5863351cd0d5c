"""The memory tier where users run it (issue 43's round): nodes of uneven sizes, a partner that never answers,
directories other users share, parts a fault, a bug or another launch left, and HYBRID_SHARD's replicas standing
in for lost ranks. Each test fails without the fix it names. tests/memory_tier_support.py says how nodes and faults
are stood in for."""

import errno
import fcntl
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import gloo_processes
from memory_tier_support import (
    FAULT_AT,
    assert_same_run,
    continue_copy,
    flip_a_byte,
    launch_on_nodes,
    launch_on_own_node,
    memory_config,
    node_dir,
    part,
    rewrite_part,
    tier_patched,
)

from raysft.checkpoint.discovery import read_run_id
from raysft.checkpoint.memory.directory import LIVE_FILE, check_memory_dir
from raysft.checkpoint.memory.files import header_problem, read_header
from raysft.training.metrics import read_metrics

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user (nobody) needs root")


def resumes(cfg) -> list[tuple[int, str | None]]:
    return [(m["step"], m.get("tier")) for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]


def events(cfg, kind: str) -> list[dict]:
    return [m for m in read_metrics(cfg.run_dir) if m.get("event") == kind]


# --- uneven nodes, and a partner that never answers ------------------------------------------------------------

def launch_with_a_rank_that_stalls(ctx, cfg, at_step: int, seconds: float) -> dict:
    """launch_on_own_node with rank 1 held for `seconds` before its tier's agreement on the snapshot of `at_step`."""
    import raysft.checkpoint.memory.tier as tier

    real = tier.MemoryTier._ready

    def ready(self, tensors, step):
        if ctx.rank == 1 and step == at_step:
            time.sleep(seconds)
        return real(self, tensors, step)

    tier.MemoryTier._ready = ready
    try:
        return launch_on_own_node(ctx, cfg)
    finally:
        tier.MemoryTier._ready = real


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_the_tiers_agreement_on_the_step_path_waits_at_most_memory_timeout_s(tmp_path):
    """Rank 1 held for 4 s before the tier's agreement on step 5's snapshot, checkpoint.memory_timeout_s 2: rank
    0's wait there ends after 2 s, by name, and the run fails for Ray to restart it. Before, that group had gloo's
    default timeout: the wait could last 30 minutes. (A pool of its own: the failed run's processes are not
    reused.)"""
    cfg = memory_config(tmp_path, "stalled", **{"checkpoint.memory_timeout_s": 2})
    (tmp_path / "pool").mkdir()
    with gloo_processes(2, tmp_path / "pool") as pool, \
            pytest.raises(RuntimeError, match=r"rank 0: .*Timed out waiting 2000ms"):
        pool.run(launch_with_a_rank_that_stalls, cfg, 5, 4)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_uneven_nodes_snapshot_with_a_copy_off_each_node_and_a_lost_node_costs_no_step(tmp_path, gloo_pool4,
                                                                                      uninterrupted4):
    """3 workers on one node, 1 on another (Ray fills each node before the next). Before, rank 3's copy went to
    rank 0 while rank 0 waited for rank 3's... and ranks 1 and 2 sent to rank 3, which waited for rank 0 only: the
    tier's threads waited until gloo's timeout and the run hung at its end. Now rank 3 receives the parts of ranks
    0, 1 and 2, and its own goes to rank 0: with node b lost after step 8, its part comes from node a."""
    nodes = ["a", "a", "a", "b"]
    cfg = memory_config(tmp_path, "uneven")
    with pytest.raises(RuntimeError, match=r"died .*\{3: 9\}"):
        gloo_pool4.run(launch_on_nodes, cfg, nodes, False, FAULT_AT, (3,))
    assert all(part(cfg, "b", FAULT_AT, r).is_file() for r in range(4))  # b holds its own and a's three
    assert part(cfg, "a", FAULT_AT, 3).is_file()
    shutil.rmtree(node_dir(cfg, "b"))  # the node is lost with its memory
    gloo_pool4.run(launch_on_nodes, cfg, nodes)
    assert resumes(cfg) == [(FAULT_AT, "memory")]
    assert_same_run(cfg, uninterrupted4, tmp_path / "hf")


def launch_with_a_silent_partner(ctx, cfg, at_step: int) -> dict:
    """launch_on_own_node, every snapshot taken, with rank 1 never taking part in the copies of step `at_step` (a
    partner stuck or gone without its process ending)."""
    from raysft.checkpoint.memory.transport import Transport

    real = Transport.exchange

    def exchange(self, path, target_of):
        if not (ctx.rank == 1 and path is not None and path.parent.name == f"step_{at_step:08d}"):
            real(self, path, target_of)

    Transport.exchange = exchange
    try:
        with tier_patched():
            return launch_on_own_node(ctx, cfg)
    finally:
        Transport.exchange = real


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_partner_that_never_answers_turns_the_tier_off_within_its_timeout_and_the_run_goes_on(
        tmp_path, gloo_pool, uninterrupted):
    """Rank 0's copy of step 5 waits for rank 1 at most checkpoint.memory_timeout_s (before, gloo's 30 minutes, and
    the run's end stalled in the tier's close); then the tier is off on every rank, named once, and the run ends
    as the run without the tier does."""
    cfg = memory_config(tmp_path, "silent", **{"checkpoint.memory_timeout_s": 2})
    gloo_pool.run(launch_with_a_silent_partner, cfg, 5)
    off = events(cfg, "memory_tier_off")
    assert len(off) == 1 and off[0]["reason"].startswith("rank 0 (node0): ") and "rank 1" not in off[0]["reason"]
    assert "imed out" in off[0]["reason"] or "timeout" in off[0]["reason"].lower(), off
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


# --- the directory is the user's alone ---------------------------------------------------------------------------

def test_the_memory_dir_is_made_private_and_refused_where_others_may_write_it_or_own_it(tmp_path):
    umask = os.umask(0)
    try:
        made = tmp_path / "a" / "b" / "shm"
        assert check_memory_dir(made) is None
        assert {oct(p.stat().st_mode & 0o777) for p in (made, made.parent, made.parent.parent)} == {"0o700"}
    finally:
        os.umask(umask)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert check_memory_dir(shared) == f"checkpoint.memory_dir {shared} may be written by other users (mode " \
                                       "drwxrwxrwx)"
    assert "its parent" in check_memory_dir(shared / "shm") and not (shared / "shm").exists()
    shared.chmod(0o1777)  # sticky, as /dev/shm: another user cannot move what is ours in it
    assert check_memory_dir(shared / "shm") is None
    assert "may be written by other users" in check_memory_dir(shared)  # but the tier's own directory is not shared
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert check_memory_dir(mine) is None
    open_above = tmp_path / "open" / "private"  # its grandparent open to all: it could be swapped from there
    open_above.mkdir(parents=True, mode=0o700)
    open_above.parent.chmod(0o777)
    assert check_memory_dir(open_above / "shm") == (
        f"checkpoint.memory_dir {open_above / 'shm'}: its ancestor {open_above.parent} may be written by other "
        "users (mode drwxrwxrwx)")
    assert not (open_above / "shm").exists()


@as_root
def test_a_memory_dir_or_link_another_user_owns_is_refused(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    assert check_memory_dir(planted) == f"checkpoint.memory_dir {planted} is owned by uid {NOBODY} (nobody), not " \
                                        f"by this user (uid 0 (root))"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    os.lchown(link, NOBODY, NOBODY)
    assert "symbolic link of uid 65534" in check_memory_dir(link)


@as_root
@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_a_planted_memory_dir_with_a_newer_snapshot_is_never_used_nor_written(tmp_path, gloo_pool, uninterrupted,
                                                                              faulted):
    """Whoever made the memory_dir first owns it: here another user (nobody) holds it, with a snapshot of step 8
    whose header matches the run. Before, the run resumed from it. Now the tier is off on every rank, named in the
    log, the run resumes from its stored checkpoint, and nothing in the directory is written or removed."""
    cfg = continue_copy(faulted, tmp_path)
    shm = Path(cfg.checkpoint.memory_dir)
    for path in [shm, *shm.rglob("*")]:
        os.lchown(path, NOBODY, NOBODY)
    before = {p: p.stat().st_mtime_ns for p in shm.rglob("*")}
    gloo_pool.run(launch_on_own_node, cfg)
    owner = f"checkpoint.memory_dir {shm} is owned by uid {NOBODY} (nobody), not by this user (uid 0 (root))"
    assert [m["reason"] for m in events(cfg, "memory_tier_off")] == [
        f"rank 0 (node0): {owner}; rank 1 (node1): {owner}"]
    assert resumes(cfg) == [(6, None)]
    assert {p: p.stat().st_mtime_ns for p in shm.rglob("*")} == before
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


# --- a full /dev/shm -----------------------------------------------------------------------------------------------

def launch_on_one_node(ctx, cfg) -> dict:
    with tier_patched():  # every snapshot due is taken, so that one due when the room is short is seen
        return launch_on_nodes(ctx, cfg, ["a", "a"])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real tmpfs of 40 MiB (the suite runs as root; skipped where mounting is not allowed), unmounted after."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@as_root
@pytest.mark.slow  # trains: make test-fast leaves it out
def test_a_tmpfs_short_of_room_skips_snapshots_by_name_and_is_never_filled_for_what_else_uses_it(
        tmp_path, gloo_pool, uninterrupted, small_tmpfs):
    """The memory_dir a tmpfs of 40 MiB that another process uses too: it holds 23 MiB of its own and writes and
    removes 2 MiB more all along. A step's snapshot takes 10 MiB here (2 ranks on one node, 5 MiB each), and the
    newest whole one is kept while the next is written: the snapshot of step 2 fits, the next ones do not, and each
    is passed over with a named event, the tier staying on, until the other process frees its 23 MiB once it reads
    that event (step 3's); then they are taken again. The other process never meets a full tmpfs, and the run ends
    bit-identical to the run without the tier. Before, the snapshot's write met ENOSPC, left its temporary file, and
    the tmpfs stayed full while the run went on."""
    ballast = small_tmpfs / "other-user.bin"
    ballast.write_bytes(b"\0" * (23 << 20))
    cfg = memory_config(tmp_path, "tmpfs", **{"checkpoint.memory_dir": str(small_tmpfs)})
    stop, failures = threading.Event(), []

    def other_process():
        while not stop.is_set():
            try:
                (small_tmpfs / "other-scratch.bin").write_bytes(b"\1" * (2 << 20))
                (small_tmpfs / "other-scratch.bin").unlink()
            except OSError as e:
                failures.append(f"{type(e).__name__}: {e}")
            if ballast.exists() and (cfg.run_dir / "metrics.jsonl").is_file() and \
                    any("free space" in m.get("reason", "") for m in read_metrics(cfg.run_dir)):
                ballast.unlink()  # once a snapshot was passed over for the room: room again
            time.sleep(0.05)

    beside = threading.Thread(target=other_process, daemon=True)
    beside.start()
    try:
        gloo_pool.run(launch_on_one_node, cfg)
    finally:
        stop.set()
        beside.join()
    assert failures == [] and not ballast.exists()
    [skipped] = [m for m in events(cfg, "memory_snapshot_skipped") if "free space" in m["reason"]]
    assert skipped["step"] == 3 and skipped["free"].startswith("a: ") and "its 2 files of a step take 10 MiB" in \
        skipped["free"], skipped
    assert not events(cfg, "memory_tier_off")
    [end] = events(cfg, "memory_tier_end")
    assert end["snapshots"] >= 6 and end["skipped"] >= 2, end  # the first one's buffer, then step 3 (and maybe 4)
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [".raysft.lock"]


# --- what a part holds is checked, every part --------------------------------------------------------------------

@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_a_snapshot_with_an_unsound_trainer_state_or_nan_is_never_resumed_from(tmp_path, gloo_pool, uninterrupted,
                                                                              faulted):
    """Step 8's part of rank 0 (both copies) with a step guard state a stored checkpoint would be refused for:
    those files are ignored, named. Step 7, whole, holds NaN in one of rank 0's weights: every rank reads and checks
    its part before any is applied, so the snapshot is set aside on every rank and the stored checkpoint used."""
    cfg = continue_copy(faulted, tmp_path)
    bad_guard = {"recent": ["high"], "in_a_row": 0}
    for node in ("node0", "node1"):
        rewrite_part(part(cfg, node, FAULT_AT, 0),
                     header=lambda h: {**h, "trainer_state": {**h["trainer_state"], "step_guard": bad_guard}})
        rewrite_part(part(cfg, node, FAULT_AT - 1, 0), tensors=lambda t: {
            **t, "model.model.norm.weight": t["model.model.norm.weight"].clone().fill_(float("nan"))})
    gloo_pool.run(launch_on_own_node, cfg)
    ignored = {(m["file"], m["reason"].split(":")[0]) for m in events(cfg, "memory_part_ignored")}
    assert ignored == {(str(part(cfg, node, FAULT_AT, 0)), "step_guard") for node in ("node0", "node1")}
    [not_used] = events(cfg, "memory_tier_not_used")
    assert not_used["reason"] == f"rank 0: {part(cfg, 'node0', FAULT_AT - 1, 0)}: model.model.norm.weight holds " \
                                 f"non-finite values (the snapshot of step {FAULT_AT - 1} is set aside)"
    assert resumes(cfg) == [(6, None)]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


def nan_in_norm(tensors: dict) -> dict:
    return {**tensors, "model.model.norm.weight": tensors["model.model.norm.weight"].clone().fill_(float("nan"))}


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_a_rejected_part_is_read_again_from_its_other_copy_then_the_step_before_is_tried(tmp_path, gloo_pool,
                                                                                       uninterrupted, faulted):
    """Two continuations of the fault. Rank 0's part of step 8 holds NaN on its own node only: it is set aside,
    named, and rank 0 reads the copy on node 1 (sent over): the run resumes from step 8. Then the copy holds NaN
    too: step 8 has no sound part of rank 0 left, and the run resumes from step 7, which every node still holds
    whole, not from the stored checkpoint of step 6. Before, the first rejection went to the stored checkpoint."""
    one = continue_copy(faulted, tmp_path / "one")
    rewrite_part(part(one, "node0", FAULT_AT, 0), tensors=nan_in_norm)
    gloo_pool.run(launch_on_own_node, one)
    nan = f"rank 0: {part(one, 'node0', FAULT_AT, 0)}: model.model.norm.weight holds non-finite values " \
          f"(the snapshot of step {FAULT_AT} is set aside)"
    assert [(m["step"], m["reason"]) for m in events(one, "memory_snapshot_set_aside")] == [(FAULT_AT, nan)]
    assert resumes(one) == [(FAULT_AT, "memory")] and not events(one, "memory_tier_not_used")
    assert_same_run(one, uninterrupted, tmp_path / "one" / "hf")

    both = continue_copy(faulted, tmp_path / "both")
    for node in ("node0", "node1"):
        rewrite_part(part(both, node, FAULT_AT, 0), tensors=nan_in_norm)
    gloo_pool.run(launch_on_own_node, both)
    assert [m["step"] for m in events(both, "memory_snapshot_set_aside")] == [FAULT_AT, FAULT_AT]
    assert resumes(both) == [(FAULT_AT - 1, "memory")] and not events(both, "memory_tier_not_used")
    assert_same_run(both, uninterrupted, tmp_path / "both" / "hf")


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_a_flipped_bit_in_a_part_is_caught_by_its_checksum_and_the_other_copy_used(tmp_path, gloo_pool,
                                                                                   uninterrupted, faulted):
    """One bit of rank 0's own part of step 8 flipped in node memory (a weight's value: no NaN, the right shapes):
    its checksum no longer matches, the part is set aside, named, and rank 0 reads the copy on node 1. Before,
    such a snapshot was resumed from without a word, and most of the losses after it differed from the run without
    the fault."""
    cfg = continue_copy(faulted, tmp_path)
    flipped = part(cfg, "node0", FAULT_AT, 0)
    flip_a_byte(flipped)
    gloo_pool.run(launch_on_own_node, cfg)
    [aside] = events(cfg, "memory_snapshot_set_aside")
    assert aside["step"] == FAULT_AT and aside["reason"].startswith(
        f"rank 0: {flipped}: its bytes do not match its checksum (xxh3_64:"), aside
    assert resumes(cfg) == [(FAULT_AT, "memory")]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


def launch_with_a_copy_gone_when_sent(ctx, cfg, step: int) -> dict:
    """A launch whose rank 1, holding a part of `step`, finds it gone as it starts to send it (once)."""
    gone = []

    def map_file(real, path):
        if ctx.rank == 1 and f"step_{step:08d}" in str(path) and not gone:
            gone.append(path)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real(path)

    with tier_patched(every_snapshot=False, map_file=map_file):
        return launch_on_own_node(ctx, cfg)


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_a_part_that_cannot_be_sent_at_the_resume_sets_its_step_aside_and_never_crashes_the_launch(
        tmp_path, gloo_pool, uninterrupted, faulted):
    """Rank 0's own part of step 8 is gone (its node lost it), so the copy on node 1 must be sent, and node 1 finds
    that copy gone as it starts: every rank hears it, step 8 is set aside with node 1's reason, and the run resumes
    from step 7, whole on both nodes. Before, the holder's error left the launch, on every restart."""
    cfg = continue_copy(faulted, tmp_path)
    part(cfg, "node0", FAULT_AT, 0).unlink()
    gloo_pool.run(launch_with_a_copy_gone_when_sent, cfg, FAULT_AT)
    copy = part(cfg, "node1", FAULT_AT, 0)
    assert [(m["step"], m["reason"]) for m in events(cfg, "memory_snapshot_set_aside")] == [
        (FAULT_AT, f"rank 1 could not read {copy} to send it: FileNotFoundError: [Errno 2] No such file or "
                   f"directory: '{copy}'")]
    assert resumes(cfg) == [(FAULT_AT - 1, "memory")]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_a_header_whose_layout_is_ill_typed_or_out_of_range_is_no_part(faulted):
    """Discovery computes with the layout's sizes: each must be an integer of at least 1 (a bool is none), the
    sharding a name, before any of it is used; such a file is ignored, named, like any header that fails."""
    path = part(faulted, "node0", FAULT_AT, 0)
    header = read_header(path)
    assert header_problem(header, path) is None
    for bad in ({"shard": "2"}, {"replicate": 0}, {"sharding": None}, {"sequence": True}, {"shard": None}):
        layout = {**header["layout"], **bad}
        assert header_problem({**header, "layout": layout}, path) == \
            f"layout {layout!r}: expected a sharding and replicate, shard and sequence sizes of at least 1"


def launch_holding_few_rows(ctx, cfg, bound: int, die_after: int = 0) -> dict:
    """launch_on_own_node with the tier's bound on the metrics rows a part carries (over every rank) set to
    `bound`."""
    import raysft.checkpoint.memory.tier as tier

    real, tier.MAX_HELD_ROWS = tier.MAX_HELD_ROWS, bound
    try:
        return launch_on_own_node(ctx, cfg, False, die_after)
    finally:
        tier.MAX_HELD_ROWS = real


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_the_metrics_rows_a_part_carries_are_bounded_and_every_step_is_logged_once_resumed(tmp_path, gloo_pool,
                                                                                          uninterrupted):
    """Each part carries every rank's metrics rows not yet logged (world size x rows held), and safetensors
    refuses a header over 100 MB: past MAX_HELD_ROWS over every rank (here 2 on 2 ranks; rows are logged at each
    checkpoint, every 3 steps) the rows are logged before the snapshot, which then carries at most the bound.
    Before, the part of step 8 held 2 rows a rank. A resume from it still logs every step, and trains as the run
    without a fault."""
    cfg = memory_config(tmp_path, "rows")
    with pytest.raises(RuntimeError, match=r"died .*\{1: 9\}"):
        gloo_pool.run(launch_holding_few_rows, cfg, 2, FAULT_AT)
    header = read_header(part(cfg, "node0", FAULT_AT, 0))
    assert len(header["metrics_rows"]) == 2 and sum(map(len, header["metrics_rows"])) <= 2, header
    gloo_pool.run(launch_holding_few_rows, cfg, 2)
    assert resumes(cfg) == [(FAULT_AT, "memory")]
    assert sorted({m["step"] for m in read_metrics(cfg.run_dir) if "loss" in m}) == \
        list(range(1, cfg.train.max_steps + 1))
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


def test_a_file_every_rank_of_its_node_lists_is_one_part_so_one_set_aside_is_never_read_again():
    """Ranks 0 and 1 share node a and both list its files; rank 2 alone lists node b's. Each file is kept once,
    as listed by the lowest rank of its node, so that a file set aside is not tried again as rank 1's listing of
    it. Before, a bad part on a node of several ranks was read (or sent) once for each of them before its other
    copy was tried (seen on logical nodes: bench/recovery.py --spoil flip)."""
    from raysft.checkpoint.memory.discovery import Held, one_per_file

    def held(rank: int, holder: int, path: str) -> Held:
        return Held(8, rank, holder, path, "a" * 24, rank, 3, {})

    listed = [held(0, 1, "/shm/a/rank_0"), held(1, 1, "/shm/a/rank_1"), held(0, 0, "/shm/a/rank_0"),
              held(1, 0, "/shm/a/rank_1"), held(0, 2, "/shm/a/rank_0"), held(2, 2, "/shm/b/rank_2")]
    kept = one_per_file(listed, ["a", "a", "b"])
    assert sorted((h.rank, h.holder, h.path) for h in kept) == [
        (0, 0, "/shm/a/rank_0"), (0, 2, "/shm/a/rank_0"), (1, 0, "/shm/a/rank_1"), (2, 2, "/shm/b/rank_2")]


@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_parts_of_two_launch_attempts_are_never_combined_into_one_step(tmp_path, gloo_pool, uninterrupted, faulted):
    """Rank 1's part of step 8 is left only by another launch attempt (a node left out of one attempt keeps its
    files): step 8 is not whole in any one attempt, and the run resumes from step 7, whole in the attempt that
    wrote it. Before, rank 0's part of one attempt and rank 1's of the other were resumed together."""
    cfg = continue_copy(faulted, tmp_path)
    part(cfg, "node0", FAULT_AT, 1).unlink()
    rewrite_part(part(cfg, "node1", FAULT_AT, 1), header=lambda h: {**h, "attempt": "f" * 24})
    gloo_pool.run(launch_on_own_node, cfg)
    assert resumes(cfg) == [(FAULT_AT - 1, "memory")]
    assert_same_run(cfg, uninterrupted, tmp_path / "hf")


# --- nothing is left in node memory ------------------------------------------------------------------------------

def launch_noting_the_live_file(ctx, cfg, seen: Path) -> dict:
    """launch_on_own_node with the heartbeat every 0.1 s and steps of at least 0.15 s; rank 0 notes, at each step,
    the mtime of its run's `.live` file."""
    import raysft.checkpoint.memory.tier as tier
    from raysft.training.trainer import Trainer

    real_beat, real_step = tier.HEARTBEAT_S, Trainer.train_step

    def train_step(self, *args, **kwargs):
        time.sleep(0.15)
        if ctx.rank == 0:
            live = self.checkpointer.memory.dir.parent / LIVE_FILE
            with seen.open("a") as f:
                f.write(f"{live.stat().st_mtime_ns}\n")
        return real_step(self, *args, **kwargs)

    tier.HEARTBEAT_S, Trainer.train_step = 0.1, train_step
    try:
        return launch_on_own_node(ctx, cfg)
    finally:
        tier.HEARTBEAT_S, Trainer.train_step = real_beat, real_step


@pytest.mark.slow  # trains: make test-fast leaves it out
def test_a_run_whose_snapshots_are_rare_still_shows_it_is_alive_on_its_node(tmp_path, gloo_pool):
    """No snapshot in the whole run (one every 1000 steps), yet its `.live` file is touched all along, by the
    workers' heartbeat: a launch of another run on the node, while Ray restarts this one's workers, finds it
    recent and leaves it. Before, only the arrival and each snapshot touched it: past RECLAIM_GRACE_S (5 minutes)
    between snapshots, a run in the gap of a restart looked dead and was reclaimed."""
    cfg = memory_config(tmp_path, "rare", **{"checkpoint.memory_every_n_steps": 1000})
    seen = tmp_path / "live.txt"
    gloo_pool.run(launch_noting_the_live_file, cfg, seen)
    times = [int(line) for line in seen.read_text().split()]
    assert len(times) == cfg.train.max_steps and times[-1] > times[0] and len(set(times)) > len(times) // 2, times
    [end] = events(cfg, "memory_tier_end")
    assert end["snapshots"] == 0


@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_a_launch_removes_the_folders_of_nodes_it_does_not_span_and_nothing_raysft_did_not_make(
        tmp_path, gloo_pool, faulted):
    """The run's folders on this host of a node this launch does not span (its Ray node started again under a new
    id, or a logical node of the host gone) go once the launch has resumed: no rank reads them, and they would
    hold node memory until the run's end. Before, they stayed. A folder raysft did not make stays."""
    cfg = continue_copy(faulted, tmp_path)
    run = node_dir(cfg, "node0").parent
    shutil.copytree(node_dir(cfg, "node1"), run / "node9")
    (run / "notes").mkdir()
    (run / "notes" / "todo.txt").write_text("mine")
    gloo_pool.run(launch_on_own_node, cfg)
    assert resumes(cfg) == [(FAULT_AT, "memory")]
    assert [e["nodes"] for e in events(cfg, "memory_old_nodes_removed")] == [["node9"]]
    assert sorted(p.name for p in run.iterdir()) == [LIVE_FILE, "notes"]  # the run's own nodes: gone at its end


@pytest.mark.slow  # continues the faulted run (a session fixture that trains): make test-fast leaves it out
def test_the_next_launch_reclaims_runs_no_process_holds_and_never_a_live_or_recent_one(tmp_path, gloo_pool, faulted):
    """In one memory_dir: the faulted run (its processes killed: a job SIGKILLed as a whole leaves just this), a run
    a live process holds, one that wrote a moment ago (Ray may be restarting its workers), and a directory raysft
    did not make. Another run's launch removes the first only."""
    shm = tmp_path / "shm"
    shutil.copytree(faulted.checkpoint.memory_dir, shm)
    dead = shm / read_run_id(faulted.run_dir)
    live, recent, foreign = shm / ("a" * 32), shm / ("b" * 32), shm / "notes"
    shutil.copytree(dead, live)
    shutil.copytree(dead, recent)
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    an_hour_ago, now = time.time() - 3600, time.time()
    # copytree keeps the faulted run's times: each run's are set, not left to when the fixture ran
    for run, when in ((dead, an_hour_ago), (live, an_hour_ago), (foreign, an_hour_ago), (recent, now)):
        for path in (run, run / ".live"):
            if path.exists():
                os.utime(path, (when, when))
    holder = os.open(live / ".live", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_SH)  # a live worker of that run
    try:
        cfg = memory_config(tmp_path, "next", **{"train.max_steps": 1})
        gloo_pool.run(launch_on_own_node, cfg)
    finally:
        os.close(holder)
    assert sorted(p.name for p in shm.iterdir()) == [".raysft.lock", live.name, recent.name, "notes"]
    assert (foreign / "todo.txt").read_text() == "mine"
    assert resumes(cfg) == []
