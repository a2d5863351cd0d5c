"""Recovery: how long training stands still after a fault and how many steps it cost, with and without the memory
tier (checkpoint.memory_every_n_steps: 1), against an uninterrupted run; what the tier costs; and how long a resume
from a stored checkpoint spends verifying it.

    python bench/recovery.py                       # 2 CPU workers, a ~75M-parameter LLaMA, full and sharded
    python bench/recovery.py --modes sharded --repeats 5 --hidden 1024 --layers 16
    python bench/recovery.py --nodes 2 --workers 4 --modes full --faults worker,node,elastic --tier off,on \
        --hidden 256 --layers 4 --seq-len 64 --every 4 --repeats 1 --verify-gib 4

    sudo python bench/recovery.py --netns --nodes 2 --workers 4 --modes full --sharding HYBRID_SHARD ...

Without --nodes, every run trains on one local Ray with Ray Train's own health-check interval, and one train worker
gets SIGKILL two steps after the first checkpoint (the "worker" fault). With --nodes N the runs train FULL_SHARD
on a Ray cluster of N logical nodes on this machine (ray.cluster_utils.Cluster: a head with no CPUs, nodes of
workers / N CPUs; each has its own Ray node id, which is what the memory tier keeps snapshots apart by), with the
fault tests' shortened timings (tests/test_faults_cluster.py), and --faults picks among:
  worker   SIGKILL to one train worker; Ray Train restarts the group
  node     the last node removed (its raylet and workers killed), a replacement added at once
  elastic  the last node removed for good, scaling.min_workers = workers - workers / N: the run goes on without it
With --netns (and --nodes 2) the nodes are network namespaces instead (cluster/netns.sh: an IP and a Ray node
each, the test's node-death settings), the driver runs in the head's, and the faults hit node 1: its
RayTrainWorker SIGKILLed (worker), every process in it SIGKILLed and a replacement joined once Ray declared it dead
(node), or every process SIGKILLed for good (elastic). --sharding picks the layout (HYBRID_SHARD: one replica per
node, the replica the copy; FULL_SHARD: the tier sends each part to the other node).
Each fault runs with the tier off and on (--tier). From each run's metrics.jsonl:
  recovery    the fault to the end of the first step after resuming
  steps lost  steps trained before the fault after the step it resumed from
  bit-exact   every step's loss and the final weights (of the last full checkpoint: --modes full) equal to
              the uninterrupted run's (for elastic: the run of
              N workers stopped at the checkpoint the fault run resumed from and relaunched on the workers left)
  tier        the tier the resume used, and the memory_tier_not_used reason when it refused a snapshot
The tier's cost, from two uninterrupted runs (tier off, on): the median step time, and the peak bytes each node's
snapshots held in checkpoint.memory_dir against `raysft plan`'s count. --verify-gib G: a checkpoint directory of
G GiB of files with raysft's manifest, verified by rank 0 alone (manifest.incomplete_reason, the others waiting)
and by every rank its share (discovery.verified_reason), alternately, --repeats times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from common import Setup, add_model_args, median_span, save_results, train_worker_pids, write_rank_result

HEALTH_CHECK_S = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0 (Ray's default)")
# the fault tests' timings (tests/test_faults_cluster.py), used with --nodes
RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
                 "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}


SNAPSHOT_TIMES_ENV = "RAYSFT_BENCH_SNAPSHOT_TIMES"  # a directory: each worker's snapshot calls' durations


def worker_setup() -> None:
    """A worker_process_setup_hook. Ray Train's elastic policy sizes the group from the autoscaling coordinator's
    view of the nodes, refreshed once per tick: tick often (as tests/fault_injection.py does). With
    $RAYSFT_BENCH_SNAPSHOT_TIMES, every MemoryTier.snapshot call that takes a snapshot notes how long it held the
    training loop (the staging copy, the RNG states, the ranks' agreement: the part of the tier on the step's path;
    the file and the copy off the node are written in the tier's thread)."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S = 1
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


def worker_env() -> dict:
    """The train workers' environment: the bench's modules and this checkout on the path, the fault tests' Ray
    Train timings, the snapshot timing's directory."""
    here = Path(__file__).resolve().parent
    return {"PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]), **RAY_TRAIN_ENV,
            **({SNAPSHOT_TIMES_ENV: os.environ[SNAPSHOT_TIMES_ENV]} if SNAPSHOT_TIMES_ENV in os.environ else {})}


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
        self.nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                      "_system_config": NODE_DEATH})
        for _ in range(args.nodes):
            self.add_node()
        ray.init(address=self.nodes.address, log_to_driver=False, runtime_env={
            "env_vars": worker_env(), "worker_process_setup_hook": "recovery.worker_setup"})

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
            "env_vars": worker_env(), "worker_process_setup_hook": "recovery.worker_setup"})

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


