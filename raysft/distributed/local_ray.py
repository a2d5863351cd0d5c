"""Starting a Ray of raysft's own on this machine, for a launch (or a tokenizing on Ray) without RAY_ADDRESS.

`ray.init()` without an address joins whatever Ray its temp dir says was started last on this machine (`ray start`,
another user's cluster, a test suite's), and then fails because num_cpus may not be given when joining. raysft's
local Ray is never meant to join anything: it is started with address="local" (never join) and a temp directory
of its own (its sockets, session files and logs apart from any other Ray's; the logs stay there after the run).

Ray's own processes look for "the local cluster" too: Ray Train's placement-group cleaner asks the state API, which,
with several Rays on the machine, logs "Found multiple active Ray instances" every few seconds and connects to the
one started last, which may be another run's. So the local Ray is started on a GCS port chosen here, and its
processes inherit RAY_ADDRESS naming it (and RAY_TMPDIR naming its temp dir), which that lookup reads first.

Ray's AF_UNIX socket paths (`<temp>/ray/session_<time>_<pid>/sockets/dash_MetricsHead`) must stay under 108 bytes,
so the temp directory goes under RAY_TMPDIR only while that leaves room, and else into a short directory under
/tmp, linked from RAY_TMPDIR.

The terminal shows raysft's lines: Ray's INFO lines, its token-authentication notice and the C++ log lines its
actors write to stderr stay in the session's log files (whose path the launch prints).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass

import ray

from raysft.errors import ClusterUnreachable

# The longest socket path Ray makes under its temp dir, with a 7-digit pid; the kernel's limit is 107 bytes.
SOCKET_TAIL = len("/ray/session_2026-01-01_00-00-00_000000_1234567/sockets/dash_MetricsHead")
SOCKET_PATH_MAX = 107
TEMP_PREFIX = "raysft-ray-"
# Lines Ray's own actors write to stderr that the driver would print: C++ log lines ("[2026-... E 123 456]
# core_worker.cc:2465: ...") and the state API's notice about other Rays on the machine.
RAY_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWEF] \d+ \d+\] \S+:\d+: |Found multiple active Ray instances")
# A transient error Ray's own actors report and call harmless (Ray Train's controller on a loaded machine: "Failed
# to send resource request ... it's safe to ignore this error"), with the traceback printed after it.
RAY_TRANSIENT = re.compile(r"safe to ignore this error")
TRACEBACK_LINE = re.compile(r"^(Traceback |\s|[\w.]+(Error|Exception)\b)")
# How long a cluster named in RAY_ADDRESS may take to answer (a head still starting): Ray itself retries an address
# nobody answers for minutes without a word.
CONNECT_TIMEOUT_S = float(os.environ.get("RAYSFT_RAY_CONNECT_TIMEOUT_S", 30.0))


@dataclass
class LocalRay:
    """Where a local Ray keeps its state and logs, and the link to them under RAY_TMPDIR (if they had to go
    elsewhere)."""

    temp_dir: str
    linked_from: str | None = None

    @property
    def logs(self) -> str:
        return f"{self.temp_dir}/ray/session_latest/logs"


def private_temp_dir() -> LocalRay:
    """A new directory for one local Ray: under RAY_TMPDIR (else /tmp) when Ray's socket paths fit under it, else
    a short one under /tmp with a link to it from RAY_TMPDIR, so that the logs are found where they were looked for."""
    base = os.environ.get("RAY_TMPDIR") or ("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir())
    if len(os.path.abspath(base)) + len(f"/{TEMP_PREFIX}xxxxxxxx") + SOCKET_TAIL <= SOCKET_PATH_MAX:
        return LocalRay(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=base))
    short = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    link = os.path.join(base, os.path.basename(short))
    try:
        os.makedirs(base, exist_ok=True)
        os.symlink(short, link)
    except OSError:
        link = None
    return LocalRay(short, link)


def free_port() -> int:
    """A TCP port nobody listens on now, for the local Ray's GCS (so its address is known before it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(**local_options) -> LocalRay | None:
    """The Ray this process already uses, the cluster in RAY_ADDRESS, or else a new local Ray of our own (never
    another one found on this machine; local_options go to ray.init): returns the new one's LocalRay when one was
    started here, else None."""
    if ray.is_initialized():
        return None
    if os.environ.get("RAY_ADDRESS"):
        check_reachable()
        ray.init()
        return None
    return start_local_ray(**local_options)


