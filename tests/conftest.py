import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import netns_cluster as netns
import pytest
from netns_cluster import running  # noqa: F401 - for the tests: `from conftest import running`

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s), and a worker's
# ray.train.report waits for the poll that takes the previous report. Tests checkpoint often, so they poll every
# 0.25 s. Only speed depends on it: a poll that outlasts the interval is awaited in the next round and counts as
# failed only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min); "A worker health check failed" means the
# worker process died. A full run at Ray's 2 s (25 min on 2 cores) failed only where a worker process died.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Every launch takes its run's lease: it writes the lease and reads it back after RAYSFT_LEASE_SETTLE_S (1 s), so
# that of two launches racing for one run only one goes on. Tests run one launch of a run at a time, except
# tests/test_lease.py, which races them with its own settings; a tenth of that is plenty on a local disk.
os.environ.setdefault("RAYSFT_LEASE_SETTLE_S", "0.1")
# Ray Train starts a preemption watcher (an actor polling Ray for draining nodes) with every worker group, and
# reports metrics from the controller and the workers. One test reads the watcher's notices (test_faults_cluster's
# drained node: it turns the watcher back on); no test reads Ray Train's metrics. Each worker group's start costs a
# process less without them. A `raysft` command the tests type as a user would (cli_env) keeps Ray's defaults.
WITHOUT_RAY_TRAIN_EXTRAS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_METRICS_ENABLED": "0"}
for _key, _value in WITHOUT_RAY_TRAIN_EXTRAS.items():
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parent.parent
# Real files from other projects (chat templates, a ShareGPT file), vendored with their sources: tests/data/README.md
TEST_DATA = REPO / "tests" / "data"


_probe_file: list[str] = []
_xdist_controller: list[bool] = []  # pytest-xdist's controller reports its workers' tests: the probe skips them