def train(cluster: Cluster, cfg, fault: str | None = None, at_step: int = 0, sample=None) -> float | None:
    """raysft.train(cfg) in a thread; with `fault`, injected once step `at_step` is logged. Returns its time."""
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
    fault_time = None
    while thread.is_alive():
        if sample is not None:
            sample()
        if fault and fault_time is None and max((m["step"] for m in steps_of(cfg.run_dir)), default=0) >= at_step:
            fault_time = time.time()  # a replacement node's start counts in the recovery
            cluster.fault(fault)
        time.sleep(0.05)
    thread.join()
    if error:
        raise error[0]
    return fault_time


def same_run(cfg, reference: tuple[dict, dict]) -> bool:
    import torch

    losses, weights = reference
    mine = final_weights(cfg)
    return final_losses(cfg.run_dir) == losses and mine.keys() == weights.keys() and \
        all(torch.equal(mine[k], weights[k]) for k in mine)


def recovery_row(cfg, fault_time: float) -> dict:
    from raysft.training.metrics import read_metrics

    records = read_metrics(cfg.run_dir)
    resume = next(i for i, m in enumerate(records) if m.get("event") == "resume" and m["time"] >= fault_time)
    before = max(m["step"] for m in records[:resume] if "loss" in m)
    after = next(m for m in records[resume:] if "loss" in m)
    not_used = [m["reason"] for m in records if m.get("event") == "memory_tier_not_used"]
    return {"recovery_s": round(after["time"] - fault_time, 1), "resumed_from": records[resume]["step"],
            "steps_lost": before - records[resume]["step"], "tier": records[resume].get("tier", "stored"),
            "world_size_after": records[resume]["world_size"], "memory_tier_not_used": not_used}


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


def planned_snapshot_bytes(setup: Setup, cfg, args: argparse.Namespace) -> dict:
    from raysft.tools.plan import Topology, memory_tier_host, model_shape, plan

    result = plan(cfg, model_shape(cfg, setup.model_config), Topology(args.workers, args.nodes or 1))
    tier = memory_tier_host(cfg, result)
    return {"staging": tier.terms["staging buffers"], "in_memory_dir": tier.in_memory_dir}


def cluster_legs(args: argparse.Namespace, setup: Setup, cluster: Cluster, memory_dir: Path) -> list[dict]:
    """Per checkpoint mode and layout: the uninterrupted runs (tier off, on), then each fault with the tier off and
    on."""
    results = []
    for mode in args.modes.split(","):
        for sharding in args.sharding.split(","):
            results += layout_legs(args, setup, cluster, memory_dir, mode, sharding)
    return results


