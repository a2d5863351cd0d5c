"""The memory tier's directory on a node: whose it is, who may read it, and what is reclaimed from it.

`<memory_dir>/<run id>/<node>/step_<step>/rank_<rank>.safetensors`. The snapshots hold the weights and optimizer
state, and a resume trusts what it finds there, so the directory must be its user's alone:
- `memory_dir` (default `/dev/shm/raysft-<uid>`, each user's own) is used only if this user owns it and nobody
  else may write it or the directory it is in (unless that one has the sticky bit, as /dev/shm has): otherwise a
  user who made it first could read the run's state or plant a snapshot it resumes from. Every directory above
  it is held to the same (one another user may write could swap what is below it). `check_memory_dir` says
  why not, and the tier stays off, writing nothing there.
- What raysft creates is 0700 (directories) and 0600 (files: raysft.checkpoint.memory.files).

Node memory is freed by nobody else, so a run that ended without removing its snapshots (its job SIGKILLed as a
whole, its driver gone with the only record of it) would hold it until a reboot. Each live worker holds a shared
lock on its run's `.live` file; the next launch on the node (`reclaim`) removes every other run of this user's that
no process holds and that wrote nothing for RECLAIM_GRACE_S (Ray restarting a run's workers leaves a gap with no
holder; each live worker touches `.live` every HEARTBEAT_S, however rare its snapshots), or that `--fresh` set
aside. Taking and testing those locks, and creating and removing run directories,
happen under the directory's own lock (`.raysft.lock`), so that a run is never removed between its workers'
arrival and their lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

DIR_MODE = 0o700
LOCK_FILE = ".raysft.lock"  # in memory_dir: reclaim and the runs' arrival, one process at a time
LIVE_FILE = ".live"  # in a run's directory: a shared lock held by each of its live workers
STEP_PREFIX = "step_"
RECLAIM_GRACE_S = float(os.environ.get("RAYSFT_MEMORY_RECLAIM_GRACE_S", 300.0))
HEARTBEAT_S = RECLAIM_GRACE_S / 5  # how often a live worker touches its run's `.live` file
LOCK_WAIT_S = 60.0  # for the directory's lock: what one reclaim takes at most, with room to spare


def default_memory_dir() -> Path:
    """This user's own directory in node-local shared memory (the temporary directory where there is none)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return root / f"raysft-{os.getuid()}"


def resolve_memory_dir(memory_dir: str) -> Path:
    """checkpoint.memory_dir as this node's path ("": `default_memory_dir`)."""
    return Path(memory_dir).expanduser() if memory_dir else default_memory_dir()


def check_memory_dir(path: Path) -> str | None:
    """Why `path` must not hold this user's snapshots (None if it may), creating it (0700) if it does not exist."""
    uid = os.getuid()
    for parent in [path.parent, *path.parent.parents]:  # one another user may write can swap what is below it
        if parent.exists():
            problem = _foreign(parent, uid, sticky_ok=True)
            if problem:
                which = "parent" if parent == path.parent else f"ancestor {parent}"
                return f"checkpoint.memory_dir {path}: its {which} {problem}"
    try:
        if path.is_symlink() and os.lstat(path).st_uid != uid:
            return f"checkpoint.memory_dir {path} is a symbolic link of {_owner(os.lstat(path).st_uid)}'s"
        if not path.exists():
            make_private_dirs(path)
        problem = _foreign(path, uid, sticky_ok=False)
    except OSError as e:
        return f"checkpoint.memory_dir {path}: {e}"
    return f"checkpoint.memory_dir {path} {problem}" if problem else None