def pytest_configure(config):
    _xdist_controller.append(bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput"))
    if hasattr(config, "workerinput"):
        # `make test` runs two pytest processes on the machine's cores: each computes on one thread (and so do the
        # processes it starts), as a Ray worker with 1 CPU does, instead of torch's threads waiting on each other
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_runtest_logstart(nodeid, location):
    """With RAYSFT_SUITE_PROBE set (bench/suite_times.py sets it), at each test file's first test in a process that
    runs tests: the machine's load and swap, and what earlier files left running (this process's descendants, by
    name)."""
    path = os.environ.get("RAYSFT_SUITE_PROBE")
    name = Path(location[0]).name
    if not path or any(_xdist_controller) or (_probe_file and _probe_file[-1] == name):
        return
    _probe_file.append(name)
    import psutil

    left: dict[str, int] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            label = " ".join(a.rsplit("/", 1)[-1] for a in child.cmdline()[:3] if a)[:60]
        except psutil.Error:
            continue
        left[label] = left.get(label, 0) + 1
    record = {"file": name, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "time": round(time.time(), 1),
              "load1": round(os.getloadavg()[0], 2),
              "swap_mib": psutil.swap_memory().used // 2**20, "left": left}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# Session fixtures that hold processes (a Ray head, the namespace cluster, the gloo pools): each is stopped right after
# the last test of its stream that asks for it, not at the session's end, so that no test runs beside an idle
# cluster it does not use. A test that asks for one later, through request.getfixturevalue, starts it again.
RELEASED_AFTER_LAST_USER = ("ray_head", "netns_cluster", "gloo_pool", "gloo_pool4")
_last_user: dict[tuple[str, str], pytest.Item] = {}  # (stream, fixture): its last user


# The files whose tests use the suite's Ray clusters or run its Ray scenarios: `make test` runs them in one pytest
# process (the `ray` stream) beside the rest (the `cpu` stream), with pytest-xdist; a Ray test waits on Ray's
# processes and health checks for much of its time, in which the other stream computes. Files whose subprocesses
# start a Ray of their own and need nothing of the suite's (test_bench's benchmarks, test_gpu_bundle's venv) run in
# the `cpu` stream: the two streams then take about as long (measured: docs/dev/TESTING.md). A test that takes a Ray
# cluster fixture in a file not listed fails the collection.
RAY_FILES = frozenset({"test_checkpoint_ray.py", "test_cli.py", "test_data.py", "test_dpo_path.py",
                       "test_faults_cluster.py", "test_job_submit.py", "test_live_ray.py", "test_multinode.py",
                       "test_signals.py", "test_storage.py", "test_train_ray.py"})


def _stream(path: str | Path) -> str:
    return "ray" if Path(path).name in RAY_FILES else "cpu"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadgroup`: the two streams are the work units (pytest-xdist's own loadgroup reads marks that it
    can no longer attach to pytest 9's test ids)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Streams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _stream(nodeid.split("::", 1)[0])

    return Streams(config, log)


def pytest_collection_modifyitems(items):
    """A test that takes a Ray cluster fixture is slow: `make test-fast` (-m "not slow") leaves it out. Modules
    that start Ray in other ways (clusters, fault scenarios, `raysft train`) mark themselves. Each stream runs its
    tests in this order, the `cpu` stream first in one pytest process: in the `ray` stream, the tests that share a
    cluster one after another (the suite's Ray head, then the namespace cluster), in the order of their files
    otherwise."""
    for item in items:
        if {"ray_cluster", "netns_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
            if _stream(item.path) != "ray":
                raise pytest.UsageError(f"{item.nodeid} uses a Ray cluster: add its file to conftest's RAY_FILES")
    on_head = {item.path for item in items if "ray_head" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: (_stream(item.path) == "ray", _cluster_group(item, on_head)))
    for item in items:
        for name in RELEASED_AFTER_LAST_USER:
            if name in getattr(item, "fixturenames", ()):
                _last_user[(_stream(item.path), name)] = item


def _cluster_group(item, on_head: set) -> int:
    """0: starts no Ray; 1: starts Ray of its own; 2: the suite's Ray head, with the slow tests of the files that use
    it (a module's fixtures, such as test_storage's S3 server and gloo pair, then start once); 3: the namespace
    cluster."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if "netns_cluster" in fixtures:
        return 3
    if not item.get_closest_marker("slow"):
        return 0
    return 2 if item.path in on_head else 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown: stop what RELEASED_AFTER_LAST_USER holds when this was its last user."""
    try:
        return (yield)
    finally:
        for name in (n for (_, n), last in _last_user.items() if last is item):
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                fixturedef.finish(item._request)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """One local Ray for the whole suite (4 logical CPUs: room for 2 workers and a second concurrent task), started
    when a module first asks for ray_cluster: a head's start and stop cost seconds on 2 cores, and modules use it
    one after another. Modules that need a cluster of another shape (nodes added and removed, system settings)
    start their own; connecting to one of those in between and back here works. (A Ray started in this process
    by ray.init in between, instead, left the next Ray Train run here failing to start its controller: an
    in-process local Ray belongs in a subprocess.) Its object store is sized as ray.init's would be."""
    head = start_cluster(tmp_path_factory.mktemp("ray"), num_cpus=4, object_store_memory=None)
    yield head
    head.shutdown()


@contextlib.contextmanager
def ray_connection(address: str, env_vars: dict[str, str] | None = None, setup_hook: str | None = None):
    """This process connected to the Ray at address as a job of its own, whose tasks and actors get env_vars (and
    run setup_hook, Ray's worker_process_setup_hook, when they start); disconnecting ends the job and, with it,
    every task and actor it started (a detached one of Ray's stays)."""
    import ray

    # workers import worker functions from the test modules, so they need tests/ on their path
    env = {"env_vars": {"PYTHONPATH": f"{REPO / 'tests'}:{REPO}", **(env_vars or {})}}
    ray.init(address=address, runtime_env={**env, **({"worker_process_setup_hook": setup_hook} if setup_hook else {})})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_head):
    """The suite's Ray, connected for one test module."""
    with ray_connection(ray_head.address):
        yield



@pytest.fixture(scope="session")
def netns_cluster():
    """One Ray cluster of 2 real nodes (a network namespace and an IP each, 2 logical CPUs each) for every test that
    needs nodes Ray tells apart (tests/netns_cluster.py); skipped, with the reason, where namespaces cannot be made
    (not root, no CAP_NET_ADMIN). Tests that break a node bring it back before they end."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"no network-namespace cluster: {reason}")
    cluster = netns.start(2, cpus=2, ray_env=netns.NODE_DEATH_ENV)
    try:
        yield cluster
    finally:
        cluster.down()


def start_cluster(head_temp_dir: Path, **head_args):
    """A ray.cluster_utils.Cluster whose head keeps its state in a short directory of /tmp, linked from head_temp_dir
    and removed at its shutdown: Ray's socket paths must stay under 108 bytes, and pytest's temp paths leave few (one
    level deeper, as pytest-xdist makes them, left none). Cluster also writes the head's address into Ray's default
    temp dir (/tmp/ray), which does not exist on a fresh machine: make it first."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    Path(get_default_ray_temp_dir()).mkdir(parents=True, exist_ok=True)
    state = tempfile.mkdtemp(prefix="rsc", dir="/tmp")
    Path(head_temp_dir, "ray-state").symlink_to(state)
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, "temp_dir": state,
                                                            **head_args})
    shutdown = cluster.shutdown

    def shutdown_and_remove_state() -> None:
        shutdown()
        shutil.rmtree(state, ignore_errors=True)

    cluster.shutdown = shutdown_and_remove_state
    return cluster


def tiny_config(tmp_path, **sections):
    """The demo, shrunk to seconds: short sequences, few steps of 8 samples (in micro-batches of 2: a step for 1, 2
    or 4 ranks; each micro-batch costs its own passes, and at 16 samples in 4s the suite's training took a third
    longer), storage in tmp_path. A key given as None keeps its default."""
    from raysft.config import load_config

    overrides = {"data.max_seq_len": 96, "train.max_steps": 20, "train.warmup_steps": 2,
                 "train.global_batch_size": 8, "train.micro_batch_size": 2,
                 "train.log_every_n_steps": 5, "checkpoint.every_n_steps": 10, "run.name": "t",
                 "run.storage_path": str(tmp_path / "runs"), **sections}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items() if v is not None])  # None: the default


@contextlib.contextmanager
def promise(name: str):
    """One promise of a scenario test that checks several in one launch: a failed assertion inside names it first,
    so that the failure still says which promise broke."""
    try:
        yield
    except (AssertionError, pytest.fail.Exception) as e:  # an assert, or pytest.raises that saw nothing raised
        raise AssertionError(f"broken promise: {name}: {e}") from e


def assert_close_but_for_rare_elements(actual, expected, *, rtol: float, atol: float, bound: float,
                                       fraction: float = 1e-3, what: str = "") -> None:
    """Weights after Adam steps, held to a reference computed in another layout (other ranks, another summation
    order, another CPU's kernels): Adam divides each element's step by its own gradient's size, so rounding in an
    element whose gradients nearly cancel can move it by up to a step's full size, however small the rounding. A few
    such elements are rounding; a lost, doubled or misplaced gradient moves most elements. So: every element within
    `bound` (a step's size), and all but `fraction` of them within atol + rtol * |expected|."""
    diff = (actual - expected).abs()
    off = diff > atol + rtol * expected.abs()
    assert float(diff.max()) <= bound and int(off.sum()) <= fraction * off.numel(), (
        f"{what}: {int(off.sum())} of {off.numel()} elements beyond atol {atol:g} + rtol {rtol:g}, the most by "
        f"{float(diff.max()):.3g} (bound {bound:g})")


def model_file(directory: Path, **architecture) -> str:
    """A config.json for model.config: the demo-tiny preset with the demo tokenizer's vocabulary, changed by
    `architecture` (LlamaConfig's keys), for tests that need a model the preset is not (dropout, uneven shapes)."""
    from transformers import LlamaConfig

    from raysft.data.tokenizer import load_tokenizer
    from raysft.model.build import preset_config

    base = tiny_config(directory)
    config = preset_config("demo-tiny", load_tokenizer(base.model, base.data.chat_template)).to_dict()
    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**{**config, **architecture}).to_json_file(directory / "config.json")
    return str(directory / "config.json")


STEPS = 12  # the checkpoint and resume tests' runs: 12 steps, a checkpoint every 3


def run_config(tmp_path, name, **sets):
    """A run of STEPS steps that checkpoints every 3, for the checkpoint and resume tests."""
    return tiny_config(tmp_path, **{"train.max_steps": STEPS, "checkpoint.every_n_steps": 3, "run.name": name,
                                    "train.log_every_n_steps": 100, **sets})


def step_losses(run_dir) -> list[tuple[int, float]]:
    from raysft.training.metrics import read_metrics

    return [(m["step"], m["loss"]) for m in read_metrics(run_dir) if "loss" in m]


def final_weights(run_dir, out: Path) -> dict:
    """The weights of the run's last checkpoint, as `raysft export` writes them."""
    from safetensors.torch import load_file

    import raysft
    from raysft.checkpoint import checkpoint_dirs

    raysft.export(checkpoint_dirs(run_dir)[-1], out)
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="session")
def uninterrupted(gloo_pool, tmp_path_factory):
    """The checkpoint and resume tests' reference: run_config's STEPS steps in one launch without Ray (full
    checkpoints): its per-step losses and final weights, which every stopped, faulted or resumed run (under torchrun
    or Ray, from any tier) must equal float for float."""
    from raysft.launch.torchrun import launch

    tmp = tmp_path_factory.mktemp("reference")
    cfg = run_config(tmp, "reference", **{"checkpoint.mode": "full"})
    gloo_pool.run(launch, cfg)
    return step_losses(cfg.run_dir), final_weights(cfg.run_dir, tmp / "hf")


def run_workers(fn, loop_config: dict, tmp_path, num_workers: int = 2):
    """Run `fn` on a plain TorchTrainer (gloo), for tests that need to look inside the workers."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(fn, train_loop_config=loop_config, torch_config=TorchConfig(backend="gloo"),
                        scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": 1}),
                        run_config=RunConfig(name="probe", storage_path=str(tmp_path / "probe_runs"))).fit()


@contextlib.contextmanager
def cli_env():
    """The environment of a `raysft` command that starts its own local Ray: no RAY_ADDRESS, Ray Train's own defaults
    (as a user has them), and Ray's state in a short directory (its socket paths must stay under 108 bytes)."""
    short = tempfile.mkdtemp(prefix="r", dir="/tmp")
    try:
        yield {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in WITHOUT_RAY_TRAIN_EXTRAS},
               "RAY_TMPDIR": short}
    finally:
        shutil.rmtree(short, ignore_errors=True)


def run_cli(*args, env, input=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raysft", *args], env=env, cwd=REPO, input=input,
                          capture_output=True, text=True, timeout=timeout)


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`raysft ARGS` as run_cli gives it back (exit code, stdout, stderr), from the console script's own main() in
    this process: a process start costs seconds of imports. For commands that start no Ray: prepare, export, chat
    --prompt, report, and a train refused before it would."""
    import io

    from raysft.cli import main

    def ray_connected() -> bool:  # the GPU machine has no Ray: then nothing can have started one
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    connected = ray_connected()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    assert ray_connected() == connected, "cli_in_process is for commands that start no Ray"
    return subprocess.CompletedProcess(["raysft", *args], code, out.getvalue(), err.getvalue())


def train_ends_in_one_line(cfg, config_file: Path, code: int, line: str) -> None:
    """`raysft train CONFIG` (the config written to config_file), in this process on the Ray it is connected to,
    ends with exit `code`, no traceback, and stderr's last line matching the regular expression `line`."""
    import yaml

    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    done = cli_in_process("train", str(config_file))
    lines = [text for text in done.stderr.splitlines() if text.strip()]
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines and re.fullmatch(line, lines[-1]), lines


def http_status(url: str, token: str | None = None, attempts: int = 3) -> int:
    """The HTTP status `url` answers with; a request that timed out is asked again (a loaded 2-core machine has
    kept Ray's dashboard from answering one in 30 s)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    for attempt in range(attempts):
        try:  # straight to 127.0.0.1, whatever http_proxy says
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except TimeoutError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class GlooPool:
    """Worker processes joined in one gloo process group, started once and reused: each `run(fn, ...)` calls fn
    on every rank, as a launch of raysft.run would, without a process start, imports or Ray per launch. fn must be
    importable (a module-level function); it gets the rank's WorkerContext first.

    A worker that dies (once in many suites, torch's gloo thread segfaulted in a worker that had trained dozens of
    runs) fails the task it was running at once, naming the rank and its exit code, and the pool starts fresh
    processes for the next task: the other workers would otherwise wait in a collective, and every later test
    on the pool with them."""

    # seen in a suite: of two ranks that killed themselves at the same step, the pool saw one dead, and said so,
    # before the other had ended
    DEATHS_SETTLE_S = 3.0

    def __init__(self, world_size: int, tmp_dir: Path):
        self.world_size, self.tmp_dir, self.starts = world_size, tmp_dir, 0
        self._start()

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        self.starts += 1
        init = f"file://{self.tmp_dir / f'pg{self.starts}'}"  # a fresh rendezvous for each start
        self.procs = [ctx.Process(target=_gloo_worker, args=(r, self.world_size, init, self.tasks[r], self.results),
                                  daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()

    def _restart(self) -> None:
        for p in self.procs:  # this pool's own processes, by their handles
            p.kill()
            p.join(timeout=30)
        self._start()

    def run(self, fn, *args, timeout: float = 600):
        import queue

        for q in self.tasks:
            q.put((fn, args))
        out: dict = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(self.procs):
            try:
                rank, value = self.results.get(timeout=1)
                out[rank] = value
                continue
            except queue.Empty:
                pass
            dead = self._dead()
            if dead:  # ranks that die together (a node's) end moments apart: name them all
                time.sleep(self.DEATHS_SETTLE_S)
                dead = self._dead()
            if dead or time.monotonic() > deadline:
                self._restart()
                raise RuntimeError(f"gloo pool: worker(s) died (rank: exit code, negative is the signal): {dead}"
                                   if dead else f"gloo pool: no result from every rank within {timeout} s")
        errors = [v for v in out.values() if isinstance(v, BaseException)]
        if errors:
            raise errors[0]
        return [out[r] for r in range(len(self.procs))]

    def _dead(self) -> dict[int, int]:
        return {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _gloo_worker(rank: int, world_size: int, init: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # a rank that fails leaves the others in a collective: they give up after this instead of hanging the suite
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    from raysft.training.trainer import WorkerContext

    ctx = WorkerContext(rank, world_size, torch.device("cpu"))
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, fn(ctx, *args)))
        except BaseException as e:  # noqa: BLE001 - the test raises it
            results.put((rank, RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")))
    dist.destroy_process_group()


@contextlib.contextmanager
def gloo_processes(world_size: int, tmp_dir: Path):
    pool = GlooPool(world_size, tmp_dir)
    try:
        yield pool
    finally:
        pool.close()


# One pool of each size for the whole suite: every module that trains without Ray shares them (a pool's start is
# world_size processes importing torch and transformers). A module whose processes need a different environment
# starts its own with gloo_processes (tests/test_storage.py).
@pytest.fixture(scope="session")
def gloo_pool(tmp_path_factory):
    with gloo_processes(2, tmp_path_factory.mktemp("gloo")) as pool:
        yield pool


@pytest.fixture(scope="session")
def gloo_pool4(tmp_path_factory):
    with gloo_processes(4, tmp_path_factory.mktemp("gloo4")) as pool:
        yield pool


@pytest.fixture(scope="session")
def uninterrupted4(gloo_pool4, tmp_path_factory):
    """`uninterrupted` on 4 ranks (FULL_SHARD: on any nodes)."""
    from raysft.launch.torchrun import launch

    tmp = tmp_path_factory.mktemp("reference4")
    cfg = run_config(tmp, "reference", **{"checkpoint.mode": "full"})
    gloo_pool4.run(launch, cfg)
    return sorted(step_losses(cfg.run_dir)), final_weights(cfg.run_dir, tmp / "hf")


@pytest.fixture(scope="session")
def faulted(gloo_pool, tmp_path_factory):
    """The memory tier's tests' fault (tests/memory_tier_support.py): a run with a snapshot every step, each rank on
    a node of its own, whose rank 1 died after step 8, its run directory and snapshots as the fault left them; each
    test continues a copy of it (one fault, and one restart of the pool's processes, for all)."""
    from memory_tier_support import faulted_run

    return faulted_run(gloo_pool, tmp_path_factory.mktemp("faulted"))


def lighthouse_heartbeats(lighthouse: str) -> int:
    """How many replica groups a torchft Lighthouse hears now (its status page counts them)."""
    return lighthouse_status(lighthouse)[1]


def lighthouse_status(lighthouse: str) -> tuple[int, int]:
    """A torchft Lighthouse's groups asking for the next quorum, and the groups it hears (its status page)."""
    import re
    import urllib.request

    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    asking = re.search(r"\[(\d+)/\d+ participants healthy\]", status)
    heard = re.search(r"\[(\d+) heartbeating\]", status)
    assert asking and heard, f"the Lighthouse's status page no longer counts participants: {status[:500]}"
    return int(asking[1]), int(heard[1])