def layout_legs(args: argparse.Namespace, setup: Setup, cluster: Cluster, memory_dir: Path, mode: str,
                sharding: str) -> list[dict]:
    from raysft.errors import ConfigError

    every, steps, label = args.every, 3 * args.every, f"{mode}-{sharding.lower()}"
    at_step = args.fault_at or every + 2  # not a multiple of --every: the stored tier loses at_step % every steps
    base = [f"checkpoint.mode={mode}", f"checkpoint.every_n_steps={every}", f"train.max_steps={steps}",
            "train.log_every_n_steps=1", "scaling.max_failures=2", "train.warmup_steps=1",
            f"parallel.sharding={sharding}"]
    tier_sets = [f"checkpoint.memory_every_n_steps={args.memory_every}", f"checkpoint.memory_dir={memory_dir}"]
    faults = [fault for fault in args.faults.split(",") if fault]  # none: the cost and verification only
    results = []
    if args.cost or set(faults) - {"elastic"}:
        plain = setup.config(*base, f"run.name={label}-uninterrupted")
        train(cluster, plain)
        reference = (final_losses(plain.run_dir), final_weights(plain))
    if args.cost:
        results.append({**cost_leg(args, setup, cluster, base + tier_sets, plain, reference), "sharding": sharding})
        print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
    shrunk = {}
    for fault in faults:
        # elastic: a global batch that every worker count from min_workers up divides
        extra = [f"scaling.min_workers={args.workers - args.workers // args.nodes}", "train.micro_batch_size=1",
                 f"train.global_batch_size={math.lcm(*range(1, args.workers + 1))}"] if fault == "elastic" else []
        try:
            if fault == "elastic":
                setup.config(*base, *extra, f"scaling.num_workers={args.workers - args.workers // args.nodes}")
        except ConfigError as e:  # HYBRID_SHARD on what is left of 2 nodes: one replica, refused
            results.append({"variant": f"{label} {fault}", "sharding": sharding, "fault": fault, "refused": str(e)})
            print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
            continue
        for tier in args.tier.split(","):
            for repeat in range(args.repeats):
                cfg = setup.config(*base, *extra, *(tier_sets if tier == "on" else []),
                                   f"run.name={label}-{fault}-tier-{tier}-{repeat}")
                row = recovery_row(cfg, train(cluster, cfg, fault, at_step))
                if fault == "elastic":
                    key = (row["resumed_from"], row["world_size_after"])
                    shrunk[key] = shrunk.get(key) or shrink_reference(cluster, setup, base + extra, label, *key)
                row["bit_exact"] = same_run(cfg, shrunk[key] if fault == "elastic" else reference)
                results.append({"variant": f"{label} {fault} tier {tier}", "sharding": sharding, "fault": fault,
                                "tier_on": tier == "on", **row})
                print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
    return results


def cost_leg(args: argparse.Namespace, setup: Setup, cluster: Cluster, sets: list[str], plain, reference) -> dict:
    """Uninterrupted runs with the tier beside those without, --repeats of each in alternating order (the first
    without is the reference run already trained): step time, bit-exactness, snapshot bytes."""
    off, on, exact, with_tier, calls = [median_step_s(plain)], [], [], None, []
    held = SnapshotBytes(next(v.split("=", 1)[1] for v in sets if v.startswith("checkpoint.memory_dir=")))
    times = Path(os.environ[SNAPSHOT_TIMES_ENV])
    for repeat in range(args.repeats):
        for tier in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            if tier == "off" and len(off) > repeat:
                continue
            cfg = setup.config(*(sets if tier == "on" else [s for s in sets if "memory" not in s]),
                               f"run.name={plain.run.name}-cost-{tier}-{repeat}")
            shutil.rmtree(times, ignore_errors=True)
            times.mkdir(parents=True)
            train(cluster, cfg, sample=held if tier == "on" else None)
            calls += [float(t) for f in times.glob("*.txt") for t in f.read_text().split()]
            (on if tier == "on" else off).append(median_step_s(cfg))
            with_tier = cfg if tier == "on" else with_tier
            exact.append(same_run(cfg, reference))
    return {"variant": "cost", "step_s_tier_off": statistics.median(off), "step_s_tier_on": statistics.median(on),
            "runs_off": off, "runs_on": on, "snapshot_call_s": statistics.median(calls) if calls else None,
            "snapshot_calls": len(calls), "bit_exact": all(exact), "snapshot_bytes_peak_per_node": held.peak,
            "planned_per_node": planned_snapshot_bytes(setup, with_tier, args)}


def shrink_reference(cluster: Cluster, setup: Setup, base: list[str], mode: str, step: int, workers: int) -> tuple:
    """The elastic fault's uninterrupted run: stopped at `step` on every worker, relaunched on `workers`."""
    name = f"run.name={mode}-shrunk-{step}-{workers}"
    train(cluster, setup.config(*base, name, f"train.stop_at_step={step}"))
    cfg = setup.config(*base, name, f"scaling.num_workers={workers}")
    train(cluster, cfg)
    return final_losses(cfg.run_dir), final_weights(cfg)


