import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s, and each ray.train.report (every checkpoint) waits for a
# poll. Tests checkpoint often, so they poll faster; the driver passes this on to the controller and workers.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATASETS = REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One local Ray per test module (4 logical CPUs: room for 2 workers and a second concurrent task)."""
    import ray

    # workers import worker functions from the test modules, so they need tests/ on their path
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}})
    yield
    ray.shutdown()


def start_cluster(head_temp_dir, **head_args):
    """A ray.cluster_utils.Cluster whose head keeps its state in head_temp_dir. Cluster also writes the head's
    address into Ray's default temp dir (/tmp/ray), which does not exist on a fresh machine: make it first."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    Path(get_default_ray_temp_dir()).mkdir(parents=True, exist_ok=True)
    return Cluster(initialize_head=True, head_node_args={"include_dashboard": False, "temp_dir": str(head_temp_dir),
                                                        **head_args})


def tiny_config(tmp_path, **sections):
    """The demo, shrunk to seconds: short sequences, few steps, storage in tmp_path."""
    from raysft.config import load_config

    overrides = {"data.max_seq_len": 96, "train.max_steps": 20, "train.warmup_steps": 2,
                 "train.log_every_n_steps": 5, "checkpoint.every_n_steps": 10, "run.name": "t",
                 "run.storage_path": str(tmp_path / "runs"), **sections}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def run_workers(fn, loop_config: dict, tmp_path, num_workers: int = 2):
    """Run `fn` on a plain TorchTrainer (gloo), for tests that need to look inside the workers."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(fn, train_loop_config=loop_config, torch_config=TorchConfig(backend="gloo"),
                        scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": 1}),
                        run_config=RunConfig(name="probe", storage_path=str(tmp_path / "probe_runs"))).fit()


@contextlib.contextmanager
def cli_env():
    """The environment of a `raysft` command that starts its own local Ray: no RAY_ADDRESS, and Ray's state in a
    short directory (its socket paths must stay under 108 bytes)."""
    short = tempfile.mkdtemp(prefix="r", dir="/tmp")
    try:
        yield {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": short}
    finally:
        shutil.rmtree(short, ignore_errors=True)


def run_cli(*args, env, input=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raysft", *args], env=env, cwd=REPO, input=input,
                          capture_output=True, text=True, timeout=timeout)


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent (init) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:  # straight to 127.0.0.1, whatever http_proxy says
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
