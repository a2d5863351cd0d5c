"""A Ray cluster of real nodes on this machine, one network namespace each (cluster/netns.sh), for the tests and
bench/hsdp_links.py: start it, run a driver inside a node's namespace (the cluster's addresses exist only there),
cut or restore a node's link, end a node's processes, read its link's byte counters, and take it all down again,
also when the process that made it fails (atexit)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# Polls the cluster's view of one node (argv: its IP, "alive" or "dead", seconds): exit 0 once Ray sees it so.
NODE_STATE = """
import sys, time, ray
ray.init(logging_level="ERROR")
ip, alive, deadline = sys.argv[1], sys.argv[2] == "alive", time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    if any(n["NodeManagerAddress"] == ip and n["Alive"] for n in ray.nodes()) == alive:
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
"""
REPO = Path(__file__).resolve().parent.parent
# The fault tests' GCS settings: a node is declared dead after 3 missed health checks, 0.5 s apart, 2 s timeout each
# (Ray's defaults: 5, 3 s apart, 10 s timeout): the multi-node fault tests and bench/recovery.py --netns wait for
# that, a killed node's checks failing at once, a cut link's at the timeout. Only speed depends on it.
NODE_DEATH_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "2000",
                  "RAY_health_check_failure_threshold": "3"}
NETNS_SH = REPO / "cluster" / "netns.sh"
VENV_RAY = REPO / ".venv" / "bin" / "ray"


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent (init) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`, no CAP_NET_ADMIN), or None when they can: tried
    with a namespace of a unique name, removed at once."""
    if os.geteuid() != 0:
        return "network namespaces need root (cluster/netns.sh)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's ip and tc are not installed"
    probe = f"rsnprobe{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NetnsCluster:
    state: Path  # RAYSFT_NETNS_DIR: the tag, each node's Ray temp dir and log
    tag: str
    nodes: int
    head: str  # the GCS address, reachable only inside the cluster's namespaces
    env: dict = field(default_factory=dict)  # what netns.sh ran with (RAY_* settings the nodes got)

    def namespace(self, node: int) -> str:
        return f"rsn{self.tag}-n{node}"

    def ip(self, node: int) -> str:
        return f"10.213.0.{node + 1}"

    def driver_env(self, **extra: str) -> dict:
        """A driver's environment on the cluster: its address, the tests on the workers' import path."""
        env = {k: v for k, v in self.env.items() if not k.startswith("RAY_AUTH")}
        return {**env, "RAY_ADDRESS": self.head, "RAY_AUTH_MODE": "disabled",
                "PYTHONPATH": f"{REPO / 'tests'}:{REPO}", **extra}

    def command(self, node: int, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def run(self, node: int, *argv: str, env: dict | None = None, timeout: float = 600,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, *argv), env=env or self.driver_env(), cwd=REPO, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def popen(self, node: int, *argv: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, *argv), env=env or self.driver_env(), cwd=REPO, **kwargs)

    def python(self, node: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.run(node, sys.executable, *args, **kwargs)

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, node: int, timeout: float = 60) -> list[int]:
        """SIGKILL every process in the node's namespace (its raylet, workers and any driver there), by PID, and
        wait until they are gone (a zombie waiting for init counts as gone)."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return pids

    def join(self, node: int) -> None:
        """A replacement Ray node in the namespace of one whose processes ended (netns.sh join)."""
        out = subprocess.run([str(NETNS_SH), "join", str(node)], env=self.env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr

    def wait_node(self, node: int, alive: bool, timeout: float = 120) -> None:
        """Until Ray's GCS sees the node alive (or dead); a driver's process in node 0 asks it."""
        out = self.python(0, "-c", NODE_STATE, self.ip(node), "alive" if alive else "dead", str(timeout),
                          timeout=timeout + 60)
        assert out.returncode == 0, f"Ray did not see node {node} {'alive' if alive else 'dead'} " \
                                    f"within {timeout} s: {out.stderr[-2000:]}"

    def actor_logs(self, node: int, actor_class: str, since: float) -> list[Path]:
        """The stdout logs of the actors of one class that node's Ray nodes (the first and every replacement)
        started since a time: Ray writes `:actor_name:<class>` into a worker's log when the worker becomes one."""
        logs = [*self.state.glob(f"n{node}/session_latest/logs/worker-*.out"),
                *self.state.glob(f"n{node}.*/session_latest/logs/worker-*.out")]
        return [log for log in logs if log.stat().st_mtime >= since
                and f":actor_name:{actor_class}\n" in log.read_text(errors="replace")]

    def set_link(self, node: int, up: bool) -> None:
        subprocess.run(["ip", "-n", self.namespace(node), "link", "set", "eth0", "up" if up else "down"], check=True)

    def link_bytes(self, node: int) -> tuple[int, int]:
        """(sent, received) bytes on the node's link so far: its veth's counters, what crossed between nodes (two
        workers of one node talk over the namespace's loopback)."""
        def counter(name: str) -> int:
            out = subprocess.run(["ip", "netns", "exec", self.namespace(node), "cat",
                                  f"/sys/class/net/eth0/statistics/{name}"], capture_output=True, text=True, check=True)
            return int(out.stdout)

        return counter("tx_bytes"), counter("rx_bytes")

    def down(self) -> None:
        """End every process in the cluster's namespaces and delete them (netns.sh down), then its state."""
        subprocess.run([str(NETNS_SH), "down", self.tag], env={**os.environ, "RAYSFT_NETNS_DIR": str(self.state)},
                       capture_output=True, text=True, timeout=120)
        shutil.rmtree(self.state, ignore_errors=True)


def start(nodes: int, cpus: int = 2, rate: str | None = None, ray_env: dict | None = None) -> NetnsCluster:
    """`netns.sh up` in a state directory of its own; the cluster is taken down at exit if nobody did before."""
    state = Path(tempfile.mkdtemp(prefix="rsn", dir="/tmp"))
    tag = uuid.uuid4().hex[:6]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ray_env or {}, RAYSFT_NETNS_DIR=str(state), RAYSFT_NETNS_TAG=tag)
    if VENV_RAY.is_file():
        env["RAY"] = str(VENV_RAY)
    cluster = NetnsCluster(state, tag, nodes, "10.213.0.1:6379", env)
    atexit.register(cluster.down)
    args = [str(NETNS_SH), "up", str(nodes), "--cpus", str(cpus), *(["--rate", rate] if rate else [])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        cluster.down()
        raise RuntimeError(f"netns.sh up failed ({out.returncode}): {out.stdout}{out.stderr}")
    return cluster
