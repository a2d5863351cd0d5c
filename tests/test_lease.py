"""One launch per run: the lease refuses a live holder and lets a dead one's successor take over (Ray-free)."""

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from raysft.launch import lease as lease_module
from raysft.launch.lease import LEASE_FILE, RunInUse, RunLease, _start_time


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(lease_module, "SETTLE_S", 0.2)
    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(lease_module, "LEASE_TIMEOUT_S", 1.5)


def done_within(deadline_s: float, fn) -> None:
    """Call fn in a thread and wait until it returns or the deadline passes. "At once" is told from "after
    watching a heartbeat for LEASE_TIMEOUT_S" by making that watch an hour and the deadline a minute: no load on the
    machine brings the one near the other."""
    done = threading.Event()
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(deadline_s), f"still waiting after {deadline_s} s"
    if errors:
        raise errors[0]


def poll(predicate, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, f"not true within {deadline_s} s"
        time.sleep(0.02)


def heartbeat(run_dir) -> float | None:
    """The lease's heartbeat; None while a write is under way (read between its truncation and its bytes)."""
    try:
        return json.loads((run_dir / LEASE_FILE).read_text())["heartbeat"]
    except ValueError:
        return None


def held_by(run_dir, host=None, pid=None, started=None, heartbeat=None, token="theirs"):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LEASE_FILE).write_text(json.dumps({
        "host": host or socket.gethostname(), "pid": pid, "started": started, "token": token,
        "heartbeat": time.time() if heartbeat is None else heartbeat}))


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_launch_on_this_host_keeps_the_run_and_the_second_is_refused(tmp_path, other_process):
    held_by(tmp_path, pid=other_process.pid, started=_start_time(other_process.pid))
    before = (tmp_path / LEASE_FILE).read_text()
    with pytest.raises(RunInUse, match=f"in use by another launch \\(host {socket.gethostname()}, pid "
                                       f"{other_process.pid}"):
        RunLease(tmp_path).acquire()
    assert (tmp_path / LEASE_FILE).read_text() == before


def test_a_dead_launch_on_this_host_is_taken_over_at_once_and_released_at_the_end(tmp_path, other_process,
                                                                                monkeypatch):
    monkeypatch.setattr(lease_module, "LEASE_TIMEOUT_S", 3600)  # a watched heartbeat would hold it for an hour
    started = _start_time(other_process.pid)
    other_process.kill()
    other_process.wait()
    held_by(tmp_path, pid=other_process.pid, started=started)  # a fresh heartbeat: only the pid says it is dead

    def take_and_release():
        with RunLease(tmp_path) as lease:
            assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == lease.token

    done_within(60, take_and_release)
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_pid_reused_by_another_process_is_not_taken_for_the_holder(tmp_path):
    held_by(tmp_path, pid=1, started="not the start time of pid 1")
    with RunLease(tmp_path):
        pass


def test_another_hosts_launch_is_live_while_its_heartbeat_moves_and_stale_when_it_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "LEASE_TIMEOUT_S", 3600)  # however slowly the beat comes, it is seen moving
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            held_by(tmp_path, host="elsewhere", pid=7)

    held_by(tmp_path, host="elsewhere", pid=7)
    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(RunInUse, match="host elsewhere, pid 7"):
            RunLease(tmp_path).acquire()
    finally:
        stop.set()
        beating.join()
    # the heartbeat stopped: taken over after watching it for LEASE_TIMEOUT_S. Its last beat is from a clock a
    # minute ahead of ours, so it is recent however slowly this test runs: only watching shows it stopped
    monkeypatch.setattr(lease_module, "LEASE_TIMEOUT_S", 1.5)
    held_by(tmp_path, host="elsewhere", pid=7, heartbeat=time.time() + 60)
    start = time.monotonic()
    with RunLease(tmp_path):
        pass
    assert time.monotonic() - start >= 1.5
    monkeypatch.setattr(lease_module, "LEASE_TIMEOUT_S", 3600)
    held_by(tmp_path, host="elsewhere", pid=7, heartbeat=time.time() - 2 * 3600)
    done_within(60, lambda: RunLease(tmp_path).acquire().release())  # long dead: at once, without a watch


def test_of_two_launches_racing_for_a_run_exactly_one_gets_it(tmp_path):
    outcomes = []
    leases = [RunLease(tmp_path) for _ in range(2)]

    def launch(lease):
        try:
            lease.acquire()
            outcomes.append("held")
        except RunInUse:
            outcomes.append("refused")

    threads = [threading.Thread(target=launch, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lease in leases:
        lease.release()
    assert sorted(outcomes) == ["held", "refused"]


def test_the_holder_renews_its_heartbeat_and_notices_when_another_takes_the_run(tmp_path):
    with RunLease(tmp_path) as lease:
        first = heartbeat(tmp_path)
        poll(lambda: (heartbeat(tmp_path) or first) > first)
        held_by(tmp_path, pid=1, token="usurper")
        poll(lambda: lease.lost)
    assert json.loads((tmp_path / LEASE_FILE).read_text())["token"] == "usurper"  # not ours to delete


def test_a_lease_read_mid_write_while_watching_another_host_is_not_taken_for_released():
    """A local file is rewritten in place: a read that lands mid-write sees it torn ({}). That is no release: the
    watch goes on, and the heartbeat that moves next shows the holder alive."""
    beat = time.time()
    lease = {"host": "elsewhere", "pid": 1, "token": "theirs", "heartbeat": beat}
    reads = iter([{}, {**lease, "heartbeat": beat + 10}])
    assert lease_module.holder_alive(lease, watch_s=60, read=lambda: next(reads))
