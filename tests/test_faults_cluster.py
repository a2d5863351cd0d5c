"""Faults injected into real training runs on a multi-node Ray cluster on one machine: a head with no CPUs and
worker nodes that each test adds and removes (ray.cluster_utils.Cluster). Each test proves that the fault costs
at most the steps since the last complete checkpoint: the run finishes with the same per-step losses and
bit-identical weights as an uninterrupted run of the same topology.

With RAYSFT_FAULT_REPORT=FILE, each test appends what it measured (steps lost, seconds from fault to the first
step after resuming) to FILE as a JSON line: docs/RELIABILITY.md is made from it.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from conftest import REPO, promise, start_cluster, tiny_config
from fault_injection import COORDINATOR_TICK_S, FAULTS_ENV, arm
from safetensors.torch import load_file

import raysft
from raysft.checkpoint import checkpoint_dirs
from raysft.config import ConfigError
from raysft.launch.ray_driver import CannotPlaceWorkers
from raysft.training.metrics import read_metrics

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

STEPS, EVERY = 24, 6
# Ray Train's timings, shortened for tests (the driver passes them on to Ray's controller and workers).
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
                 "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
# Ray's GCS, likewise: a node whose raylet was killed is declared dead after two failed health checks 0.5 s apart
# (Ray's default: five, 3 s apart). Until then its CPUs still count, and the restarted worker group waits for them.
# A check fails at once on a dead raylet; a slow but live one has health_check_timeout_ms (10 s) to answer.
NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    faults = tmp_path_factory.mktemp("faults")
    saved = {k: os.environ.get(k) for k in RAY_TRAIN_ENV}
    os.environ.update(RAY_TRAIN_ENV)
    head = start_cluster(tmp_path_factory.mktemp("ray"), num_cpus=0, _system_config=NODE_DEATH)
    ray.init(address=head.address, runtime_env={
        "env_vars": {"PYTHONPATH": f"{REPO / 'tests'}:{REPO}", FAULTS_ENV: str(faults), **RAY_TRAIN_ENV},
        "worker_process_setup_hook": "fault_injection.install"})
    head.faults = faults
    yield head
    ray.shutdown()
    head.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def nodes(cluster):
    """Adds worker nodes of 2 CPUs for one test and removes those still there afterwards."""
    added = []

    def add(num_cpus: int = 2):
        node = cluster.add_node(num_cpus=num_cpus)
        added.append(node)
        cluster.wait_for_nodes()
        return node

    yield add
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)
    for f in cluster.faults.iterdir():
        f.unlink()


def config(tmp_path, name, **sets):
    return tiny_config(tmp_path, **{"train.max_steps": STEPS, "checkpoint.every_n_steps": EVERY, "run.name": name,
                                    # a row in metrics.jsonl at every step: the tests time faults by them
                                    "train.log_every_n_steps": 1, "checkpoint.mode": "full",
                                    "scaling.max_failures": 2, **sets})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    """Uninterrupted runs, by number of workers: per-step losses and final weights. Trained without Ray, on gloo
    processes: the same Trainer and collectives give the same floats (tests/test_checkpoint_ray.py holds a Ray
    run to exactly that), and no Ray launch is spent on them. With widths=((step, workers), ...): stopped at each
    step and relaunched from its stored checkpoint on that many workers, the run an elastic run that changed width
    there is held to."""
    from raysft.launch.torchrun import launch

    runs = {}

    def get(workers: int, widths: tuple[tuple[int, int], ...] = (), **sets):
        key = (workers, widths, tuple(sorted(sets.items())))
        if key not in runs:
            tmp = tmp_path_factory.mktemp("reference")
            stops = [step for step, _ in widths] + [None]
            sizes = [workers] + [n for _, n in widths]
            for num_workers, stop in zip(sizes, stops, strict=True):
                leg = {"train.stop_at_step": stop} if stop else {}
                cfg = config(tmp, "reference", **{"scaling.num_workers": num_workers, **sets, **leg})
                request.getfixturevalue("gloo_pool4" if num_workers == 4 else "gloo_pool").run(launch, cfg)
            runs[key] = (final_losses(cfg.run_dir), load_file(cfg.run_dir / f"checkpoint_{cfg.train.max_steps:08d}" /
                                                              "model.safetensors"))
        return runs[key]

    return get


def final_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Each step's loss from the pass that counted: a step trained again after a resume replaces the lost one."""
    losses = {}
    for m in read_metrics(run_dir):
        if "loss" in m:
            losses[m["step"]] = m["loss"]
    return sorted(losses.items())


