"""`ray job submit` of jobs/sft.py, as the README says, to a real 2-node Ray cluster on this machine (cluster/local.sh:
token auth, the job API on 127.0.0.1 only): refused without the cluster's token, trains the demo to a complete
checkpoint with the uploaded working dir, shows raysft's lines in `ray job logs`, and local.sh stop then ends every
process of the cluster, the jobs' included, and nothing else.

That a run launched again resumes is the driver's own behaviour, the same under `ray job submit`: the killed-driver
test in tests/test_faults_cluster.py launches again, and tests/test_multinode.py's job resumes after its faults."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, http_status, running

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

LOCAL_SH = REPO / "cluster" / "local.sh"
# The ray executable local.sh starts the nodes with; its directory goes first on the nodes' PATH.
VENV_RAY = REPO / ".venv" / "bin" / "ray"
RAY = VENV_RAY if VENV_RAY.is_file() else Path(shutil.which("ray") or "ray")
DEMO = ["jobs/configs/demo.yaml", "--set", "checkpoint.every_n_steps=3", "--set", "data.max_seq_len=96", "--set",
        "eval.path="]  # the demo's generation evaluation is tested in tests/test_cli.py and tests/test_train_ray.py
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray's CLI colours its output even into a pipe


@dataclass
class Cluster:
    state: Path  # RAYSFT_LOCAL_DIR: the nodes' temp dirs, the token, the recorded sessions
    dashboard: str  # http://127.0.0.1:<port>: the job API
    token_path: Path
    mark: str  # RAYSFT_LOCAL_CLUSTER=<mark> in the environment of every process the cluster starts
    env: dict  # the environment local.sh runs with
    home: Path  # a scratch HOME for the Ray CLI: the user's ~/.ray/auth_token must play no part
    started: str  # what `local.sh start` printed
    bystander: subprocess.Popen  # a process named like a raylet that the cluster did not start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_pids(state: Path, mark: str) -> set[int]:
    """What local.sh stop must end: every process carrying the cluster's mark (job drivers and Ray Train workers
    included) and every member of a session local.sh recorded."""
    sessions = {int(line.split()[1]) for line in (state / "sessions").read_text().splitlines()} \
        if (state / "sessions").exists() else set()
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            sid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if f"RAYSFT_LOCAL_CLUSTER={mark}".encode() in environ or sid in sessions:
            pids.add(int(proc.name))
    return {p for p in pids if running(p)}


def git_ignored() -> list[str]:
    """What git ignores in the checkout, .gitignore and .git/info/exclude alike (here: .venv/, build outputs,
    local wheel and data caches); [] outside a git checkout."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--others", "--ignored", "--exclude-standard",
                          "--directory"], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def ray_cli(cluster: Cluster, *args: str, token: bool = True, timeout: float = 180, **env_changes: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_API_SERVER"))}
    env.update(HOME=str(cluster.home), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(cluster.token_path))
    env.update(env_changes)
    out = subprocess.run([str(RAY), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return out.returncode, ANSI.sub("", out.stdout + out.stderr)


def submit(cluster: Cluster, submission_id: str, *entrypoint: str, token: bool = True, **env_changes: str):
    """`ray job submit` as the README has it (the repository as working dir, `python` from the head's PATH),
    plus excludes for what git ignores beyond .gitignore, which Ray does not read (.git/info/exclude). Blocks
    until the job ends: exit 0 when it succeeded."""
    runtime_env = {"excludes": [f"/{path}" for path in git_ignored()]}
    return ray_cli(cluster, "job", "submit", "--address", cluster.dashboard, "--submission-id", submission_id,
                   "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint,
                   token=token, timeout=900, **env_changes)


@pytest.fixture
def cluster():
    # A short state dir (Ray's socket paths under --temp-dir are limited to ~107 bytes) and ports of its own.
    state = Path(tempfile.mkdtemp(prefix="rsj", dir="/tmp"))
    home = Path(tempfile.mkdtemp(prefix="rsjhome", dir="/tmp"))
    ports = {"RAYSFT_LOCAL_PORT": free_port(), "RAYSFT_LOCAL_DASHBOARD_PORT": free_port(),
             "RAYSFT_LOCAL_CLIENT_PORT": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    # 1 CPU per node: the demo's 2 workers must take one on each node.
    env.update({k: str(v) for k, v in ports.items()}, RAYSFT_LOCAL_DIR=str(state), RAYSFT_LOCAL_CPUS="1")
    mark = None
    # `ray stop` would kill any process named like Ray's; local.sh stop must end only those its cluster started
    fake_raylet = home / "raylet"
    shutil.copy("/bin/sleep", fake_raylet)
    bystander = subprocess.Popen([str(fake_raylet), "900"])
    try:
        started = subprocess.run([str(LOCAL_SH), "start", "1"], env=env, timeout=300, capture_output=True, text=True)
        assert started.returncode == 0, started.stdout + started.stderr
        mark = (state / "mark").read_text().strip()
        yield Cluster(state, f"http://127.0.0.1:{ports['RAYSFT_LOCAL_DASHBOARD_PORT']}", state / "auth_token",
                      mark, env, home, started.stdout, bystander)
    finally:
        bystander.kill()
        bystander.wait()
        # Whatever happened: local.sh's own stop, then SIGKILL to any process of this cluster still running. By
        # PID only; never `ray stop`, which would end every Ray process of the machine.
        subprocess.run([str(LOCAL_SH), "stop"], env=env, timeout=180, capture_output=True)
        if mark:
            for pid in cluster_pids(state, mark):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(1800)
def test_ray_job_submit_trains_on_both_nodes_and_needs_the_token(cluster, tmp_path):
    nonce = uuid.uuid4().hex[:8]
    storage, name = tmp_path / "runs", "job"
    run_dir = storage / name
    assert f"ray job submit --address {cluster.dashboard} --working-dir . -- python jobs/sft.py" in cluster.started
    assert [line.split()[0] for line in (cluster.state / "sessions").read_text().splitlines()] == ["head", "worker1"]
    assert http_status(f"{cluster.dashboard}/api/jobs/") == 401  # the job API wants the token
    assert http_status(f"{cluster.dashboard}/api/jobs/", cluster.token_path.read_text().strip()) == 200

    # No token, or a wrong one: refused before anything is uploaded or started.
    rc, out = submit(cluster, f"refused-{nonce}", "python", "jobs/sft.py", *DEMO, "--set",
                     f"run.storage_path={storage}", token=False)
    assert rc != 0 and "Unauthorized: Missing authentication token" in out, out[-3000:]
    rc, out = submit(cluster, f"forged-{nonce}", "python", "jobs/sft.py", *DEMO, "--set",
                     f"run.storage_path={storage}", token=False, RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN=uuid.uuid4().hex * 2)
    assert rc != 0 and "Forbidden: Invalid authentication token" in out, out[-3000:]
    token = cluster.token_path.read_text().strip()
    for refused in (f"refused-{nonce}", f"forged-{nonce}"):
        assert http_status(f"{cluster.dashboard}/api/jobs/{refused}", token) == 404  # no such job
    assert not storage.exists()

    # `python` in an entrypoint is the interpreter of the venv that runs the cluster, and it imports raysft from
    # the uploaded working dir (not from the editable install in that venv).
    rc, out = submit(cluster, f"probe-{nonce}", "python", "-c",
                     "import sys, raysft; print('probe:', sys.executable, raysft.__file__)")
    assert rc == 0, out[-3000:]
    exe, module = re.search(r"^probe: (\S+) (\S+)$", out, re.M).groups()
    assert Path(exe).parent == RAY.parent, out
    package = Path(module).parent.parent
    head_packages = cluster.state / "head" / "session_latest" / "runtime_resources" / "working_dir_files"
    assert package.parent.resolve() == head_packages.resolve(), module
    assert package.name.startswith("_ray_pkg_") and Path(module) == package / "raysft" / "__init__.py"

    # What was uploaded: the sources, not the venv, the runs, .git or anything else git ignores; far below the
    # upload limit (512 MiB, Ray's gRPC message size).
    files = [p.relative_to(package) for p in package.rglob("*") if p.is_file()]
    for needed in ("jobs/sft.py", "jobs/configs/demo.yaml", "raysft/launch/ray_driver.py",
                   "raysft/assets/demo/tokenizer"):
        assert any(str(f).startswith(needed) for f in files), needed
    assert not {f.parts[0] for f in files} & {".venv", "runs", ".git"}
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--stdin"], input="\n".join(map(str, files)),
                             capture_output=True, text=True)
    assert ignored.returncode in (1, 128) and not ignored.stdout, f"uploaded what git ignores:\n{ignored.stdout}"
    size = sum((package / f).stat().st_size for f in files)
    assert size < 16 * 2**20, f"the working dir upload is {size / 2**20:.1f} MiB"

    # The demo, shrunk: 6 steps, checkpoints at 3 and 6, one worker on each node; its tokenizer by a path relative
    # to the job's working directory, where the entrypoint runs (the workers run elsewhere, and had not found it).
    first = f"sft-{nonce}"
    rc, out = submit(cluster, first, "python", "jobs/sft.py", *DEMO, "--set", "train.max_steps=6", "--set",
                     f"run.storage_path={storage}", "--set", f"run.name={name}",
                     "--set", "model.tokenizer=raysft/assets/demo/tokenizer")
    assert rc == 0, out[-5000:]
    rc, out = ray_cli(cluster, "job", "status", "--address", cluster.dashboard, first)
    assert rc == 0 and f"Job '{first}' succeeded" in out, out
    assert (run_dir / "checkpoint_00000006" / "manifest.json").is_file()
    rc, logs = ray_cli(cluster, "job", "logs", "--address", cluster.dashboard, first)
    assert rc == 0, logs
    for line in (f"raysft: data store {storage}/datasets/", f"raysft: run {name} in {run_dir}",
                 "raysft: start world_size=2",  # rank 0's lines, from a Ray Train worker on whichever node
                 "step 6/6 | loss",
                 f"raysft: latest checkpoint {run_dir}/checkpoint_00000006"):
        assert line in logs, f"{line!r} not in the job's logs:\n{logs[-5000:]}"
    # The Train workers ran on both nodes: the worker node has the working dir too. (Its package name is the hash
    # of the files, which differs from the probe's if the checkout changed in between.)
    worker_packages = cluster.state / "worker1" / "session_latest" / "runtime_resources" / "working_dir_files"
    assert list(worker_packages.glob("_ray_pkg_*/jobs/sft.py")), list(worker_packages.glob("*"))
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r] == [1, 2, 3, 4, 5, 6]
    # the relative path was resolved once, on the driver, in the job's working directory on the head: the workers
    # got the absolute path (raysft.launch.paths)
    tokenizer = Path(json.loads((run_dir / "raysft_run.json").read_text())["model.tokenizer"])
    assert tokenizer.is_relative_to(head_packages.resolve()) and tokenizer.parts[-4:] == (
        "raysft", "assets", "demo", "tokenizer"), tokenizer

    # local.sh stop ends every process of the cluster, those the jobs started included.
    ours = cluster_pids(cluster.state, cluster.mark)
    assert len(ours) >= 6, ours  # 2 raylets, the GCS, dashboards, Ray workers...
    stopped = subprocess.run([str(LOCAL_SH), "stop"], env=cluster.env, timeout=180, capture_output=True, text=True)
    assert stopped.returncode == 0 and "stopped the cluster" in stopped.stdout, stopped.stdout + stopped.stderr
    deadline = time.monotonic() + 30  # SIGKILLed processes may wait a moment for init to reap them
    while any(running(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for p in ours if running(p)] == []
    assert cluster_pids(cluster.state, cluster.mark) == set()
    assert not (cluster.state / "mark").exists()
    assert cluster.bystander.poll() is None, "local.sh stop killed a process it did not start"
    again = subprocess.run([str(LOCAL_SH), "stop"], env=cluster.env, timeout=60, capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout + again.stderr
