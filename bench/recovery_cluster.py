"""The clusters bench/recovery.py trains on and faults, and what it reads back from a run: a local Ray, logical
Ray nodes (ray.cluster_utils) or network-namespace nodes (cluster/netns.sh); a worker setup hook that times the
memory tier's step-path calls and each stage of a worker's start; each run's losses, weights and step times."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from common import train_worker_pids

# the fault tests' timings (tests/test_faults_cluster.py), used with --nodes
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
                 "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
SNAPSHOT_TIMES_ENV = "RAYSFT_BENCH_SNAPSHOT_TIMES"  # a directory: each worker's snapshot calls' durations
STAGES_ENV = "RAYSFT_BENCH_STAGES"  # a directory: each train worker's start, stage by stage
SPOIL_ENV = "RAYSFT_BENCH_SPOIL"  # a file: what the next resume finds spoiled in node memory (`spoil_at_resume`)
SPOILS = ("flip", "both", "fetch")


def worker_setup() -> None:
    """A worker_process_setup_hook. Ray Train's elastic policy sizes the group from the autoscaling coordinator's
    view of the nodes, refreshed once per tick: tick often (as tests/fault_injection.py does). With
    $RAYSFT_BENCH_SNAPSHOT_TIMES, every MemoryTier.snapshot call that takes a snapshot notes how long it held the
    training loop (the copy's start, the ranks' agreement: the part of the tier on the step's path; the file and the
    copy off the node are written in the tier's thread). With $RAYSFT_BENCH_STAGES, each train worker notes when
    its process started and when each stage of its start ended (`stage_times`)."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S = 1
    if os.environ.get(STAGES_ENV):
        stage_times(Path(os.environ[STAGES_ENV]))
    if os.environ.get(SPOIL_ENV):
        spoil_at_resume(Path(os.environ[SPOIL_ENV]))
    where = os.environ.get(SNAPSHOT_TIMES_ENV)
    if not where:
        return
    from raysft.checkpoint.memory import MemoryTier

    real = MemoryTier.snapshot

    def timed(self, state, held=()):
        began = time.perf_counter()
        taken = real(self, state, held)
        if taken:
            with (Path(where) / f"{os.getpid()}.txt").open("a") as f:
                f.write(f"{time.perf_counter() - began}\n")
        return taken

    MemoryTier.snapshot = timed


STAGES = ("process", "imports", "ray_and_process_group", "model_build", "state_load", "first_step")


def stage_times(where: Path) -> None:
    """In a Ray worker: the wall-clock time each stage of a train worker's start ends, written as one JSON line per
    worker once its first step ends (`<pid>.json`): its process started ("process", Ray's detection of the fault
    and its start of the actor before it), raysft and what it imports are loaded ("imports"), the trainer is
    entered (Ray Train's setup and the process group before it), the model and optimizer are built, the state is
    loaded (a snapshot or a stored checkpoint), and the first step ends."""
    import psutil

    marks = {"process": psutil.Process().create_time()}
    from raysft.training import trainer as trainer_module

    marks["imports"] = time.time()
    trainer_class, real_init, real_step = trainer_module.Trainer, trainer_module.Trainer.__init__, \
        trainer_module.Trainer.train_step
    real_build = trainer_module.build_optimizer

    def init(self, *args, **kwargs):
        marks["ray_and_process_group"] = time.time()
        real_init(self, *args, **kwargs)
        marks["state_load"] = time.time()

    def build_optimizer(*args, **kwargs):
        optimizer = real_build(*args, **kwargs)
        marks.setdefault("model_build", time.time())
        return optimizer

    def train_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        if "first_step" not in marks:
            marks["first_step"] = time.time()
            (where / f"{os.getpid()}.json").write_text(json.dumps({"rank": self.ctx.rank, **marks}))
        return out

    trainer_class.__init__, trainer_class.train_step = init, train_step
    trainer_module.build_optimizer = build_optimizer


def spoil_at_resume(order: Path) -> None:
    """In a Ray worker: when `order` names a spoil, the next resume from the memory tier finds rank 0's part of the
    newest step spoiled as a node's faults would leave it, before any rank lists it (the order is then used up):
      flip   one bit of its copy on rank 0's node flipped (the checksum catches it; the other copy is sent)
      both   one bit flipped in every copy (no sound copy of the step: the step before is resumed)
      fetch  its copy on rank 0's node gone, and the other node's copy gone as it is sent (the step before)"""
    import torch.distributed as dist

    from raysft.checkpoint.memory import MemoryTier, transport

    real_find, real_map = MemoryTier.find, transport.map_file
    failing: list[str] = []  # the newest step's folder, while a fetch from it is to fail once

    def map_file(path):
        if failing and failing[0] in str(path):
            failing.clear()
            raise FileNotFoundError(2, "gone as it was sent (bench/recovery.py --spoil fetch)", str(path))
        return real_map(path)

    def find(self, stored):
        kind = order.read_text().strip() if order.is_file() else ""
        steps = sorted(self.dir.glob("step_*"))
        if kind and steps:
            own = steps[-1] / "rank_0.safetensors"
            if self.rank == 0 and kind in ("flip", "both"):
                for copy in self.dir.parent.glob(f"*/{steps[-1].name}/rank_0.safetensors") if kind == "both" \
                        else [own]:
                    flip_a_bit(copy)
            if self.rank == 0 and kind == "fetch":
                own.unlink()
            failing[:] = [steps[-1].name] if kind == "fetch" else []
        dist.barrier(group=self.control)  # spoiled before any rank lists what its node holds
        try:
            return real_find(self, stored)
        finally:
            failing.clear()
            if kind and steps and self.rank == 0:
                order.unlink(missing_ok=True)

    MemoryTier.find, transport.map_file = find, map_file


def flip_a_bit(part: Path, offset_in_data: int = 1000) -> None:
    """One bit of a part's tensor data flipped in place, its header left as it was."""
    raw = bytearray(part.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + offset_in_data] ^= 0x10
    part.write_bytes(bytes(raw))


def worker_env() -> dict:
    """The train workers' environment: the bench's modules and this checkout on the path, the fault tests' Ray
    Train timings, the snapshot timing's directory."""
    here = Path(__file__).resolve().parent
    return {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]), **RAY_TRAIN_ENV,
            **{k: os.environ[k] for k in (SNAPSHOT_TIMES_ENV, STAGES_ENV, SPOIL_ENV) if k in os.environ}}