def check_reachable() -> None:
    """Raise ClusterUnreachable, naming RAY_ADDRESS, if nothing accepts a connection at its host and port within
    CONNECT_TIMEOUT_S (tried once a second). "auto" and "local" name no address: Ray looks on this machine itself."""
    address, timeout_s = os.environ.get("RAY_ADDRESS", ""), CONNECT_TIMEOUT_S
    host_port = re.sub(r"^[a-z]+://", "", address).rstrip("/")
    if not host_port or host_port in ("auto", "local"):
        return
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnreachable(f"RAY_ADDRESS={address!r} is not HOST:PORT or ray://HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ClusterUnreachable(
                    f"RAY_ADDRESS={address}: nothing answers at {host}:{port} after {timeout_s:g} s ({e}). Start "
                    "the cluster there (`ray start --head`), correct RAY_ADDRESS, or unset it to train on a local "
                    "Ray of raysft's own") from None
        time.sleep(1.0)


def start_local_ray(**kwargs) -> LocalRay:
    """ray.init a new local Ray with its own temp dir and GCS address, which its processes inherit as RAY_TMPDIR and
    RAY_ADDRESS; kwargs go to ray.init. Ray's console lines below WARNING, and the notices above, stay in its logs."""
    local = private_temp_dir()
    port = free_port()
    own = {"RAY_TMPDIR": local.temp_dir, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_GCS_SERVER_PORT": str(port)}
    before = {key: os.environ.get(key) for key in own}
    os.environ.update(own)  # inherited by the processes ray.init starts, and only by them
    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)  # "Token authentication is enabled"
    try:
        ray.init(address="local", _node_ip_address="127.0.0.1", logging_level=logging.WARNING, **kwargs)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _drop_ray_noise()
    return local


def wait_ended(local: LocalRay, timeout_s: float = 15.0) -> None:
    """After ray.shutdown(): wait, at most timeout_s, until no process of this local Ray is left (each carries its
    RAY_TMPDIR). A worker outlives its raylet for a moment, and may still write (a memory-tier snapshot, say)."""
    import psutil

    def left() -> bool:
        for process in psutil.process_iter():
            try:
                if process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE and \
                        process.environ().get("RAY_TMPDIR") == local.temp_dir:
                    return True
            except psutil.Error:
                continue
        return False

    deadline = time.monotonic() + timeout_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)


def _drop_ray_noise() -> None:
    """Print the workers' and actors' lines as Ray does, less RAY_NOISE (they stay in the actors' log files). A Ray
    without that dispatcher is left as it is."""
    try:
        from ray._private import worker
        dispatcher, print_lines = worker.global_worker_stdstream_dispatcher, worker.print_to_stdstream
        ignore_prefix = worker._should_ignore_worker_log_prefix(worker.global_worker)
    except (ImportError, AttributeError):
        return

    in_transient: dict[object, bool] = {}  # per process: inside a transient error's traceback

    def print_own_lines(data: dict) -> None:
        lines, in_transient[data.get("pid")] = without_noise(data.get("lines", []), in_transient.get(data.get("pid")))
        if lines:
            print_lines({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", print_own_lines)


def without_noise(lines: list[str], in_transient: bool = False) -> tuple[list[str], bool]:
    """`lines` of one Ray process less RAY_NOISE and Ray's transient errors with their tracebacks; and whether the
    last line was inside such a traceback (a traceback may go on in the process's next batch of lines)."""
    kept = []
    for line in lines:
        if RAY_TRANSIENT.search(line):
            in_transient = True
        elif not (in_transient and TRACEBACK_LINE.match(line)):
            in_transient = False
            if not RAY_NOISE.search(line):
                kept.append(line)
    return kept, in_transient
