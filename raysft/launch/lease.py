"""One launch at a time per run: a lease file in the run directory.

Two launches of one run would both resume from the same checkpoint, write into the same checkpoint directories
and interleave metrics.jsonl. So the driver of a launch holds `<run dir>/raysft_lease.json` (its host, pid, the
process's start time, a random token and a heartbeat time) while it trains, rewriting the heartbeat every
HEARTBEAT_S seconds, and deletes it at the end. A launch that finds the lease held refuses with RunInUse, unless
the holder is gone:

- same host: the holder's pid is not running (or is another process that reused the pid): taken over at once,
  so a driver restarted after a crash or a kill (by hand, by a scheduler, by Ray restarting a job) resumes at once;
- another host: the heartbeat did not move for LEASE_TIMEOUT_S seconds. The new launch watches it for up to that
  long: a heartbeat that moves is a live launch (refused as soon as it is seen), one that does not is stale.

Writing is what works on every storage raysft uses (local disk, NFS, object stores, where there is no exclusive
create): write the lease whole, wait SETTLE_S (RAYSFT_LEASE_SETTLE_S, 1 s), read it back; of two launches racing
for one run, the one whose write landed last reads its own token and goes on, the other reads the winner's and
refuses. A loser would have to stall for longer than SETTLE_S between its read and its write to slip past, and the
winner's heartbeat then notices that the lease is no longer its own (it says so in the log and stops writing).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from raysft.errors import RunInUse
from raysft.storage import Location, location

LEASE_FILE = "raysft_lease.json"
HEARTBEAT_S = float(os.environ.get("RAYSFT_LEASE_HEARTBEAT_S", 10.0))
LEASE_TIMEOUT_S = float(os.environ.get("RAYSFT_LEASE_TIMEOUT_S", 60.0))
SETTLE_S = float(os.environ.get("RAYSFT_LEASE_SETTLE_S", 1.0))


def _start_time(pid: int) -> str | None:
    """An id of the process `pid` that a later process reusing the pid does not share (its start time in clock
    ticks since boot, from /proc; where there is no /proc, just whether it exists); None if it is not running."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]  # a zombie has ended
    except FileNotFoundError:
        return None
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "running"


def holder_alive(lease: dict, watch_s: float, read: Callable[[], dict | None] | None = None) -> bool:
    """Whether the launch that wrote `lease` is still running (see the module docstring for how this is told)."""
    if lease.get("host") == socket.gethostname():
        try:
            started = _start_time(int(lease.get("pid")))
        except (TypeError, ValueError):
            return False
        return started is not None and started == lease.get("started")
    beat = lease.get("heartbeat")
    if not isinstance(beat, (int, float)) or time.time() - beat > watch_s:
        return False
    deadline = time.monotonic() + watch_s  # another host: watch the heartbeat (its clock may differ from ours)
    while read is not None and time.monotonic() < deadline:
        time.sleep(min(HEARTBEAT_S / 2, watch_s))
        now = read()
        if now == {}:
            continue  # read mid-write (torn): says nothing about the holder; read again
        if now is None or now.get("token") != lease.get("token"):
            return False  # released, or taken by a third launch (`take` then reads whose it is)
        if now.get("heartbeat") != lease.get("heartbeat"):
            return True
    return read is None


class RunLease:
    """`with RunLease(run_dir):` holds the run for this process (raises RunInUse if another live launch does)."""

    def __init__(self, run_dir: Path | Location):
        self.file = location(run_dir) / LEASE_FILE
        self.token = uuid.uuid4().hex
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict | None:
        try:
            lease = json.loads(self.file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # torn or garbled: no one can be shown to hold it
        return lease if isinstance(lease, dict) else {}

    def _write(self) -> None:
        pid = os.getpid()
        self.file.write_text(json.dumps({
            "host": socket.gethostname(), "pid": pid, "started": _start_time(pid), "token": self.token,
            "heartbeat": time.time()}))

    def check_free(self) -> None:
        """Raise RunInUse if a live launch holds the run; reads only."""
        current = self._read()
        if current and current.get("token") != self.token and holder_alive(current, LEASE_TIMEOUT_S, self._read):
            raise RunInUse(
                f"run directory {self.file.parent} is in use by another launch (host {current.get('host')}, pid "
                f"{current.get('pid')}, {LEASE_FILE}): two launches of one run would write the same checkpoints. "
                f"Wait for it to end or stop it; a launch that died is taken over (at once on the same host, after "
                f"{LEASE_TIMEOUT_S:g} s without a heartbeat from another host)")

    def acquire(self) -> RunLease:
        """check_free, then take."""
        self.check_free()
        return self.take()

    def take(self) -> RunLease:
        """Write the lease, make sure it stayed ours, and keep it fresh from a background thread."""
        self._write()
        time.sleep(SETTLE_S)
        if (self._read() or {}).get("token") != self.token:
            self.check_free()  # whoever won says who holds it
            raise RunInUse(f"run directory {self.file.parent}: another launch took the run at the same moment")
        self._thread = threading.Thread(target=self._heartbeat, name="raysft-lease", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self._read() or {}).get("token") not in (self.token, None):
                    self.lost = True
                    print(f"raysft: warning: another launch took over {self.file}; this one no longer holds the run",
                          flush=True)
                    return
                self._write()
            except OSError as e:  # storage unreachable for a moment: try again at the next beat
                print(f"raysft: warning: cannot renew {self.file}: {e}", flush=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if (self._read() or {}).get("token") == self.token:
                self.file.delete()
        except OSError:
            pass  # stale once this process is gone

    def __enter__(self) -> RunLease:
        return self if self._thread is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