class Cluster:
    """The Ray the runs train on: a local one, or N logical nodes (--nodes) that the node faults remove and add."""

    def __init__(self, args: argparse.Namespace):
        import ray

        self.args, self.nodes = args, None
        env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent)])}
        if not args.nodes:
            ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": env})
            return
        from ray.cluster_utils import Cluster as RayCluster

        os.environ.update(RAY_TRAIN_ENV)
        # the live fault's Lighthouse runs on the head (Ray's torchft backend), which needs a CPU for it
        head_cpus = 1 if "live" in args.faults.split(",") else 0
        self.nodes = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False, "_system_config": NODE_DEATH})
        for _ in range(args.nodes):
            self.add_node()
        ray.init(address=self.nodes.address, log_to_driver=False, runtime_env={
            "env_vars": worker_env(), "worker_process_setup_hook": "recovery_cluster.worker_setup"})

    def add_node(self) -> None:
        self.nodes.add_node(num_cpus=self.args.workers // self.args.nodes)
        self.nodes.wait_for_nodes()

    def settle(self) -> None:
        """Before a run: every node back, and a tick of the coordinator since (else Ray starts fewer workers)."""
        import ray

        if self.nodes is None:
            return
        while len(self.nodes.worker_nodes) < self.args.nodes:
            self.add_node()
        while ray.available_resources().get("CPU", 0) < self.args.workers:
            time.sleep(0.2)
        time.sleep(2)

    def fault(self, fault: str) -> None:
        if fault == "worker":
            os.kill(train_worker_pids()[-1], signal.SIGKILL)
            return
        self.nodes.remove_node(next(iter(self.nodes.worker_nodes)), allow_graceful=False)  # any: each holds its share
        if fault == "node":
            self.add_node()

    def return_node(self) -> None:
        """A node back after one was lost for good (a new one: its memory is empty)."""
        self.add_node()

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        if self.nodes is not None:
            self.nodes.shutdown()


class NamespaceNodes:
    """Inside node 0's namespace (the head's): the cluster of 2 network namespaces the host process started
    (cluster/netns.sh, tests/netns_cluster.py), each node with its own IP and Ray node; the faults hit node 1."""

    def __init__(self, args: argparse.Namespace, netns):
        import ray

        self.args, self.netns, self.nodes = args, netns, netns.nodes
        os.environ.update(RAY_TRAIN_ENV)
        ray.init(address=netns.head, log_to_driver=False, runtime_env={
            "env_vars": worker_env(), "worker_process_setup_hook": "recovery_cluster.worker_setup"})

    def settle(self) -> None:
        import ray

        if not self.netns.pids(1):  # lost for good by the elastic fault: a new node for the next run
            self.netns.join(1)
        while ray.available_resources().get("CPU", 0) < self.args.workers:
            time.sleep(0.2)
        time.sleep(2)

    def fault(self, fault: str) -> None:
        if fault == "worker":
            os.kill(train_worker_pids(among=self.netns.pids(1))[0], signal.SIGKILL)
            return
        self.netns.kill_node(1)
        if fault == "node":  # a replacement, once Ray has declared the node dead (a Ray node id is not reused)
            self.return_node()

    def return_node(self) -> None:
        """Node 1 back after it was lost for good: a new Ray node in its namespace, its memory empty."""
        self.netns.wait_node(1, alive=False)
        self.netns.join(1)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()


def steps_of(run_dir: Path) -> list[dict]:
    from raysft.training.metrics import read_metrics

    try:
        return [m for m in read_metrics(run_dir) if "loss" in m]
    except (FileNotFoundError, ValueError):
        return []


def final_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss from the pass that counted: a step trained again after a resume replaces the lost one."""
    return {m["step"]: m["loss"] for m in steps_of(run_dir)}


def final_weights(cfg) -> dict:
    from safetensors.torch import load_file

    from raysft.checkpoint import checkpoint_dirs

    return load_file(checkpoint_dirs(cfg.run_dir)[-1] / "model.safetensors")


def train(cluster: Cluster, cfg, fault: str | None = None, at_step: int = 0, sample=None,
          return_after: int = 0) -> tuple[float | None, float | None]:
    """raysft.train(cfg) in a thread; with `fault`, injected once step `at_step` is logged; with `return_after` (the
    elastic fault), a node added back once the run has trained that many steps on the workers left. Returns when
    the fault was injected and when the node returned."""
    import raysft

    error: list[BaseException] = []

    def run() -> None:
        try:
            raysft.train(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error.append(e)

    cluster.settle()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    fault_time = return_time = None
    while thread.is_alive():
        if sample is not None:
            sample()
        if fault and fault_time is None and last_step(cfg.run_dir) >= at_step:
            fault_time = time.time()  # a replacement node's start counts in the recovery
            cluster.fault(fault)
        if return_after and fault_time and return_time is None and \
                last_step(cfg.run_dir) >= resumed_step(cfg.run_dir, fault_time) + return_after:
            return_time = time.time()
            cluster.return_node()
        time.sleep(0.05)
    thread.join()
    if error:
        raise error[0]
    return fault_time, return_time


def last_step(run_dir: Path) -> int:
    return max((m["step"] for m in steps_of(run_dir)), default=0)


def resumed_step(run_dir: Path, after: float) -> float:
    """The step the first resume since `after` went on from (inf until there is one)."""
    from raysft.training.metrics import read_metrics

    try:
        return next(m["step"] for m in read_metrics(run_dir) if m.get("event") == "resume" and m["time"] >= after)
    except (StopIteration, FileNotFoundError, ValueError):
        return float("inf")


def same_run(cfg, reference: tuple[dict, dict]) -> bool:
    import torch

    losses, weights = reference
    mine = final_weights(cfg)
    return final_losses(cfg.run_dir) == losses and mine.keys() == weights.keys() and \
        all(torch.equal(mine[k], weights[k]) for k in mine)


def median_step_s(cfg) -> float:
    """The median time between consecutive steps' ends, step 1 (compile, warm-up) left out."""
    times = [m["time"] for m in sorted(steps_of(cfg.run_dir), key=lambda m: m["time"])]
    return statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False))


class SnapshotBytes:
    """The most bytes each node's directory of the run's snapshots held, sampled while the run trains."""

    def __init__(self, memory_dir: str):
        self.root, self.peak = Path(memory_dir), {}

    def __call__(self) -> None:
        for node in self.root.glob("*/*"):
            try:
                held = sum(map(_size, node.rglob("*")))
            except FileNotFoundError:  # a step removed while it was walked: the next sample counts
                continue
            self.peak[node.name] = max(self.peak.get(node.name, 0), held)


def _size(path: Path) -> int:
    """A file's bytes; 0 for a directory or a file gone (pruned, or renamed from its temporary name) meanwhile."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except FileNotFoundError:
        return 0


def netns_cluster_of(described: str):
    """The host's NetnsCluster, from its fields as the driver got them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from netns_cluster import NetnsCluster

    fields = json.loads(described)
    return NetnsCluster(**{**fields, "state": Path(fields["state"])})