def verify_worker(loop: dict) -> None:
    """A Ray train worker: the checkpoint verified by rank 0 alone (the others waiting in the broadcast) and by every
    rank its share, alternately."""
    import ray.train
    import torch.distributed as dist

    from raysft.checkpoint.discovery import verified_reason
    from raysft.checkpoint.manifest import incomplete_reason
    from raysft.parallel.collectives import from_rank0

    path = Path(loop["checkpoint"])
    ways = {"rank0": lambda: from_rank0(lambda: incomplete_reason(path)), "shared": lambda: verified_reason(path)}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(loop["repeats"]):
        for way in (ways if repeat % 2 == 0 else dict(reversed(ways.items()))):
            dist.barrier()
            began = time.perf_counter()
            reason = ways[way]()
            dist.barrier()
            times[way].append(time.perf_counter() - began)
            assert reason is None, reason
    write_rank_result(loop, ray.train.get_context().get_world_rank(), times)


def write_checkpoint(directory: Path, gib: float, files: int) -> None:
    """A checkpoint directory of `gib` GiB in `files` payload files (as a sharded checkpoint's), with raysft's
    manifest: what a resume verifies (the bytes' values do not change the time to hash them)."""
    from raysft.checkpoint.manifest import durable_file_list, write_manifest

    directory.mkdir(parents=True)
    size, block = int(gib * 2**30) // files, os.urandom(1 << 20)
    for rank in range(files):
        with (directory / f"__{rank}_0.distcp").open("wb") as f:
            for _ in range(size >> 20):
                f.write(block)
    (directory / ".metadata").write_bytes(os.urandom(4096))
    write_manifest(directory, 1, [durable_file_list(directory)])


def verify_leg(args: argparse.Namespace, setup: Setup, cluster: Cluster) -> dict:
    cluster.settle()
    checkpoint = setup.work / "verify" / "checkpoint_00000001"
    write_checkpoint(checkpoint, args.verify_gib, args.workers)
    ranks = setup.run(verify_worker, "verify", {"checkpoint": str(checkpoint), "repeats": args.repeats})
    rank0 = ranks[0]
    return {"variant": "verification", "gib": args.verify_gib, "ranks": args.workers,
            "rank0_s": rank0["rank0"], "shared_s": rank0["shared"]}