def assert_same_run(cfg, result, reference) -> None:
    ref_losses, ref_weights = reference
    assert final_losses(cfg.run_dir) == ref_losses
    weights = load_file(Path(result.checkpoint.path) / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def last_step(run_dir: Path) -> int:
    try:
        return max((m["step"] for m in read_metrics(run_dir) if "loss" in m), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout}s for {what}")


def train_worker_pids() -> list[int]:
    """The Ray Train workers of this test's cluster: descendants of this process (its raylets' workers), never
    another Ray's on the same machine."""
    import psutil

    pids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith("ray::RayTrainWorker"):  # Ray's process title
                pids.append(child.pid)
        except psutil.Error:
            pass
    return pids


class Background:
    """raysft.train in a thread, so the main thread can add and remove nodes (Ray needs that on the main thread)."""

    def __init__(self, cfg, **kw):
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(cfg,), kwargs=kw, daemon=True)
        self.thread.start()

    def _run(self, cfg, **kw):
        try:
            self.result = raysft.train(cfg, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised in join
            self.error = e

    def join(self, timeout: float = 600):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        if self.error:
            raise self.error
        return self.result


def recovery(run_dir: Path, fault_time: float, fault: str, how: str, every: int = EVERY) -> dict:
    """Steps lost (trained before the fault, after the checkpoint it resumed from) and seconds until training
    went on, for the first resume after the fault; appended to $RAYSFT_FAULT_REPORT if set."""
    records = read_metrics(run_dir)
    resume = next(i for i, m in enumerate(records) if m.get("event") == "resume" and m["time"] >= fault_time)
    # the last step logged before it (after a change of width, the run went on from an earlier step: not the most)
    before = [m for m in records[:resume] if "loss" in m][-1]["step"]
    first_after = next(m for m in records[resume:] if "loss" in m)
    row = {"fault": fault, "how": how, "resumed_from": records[resume]["step"], "last_step_before": before,
           "steps_lost": before - records[resume]["step"], "checkpoint_every": every,
           "seconds_to_next_step": round(first_after["time"] - fault_time, 1)}
    if os.environ.get("RAYSFT_FAULT_REPORT"):
        with open(os.environ["RAYSFT_FAULT_REPORT"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def ray_tracked(run_dir: Path) -> list[str]:
    """The checkpoints Ray Train's snapshot of the run names (those it prunes, and needs at the next launch)."""
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    return sorted(Path(r["checkpoint_dir_name"]).name for r in snapshot["checkpoint_results"])


def test_a_preemption_notice_saves_a_checkpoint_before_the_node_is_drained(tmp_path, nodes, reference, cluster,
                                                                           monkeypatch):
    ref = reference(2)
    # the suite turns Ray Train's preemption watcher off (tests/conftest.py); the driver passes this on to the run's
    # controller, which starts one with each worker group
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    a = nodes()
    arm(cluster.faults, "slow_steps", seconds=1.0)  # so the run is still going when the deadline comes
    cfg = config(tmp_path, "preempt", **{"checkpoint.every_n_steps": 100})
    run = Background(cfg)
    wait_for(lambda: last_step(cfg.run_dir) >= 3, 300, "step 3")
    drain = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address,
         "--node-id", a.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
         "--deadline-remaining-seconds", "8"], capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stderr
    fault_time = time.time()
    nodes()  # where the run goes next
    notice = wait_for(lambda: next((m for m in read_metrics(cfg.run_dir) if m.get("event") == "preemption_notice"),
                                   None), 60, "the preemption notice")
    wait_for(lambda: any(m.get("event") == "resume" for m in read_metrics(cfg.run_dir)), 120, "the restart")
    (cluster.faults / "slow_steps.json").unlink()
    result = run.join()
    records = read_metrics(cfg.run_dir)
    first_resume = next(i for i, m in enumerate(records) if m.get("event") == "resume")
    saved = [m["step"] for m in records[:first_resume] if m.get("event") == "checkpoint"]
    assert saved[0] == notice["step"] and 0 < notice["seconds_left"] <= 8
    row = recovery(cfg.run_dir, fault_time, "node preempted (announced)",
                   "ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 8")
    # not step 0 (checkpoint.every_n_steps is 100): the newest checkpoint saved before the node went, the notice's
    # or a last chance's. Whether a last chance fits before the deadline depends on this machine's clock; when it
    # comes, and when it is let go, is checked on a fake clock in test_trainer_modes
    assert row["resumed_from"] == saved[-1] <= row["last_step_before"]
    assert_same_run(cfg, result, ref)


def test_a_killed_worker_then_a_lost_node_then_a_new_one_each_cost_at_most_a_step_from_memory(tmp_path, nodes,
                                                                                                reference, cluster):
    """One elastic run of 4 workers with a snapshot in memory every step (scaling.min_workers 2), on uneven nodes
    (2, 1 and 1 CPUs: Ray fills each node before the next), through three faults in turn:
    - a train worker killed mid-step: the restarted group of 4 goes on from the snapshot of the step before (or
      of the one before it, if the fault came while it was written), not from the last stored checkpoint.
      Before, on such nodes, the ranks whose partner waited for another rank's copy hung the tier, and the run's
      end, until gloo's timeout;
    - the node of 2 lost for good: the run goes on on the 2 left from the snapshot cut again for 2 (the lost
      node's parts from their copies on the nodes left);
    - a node added: Ray grows the group back to 4, which goes on from the snapshot cut again for 4.
    Each costs at most the step in flight. The run equals the run stopped at the changes of width and relaunched
    on 2, then on 4, from its stored checkpoints, bit for bit; its checkpoints are those Ray tracks, pruned to
    checkpoint.keep; no snapshot is left on any node."""
    b, _, _ = nodes(2), nodes(1), nodes(1)
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= 4, 60, "4 free CPUs")  # else Ray starts with fewer
    # Ray Train's elastic policy sizes the group from Ray's AutoscalingCoordinator, which refreshes its view of the
    # nodes once per tick: without a tick since the nodes came, it sees too few and starts with fewer workers
    # (fault_injection makes the tick 1 s in these tests' workers)
    time.sleep(COORDINATOR_TICK_S + 1)
    steps = 30  # room after the second fault for Ray to see the new node before the run ends
    sets = {"scaling.min_workers": 2, "train.micro_batch_size": 1, "train.global_batch_size": 12,
            "scaling.resize_interval_s": 2, "train.max_steps": steps}
    shm = tmp_path / "shm"
    cfg = config(tmp_path, "elastic", **{"scaling.num_workers": 4, "checkpoint.memory_every_n_steps": 1,
                                         "checkpoint.memory_dir": str(shm), **sets})
    run = Background(cfg)
    wait_for(lambda: last_step(cfg.run_dir) >= EVERY + 2, 300, "step 8")
    os.kill(train_worker_pids()[-1], signal.SIGKILL)
    kill_time = time.time()
    wait_for(lambda: world_sizes(cfg.run_dir)[1:2] and last_step(cfg.run_dir) >= 2 * EVERY + 2, 300,
             "step 14 after the resume on 4 workers")
    cluster.remove_node(b, allow_graceful=False)
    lost_time = time.time()
    shrunk = wait_for(lambda: world_sizes(cfg.run_dir)[2:3], 300, "the resume on 2 workers")
    arm(cluster.faults, "slow_steps", seconds=2)  # room for Ray to notice the node before the run ends
    nodes()
    grow_time = time.time()
    wait_for(lambda: world_sizes(cfg.run_dir)[3:4], 300, "the resume on 4 workers")
    (cluster.faults / "slow_steps.json").unlink()
    result = run.join()
    records = read_metrics(cfg.run_dir)
    assert world_sizes(cfg.run_dir) == [4, 4, 2, 4] and shrunk == [2]
    resumes = [m for m in records if m.get("event") == "resume"]
    assert [m.get("tier") for m in resumes] == ["memory"] * 3, resumes
    assert not [m for m in records if m.get("event") in ("memory_tier_not_used", "memory_tier_off")]
    killed = recovery(cfg.run_dir, kill_time, "worker killed mid-step (memory tier every step)",
                      "SIGKILL to one train worker", every=1)
    lost = recovery(cfg.run_dir, lost_time, "node lost, none to replace it (elastic, memory tier every step)",
                    "remove_node with scaling.min_workers=2 of 4", every=1)
    grown = recovery(cfg.run_dir, grow_time, "a node returns (elastic, memory tier every step)",
                     "add_node: Ray grows the group from 2 to 4", every=1)
    # the snapshot of the step before the fault, or of the one before it (still being written when it came)
    assert 0 <= killed["steps_lost"] <= 2 and lost["steps_lost"] <= 1 and grown["steps_lost"] <= 1, \
        (killed, lost, grown)
    assert [s for s, _ in final_losses(cfg.run_dir)] == list(range(1, steps + 1))
    assert Path(result.checkpoint.path).name == f"checkpoint_{steps:08d}"
    # keep=2, whether or not Ray had collected a report before a fault
    assert [p.name for p in checkpoint_dirs(cfg.run_dir)] == ray_tracked(cfg.run_dir) == \
        [f"checkpoint_{steps - EVERY:08d}", f"checkpoint_{steps:08d}"]
    assert not shm.exists() or [p.name for p in shm.iterdir()] == [".raysft.lock"]  # every node's snapshots gone
    widths = ((lost["resumed_from"], 2), (grown["resumed_from"], 4))
    assert_same_run(cfg, result, reference(4, widths, **sets))


def world_sizes(run_dir: Path) -> list[int]:
    """The world size of the run's start and of each resume, in order."""
    try:
        return [m["world_size"] for m in read_metrics(run_dir) if m.get("event") in ("start", "resume")]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_live_fault_tolerance_names_a_head_without_a_cpu_for_its_lighthouse(tmp_path, nodes):
    """Ray's torchft backend pins the Lighthouse to the driver's node, here a head of no CPUs: refused by key before
    any worker starts, not reported as workers that could not be placed."""
    pytest.importorskip("torchft")
    nodes()
    with pytest.raises(ConfigError, match=r"'live.enabled'.* 0 logical CPUs"):
        raysft.train(config(tmp_path, "live-head", **{"live.enabled": True}))
    assert not checkpoint_dirs(tmp_path / "runs" / "live-head")


def test_a_busy_cluster_fails_with_a_clear_message_after_bounded_retries(tmp_path, nodes):
    nodes()

    @ray.remote(num_cpus=2)
    class Squatter:
        def ready(self):
            return True

    squatter = Squatter.remote()
    ray.get(squatter.ready.remote())
    try:
        with pytest.raises(CannotPlaceWorkers, match=r"could not start 2 workers .* in 2 attempts of 10 s "
                                                      r"\(scaling.placement_timeout_s=20\)"):
            raysft.train(config(tmp_path, "busy", **{"scaling.placement_timeout_s": 20}))
    finally:
        ray.kill(squatter)


def test_a_killed_driver_then_a_worker_killed_mid_save_then_one_lost_before_its_report_resume_exactly(
        tmp_path, nodes, reference, cluster, gloo_pool):
    """One run through the faults a user meets in turn, each resumed from the newest checkpoint that is whole:
    - the `raysft train` process killed at step 8 (its workers held first, so that the checkpoint it reached is
      known: 6): the same command again resumes from checkpoint 6;
    - that launch's rank 0 killed inside the step-12 save, its part written, no manifest, not reported: Ray
      restarts the workers, which clear the dead save's part and resume from 6 again;
    - rank 0 exits once checkpoint 18 is complete but before Ray registers it: the run resumes from 18 and
      registers it.
    The run is the uninterrupted one, bit for bit, and its directory ends at checkpoint.keep, as Ray's snapshot
    has it (Ray alone prunes). Then a launch with another seed is refused without writing anything, and --fresh
    keeps the old run beside the new one."""
    ref = reference(2)
    nodes()
    cfg = config(tmp_path, "driver")
    config_file = tmp_path / "driver.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    driver = subprocess.Popen([sys.executable, "-m", "raysft", "train", str(config_file)],
                              env={**os.environ, "RAY_ADDRESS": cluster.address}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: last_step(cfg.run_dir) >= EVERY + 2, 300, "step 8")
        for pid in train_worker_pids():
            os.kill(pid, signal.SIGSTOP)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    driver_time = time.time()
    wait_for(lambda: not train_worker_pids(), 120, "Ray to end the dead driver's workers")

    arm(cluster.faults, "pause_in_save", step=2 * EVERY)
    arm(cluster.faults, "exit_before_report", step=3 * EVERY)  # reached only after the resume from the save
    run = Background(cfg)  # the same command again
    paused = wait_for(lambda: (cluster.faults / "paused.json").is_file() and
                      json.loads((cluster.faults / "paused.json").read_text()), 300, "a save to pause")
    assert Path(paused["part"]).is_dir()  # rank 0 wrote its part; no manifest, not reported
    os.kill(paused["pid"], signal.SIGKILL)
    save_time = time.time()
    result = run.join()

    with promise("each launch and each restart resumes from the newest whole checkpoint"):
        driver_row = recovery(cfg.run_dir, driver_time, "driver killed",
                              "SIGKILL to the `raysft train` process; launched again")
        save_row = recovery(cfg.run_dir, save_time, "worker killed mid-save",
                            "SIGKILL to rank 0 inside a checkpoint save")
        assert driver_row["resumed_from"] == EVERY, driver_row
        assert save_row["resumed_from"] == EVERY and save_row["steps_lost"] == EVERY  # the step-12 save never counted
        assert not Path(paused["part"]).exists()  # the relaunched workers cleared the dead save's part
        assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == \
            [EVERY, EVERY, 3 * EVERY]
        assert_same_run(cfg, result, ref)

    with promise("the run directory keeps checkpoint.keep checkpoints, those Ray tracks"):
        assert [p.name for p in checkpoint_dirs(cfg.run_dir)] == ray_tracked(cfg.run_dir) == \
            [f"checkpoint_{STEPS - EVERY:08d}", f"checkpoint_{STEPS:08d}"]

    with promise("a launch that would overwrite the run by accident is refused, and writes nothing"):
        before = sorted(p.name for p in cfg.run_dir.rglob("*"))
        with pytest.raises(ConfigError, match="started with train.seed=0, this launch has 1.*--fresh"):
            raysft.train(config(tmp_path, "driver", **{"train.seed": 1}))
        assert sorted(p.name for p in cfg.run_dir.rglob("*")) == before

    with promise("--fresh starts the run over and keeps the old one aside"):  # the same claim without Ray
        from raysft.launch.torchrun import launch

        gloo_pool.run(launch, config(tmp_path, "driver", **{"train.seed": 1, "train.max_steps": 2}), True)
        kept = list(cfg.run_dir.parent.glob("driver.replaced-*"))
        assert len(kept) == 1 and (kept[0] / f"checkpoint_{STEPS:08d}").is_dir()
        assert [m["event"] for m in read_metrics(cfg.run_dir) if "event" in m][0] == "start"
        assert last_step(cfg.run_dir) == 2