def _foreign(path: Path, uid: int, sticky_ok: bool) -> str | None:
    st = os.stat(path)
    if st.st_uid not in (uid, 0) or (st.st_uid == 0 and uid != 0 and not sticky_ok):
        return f"is owned by {_owner(st.st_uid)}, not by this user ({_owner(uid)})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"may be written by other users (mode {stat.filemode(st.st_mode)})"
    return None


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def make_private_dirs(path: Path) -> None:
    """`path` and its missing parents, each 0700 whatever the umask."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=DIR_MODE)
        os.chmod(p, DIR_MODE)


@contextlib.contextmanager
def directory_lock(memory_dir: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """The directory's own lock, for at most `wait_s` (then TimeoutError: no wait of the tier is unbounded)."""
    fd = os.open(memory_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{memory_dir / LOCK_FILE} held by another process for {wait_s:.0f} s") \
                        from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def arrive(memory_dir: Path, run_id: str, node: str, set_aside: tuple[str, ...] = ()) -> tuple[Path, int]:
    """This worker's arrival on the node: under the directory's lock, other runs' snapshots reclaimed (`reclaim`),
    its run's directory created (0700) and held (a shared lock on its `.live` file, released when the returned file
    descriptor is closed or the process ends). Returns the node's directory of the run and that descriptor."""
    with directory_lock(memory_dir):
        reclaim(memory_dir, keep=run_id, set_aside=set_aside)
        run = memory_dir / run_id
        make_private_dirs(run / node)
        fd = os.open(run / LIVE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # under the directory's lock, nobody holds it exclusively
        os.utime(run / LIVE_FILE)
    return run / node, fd


def reclaim(memory_dir: Path, keep: str, set_aside: tuple[str, ...] = ()) -> list[str]:
    """Under the directory's lock: remove the snapshots of every run but `keep` that no live process holds and that
    wrote nothing for RECLAIM_GRACE_S, or that is in `set_aside` (a run --fresh replaced: it never resumes). Only
    directories raysft made (a run id's name, its `.live` file inside) are looked at. Returns the run ids removed."""
    removed = []
    for run in sorted(memory_dir.iterdir()):
        live = run / LIVE_FILE
        if run.name == keep or not run.name.isalnum() or run.is_symlink() or not live.is_file():
            continue
        if run.name not in set_aside and time.time() - _last_write(run) < RECLAIM_GRACE_S:
            continue
        fd = os.open(live, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live worker holds it
            shutil.rmtree(run, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(run.name)
    return removed


def _last_write(run: Path) -> float:
    """When the run last wrote on this node: its `.live` file (touched at each snapshot) or its directory."""
    times = [run.stat().st_mtime]
    with contextlib.suppress(OSError):
        times.append((run / LIVE_FILE).stat().st_mtime)
    return max(times)


def step_dir(node_dir: Path, step: int) -> Path:
    return node_dir / f"{STEP_PREFIX}{step:08d}"


def room_problem(node_dir: Path, node: str, files: int, need: int) -> str | None:
    """Why the node's directory cannot take a step's `files` of `need` bytes in all (beside the newest whole step,
    kept while the next is written), or None: a full /dev/shm fails everything on the node that maps shared memory
    (Ray's object store, DataLoader workers, NCCL), so a snapshot that would fill it is not begun."""
    try:
        stat_ = os.statvfs(node_dir)
    except OSError as e:
        return f"{node}: {type(e).__name__}: {e}"
    free = stat_.f_bavail * stat_.f_frsize
    if free >= need:
        return None
    return f"{node}: {free / 2**20:.0f} MiB free, its {files} files of a step take {need / 2**20:.0f} MiB"


def keep_only(node_dir: Path, steps: set[int]) -> None:
    """Remove the node's snapshots but those of `steps`. By step, not by what the directory lists: the ranks of a
    node share it, and another rank's step being written is no reason to remove the newest whole one."""
    keep = {step_dir(node_dir, step).name for step in steps}
    for old in node_dir.glob(f"{STEP_PREFIX}*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def forget_nodes(run: Path, nodes: set[str]) -> list[str]:
    """Under the directory's lock: remove the run's folders on this host of every node but `nodes` (this launch's),
    and return their names. A node id changes when its Ray node is started again, and logical nodes share a host's
    memory: the folder of one this launch does not span is read by no rank and would hold node memory until the run
    ends. Only folders raysft made (holding nothing but step folders) are looked at."""
    removed = []
    with directory_lock(run.parent):
        for node in sorted(run.iterdir()):
            if node.name in nodes or node.is_symlink() or not node.is_dir():
                continue
            if all(p.name.startswith(STEP_PREFIX) and p.is_dir() for p in node.iterdir()):
                shutil.rmtree(node, ignore_errors=True)
                removed.append(node.name)
    return removed


def remove_run(memory_dir: str | Path, run_id: str) -> None:
    """Every snapshot of the run on this host: at the end of a run, whatever ended it (in a memory_dir that is this
    user's alone: nothing is removed from one the tier would not use)."""
    root = resolve_memory_dir(str(memory_dir))
    if root.is_dir() and check_memory_dir(root) is None:
        shutil.rmtree(root / run_id, ignore_errors=True)