def measure(cluster: Cluster, setup: Setup, mode: str, name: str, every: int) -> dict:
    """Without --nodes: a worker killed two steps after the first checkpoint, the stored tier only."""
    # log_every_n_steps=1: a metrics row as each step ends (rows wait for a log step), which times the kill
    cfg = setup.config(f"run.name={name}", f"checkpoint.mode={mode}", f"checkpoint.every_n_steps={every}",
                       f"train.max_steps={3 * every}", "train.log_every_n_steps=1", "scaling.max_failures=1",
                       "train.warmup_steps=1")
    launched = time.time()
    killed = train(cluster, cfg, "worker", every + 2)
    row = recovery_row(cfg, killed)
    first = min(m["time"] for m in steps_of(cfg.run_dir))
    return {"start_s": first - launched, "recovery_s": row["recovery_s"], "steps_lost": row["steps_lost"],
            "resumed_from": row["resumed_from"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=2)
    parser.add_argument("--modes", default="full,sharded")
    parser.add_argument("--every", type=int, default=4, help="checkpoint.every_n_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=0, help="logical Ray nodes (0: one local Ray)")
    parser.add_argument("--faults", default="worker,node,elastic", help="with --nodes")
    parser.add_argument("--tier", default="off,on", help="with --nodes: the memory tier off, on, or both")
    parser.add_argument("--no-cost", dest="cost", action="store_false", help="with --nodes: no uninterrupted run "
                        "with the tier (its step time, snapshot bytes)")
    parser.add_argument("--verify-gib", type=float, default=0.0, help="with --nodes: the verification leg's size")
    parser.add_argument("--netns", action="store_true", help="with --nodes 2: the nodes are network namespaces "
                        "(cluster/netns.sh; needs root), the driver runs in the head's, the faults hit node 1")
    parser.add_argument("--sharding", default="FULL_SHARD", help="with --nodes: parallel.sharding, or several, "
                        "comma-separated, run one after another")
    parser.add_argument("--fault-at", type=int, default=0, help="with --nodes: the step the fault follows "
                        "(default: --every + 2)")
    parser.add_argument("--memory-every", type=int, default=1, help="checkpoint.memory_every_n_steps when on")
    parser.add_argument("--out", default="runs/bench/recovery.json")
    parser.add_argument("--driver", metavar="RESULTS", help=argparse.SUPPRESS)  # inside node 0: results here
    args = parser.parse_args(argv)
    if args.nodes and args.modes != "full":
        parser.error("--nodes compares final weights from full checkpoints: --modes full")
    if args.netns and args.nodes != 2:
        parser.error("--netns is a cluster of 2 nodes: --nodes 2")
    if args.netns and not args.driver:
        return on_namespace_nodes(args, sys.argv[1:] if argv is None else argv)

    setup = Setup(args, "recovery")
    os.environ[SNAPSHOT_TIMES_ENV] = str(setup.work / "snapshot-times")
    cluster = NamespaceNodes(args, netns_cluster_of(os.environ["RAYSFT_BENCH_NETNS"])) if args.driver \
        else Cluster(args)
    memory_dir = Path(tempfile.mkdtemp(prefix="raysft-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        if args.nodes:
            results = cluster_legs(args, setup, cluster, memory_dir)
            if args.verify_gib:
                results.append(verify_leg(args, setup, cluster))
                print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
            table = nodes_report(results, args, setup.params)
        else:
            results = local_legs(args, setup, cluster)
            table = report(results, args, setup.params)
    finally:
        cluster.shutdown()
        shutil.rmtree(memory_dir, ignore_errors=True)
    if args.driver:
        Path(args.driver).write_text(json.dumps({"results": results, "table": table}))
        return
    save_results(args.out, args, results, table)


def on_namespace_nodes(args: argparse.Namespace, argv: list[str]) -> None:
    """The host's part of --netns: the namespace cluster up (the test's node-death settings), this script run
    again as the driver inside node 0, its results saved, the cluster down."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import netns_cluster

    reason = netns_cluster.unavailable()
    if reason:
        sys.exit(f"bench: {reason}")
    cluster = netns_cluster.start(2, cpus=args.workers // 2, ray_env=netns_cluster.NODE_DEATH_ENV)
    try:
        results_file = cluster.state / "results.json"
        bench_dir = Path(__file__).resolve().parent
        env = cluster.driver_env(PYTHONPATH=os.pathsep.join([str(bench_dir), str(bench_dir.parent)]),
                                 RAYSFT_BENCH_NETNS=json.dumps({**asdict(cluster), "state": str(cluster.state)}))
        driver = cluster.popen(0, sys.executable, str(Path(__file__).resolve()), *argv, "--driver", str(results_file),
                               env=env)
        if driver.wait():
            sys.exit(f"bench: the driver in node 0 failed ({driver.returncode})")
        done = json.loads(results_file.read_text())
    finally:
        cluster.down()
    save_results(args.out, args, done["results"], done["table"])


def netns_cluster_of(described: str):
    """The host's NetnsCluster, from its fields as the driver got them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from netns_cluster import NetnsCluster

    fields = json.loads(described)
    return NetnsCluster(**{**fields, "state": Path(fields["state"])})


def local_legs(args: argparse.Namespace, setup: Setup, cluster: Cluster) -> list[dict]:
    """Runs of the checkpoint modes interleaved in alternating order, --repeats times each."""
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            print(f"bench: {mode}-{repeat} ...", file=sys.stderr, flush=True)
            runs[mode].append(measure(cluster, setup, mode, f"{mode}-{repeat}", args.every))
            print(f"bench: {mode}-{repeat}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    results = []
    for mode in modes:
        start = statistics.median(r["start_s"] for r in runs[mode])
        recovery = statistics.median(r["recovery_s"] for r in runs[mode])
        results.append({"variant": mode, "runs": runs[mode], "start_s": start, "recovery_s": recovery,
                        "recovery_vs_start": recovery / start, "steps_lost": [r["steps_lost"] for r in runs[mode]]})
    return results


def report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    lines = [f"recovery from a killed worker: {args.workers} {'GPU' if args.gpu else 'CPU'} workers, LLaMA of "
             f"{params / 1e6:.0f}M parameters, checkpoint every {args.every} steps, worker killed at step "
             f"{args.every + 2}; Ray Train health check every {HEALTH_CHECK_S} s; {args.repeats} runs each, "
             "median (min-max)",
             "", "| checkpoint mode | launch to first step (s) | kill to first step after resume (s) "
             "| recovery / launch | steps lost |", "|---|---:|---:|---:|---|"]
    for r in results:
        start, recovery = (median_span(r["runs"], k, digits=1) for k in ("start_s", "recovery_s"))
        lines.append(f"| {r['variant']} | {start} | {recovery} "
                     f"| {r['recovery_vs_start']:.2f} | {', '.join(map(str, r['steps_lost']))} |")
    return "\n".join(lines)


def nodes_report(results: list[dict], args: argparse.Namespace, params: int) -> str:
    per_node = args.workers // args.nodes
    nodes = "network-namespace nodes" if args.netns else "logical Ray nodes"
    lines = [f"{args.workers} CPU workers {args.sharding} on {args.nodes} {nodes} of {per_node}, LLaMA of "
             f"{params / 1e6:.1f}M parameters, {3 * args.every} steps, a stored checkpoint every {args.every} steps, "
             f"the fault at step {args.fault_at or args.every + 2}; memory tier every {args.memory_every} step(s) "
             "when on", "", "| layout | fault | tier | resumed from (tier) | steps lost | fault to next step (s) "
             "| bit-exact |", "|---|---|---|---|---:|---:|---|"]
    for r in results:
        if "refused" in r:
            lines.append(f"| {r['sharding']} | {r['fault']} | — | not run: the layout left after the fault is "
                         f"refused by the config ({r['refused']}) | | | |")
        elif "fault" in r:
            refused = f"; refused: {r['memory_tier_not_used'][0]}" if r["memory_tier_not_used"] else ""
            lines.append(f"| {r['sharding']} | {r['fault']} | {'on' if r['tier_on'] else 'off'} | "
                         f"{r['resumed_from']} ({r['tier']}"
                         f"{refused}) | {r['steps_lost']} | {r['recovery_s']} | {'yes' if r['bit_exact'] else 'NO'} |")
    for r in results:
        if r["variant"] == "cost":
            held = ", ".join(f"{v / 2**20:.1f}" for v in r["snapshot_bytes_peak_per_node"].values())
            lines += ["", f"cost ({r['sharding']}): median step {r['step_s_tier_off']:.3f} s without the tier, "
                          f"{r['step_s_tier_on']:.3f} s with it every {args.memory_every} step(s) "
                          f"(median of {len(r['runs_on'])} runs each, alternating) "
                          f"({r['step_s_tier_on'] / r['step_s_tier_off'] - 1:+.1%}), of which the snapshot call "
                          f"held the step {(r['snapshot_call_s'] or 0) * 1e3:.1f} ms (median of "
                          f"{r['snapshot_calls']}); bit-exact: {r['bit_exact']}; "
                          f"peak MiB in memory_dir per node: {held} (plan: "
                          f"{r['planned_per_node']['in_memory_dir'] / 2**20:.1f}, beside "
                          f"{r['planned_per_node']['staging'] / 2**20:.1f} staged)"]
        if r["variant"] == "verification":
            lines += ["", f"verifying a {r['gib']} GiB checkpoint before the first step: rank 0 alone "
                          f"{', '.join(f'{t:.1f}' for t in r['rank0_s'])} s; shared over {r['ranks']} ranks "
                          f"{', '.join(f'{t:.1f}' for t in r['shared_s'])} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
