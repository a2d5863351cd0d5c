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
  elastic  the last node removed for good, scaling.min_workers = workers - workers / N: the run goes on without it;
           then (--return-after K steps later) a node added back: Ray grows the group to every worker again
  live     live.enabled (each worker a replica group in a torchft quorum): its cost per step against the run
           without it, and one train worker SIGKILLed: the survivors' seconds to their next step, the replacement's
           to rejoin, steps lost, each step's loss against the run without it (bench/recovery_live.py)
With --spoil (the worker fault, the tier on) the resume after the kill also finds rank 0's part of the newest step
spoiled: a bit flipped in one copy (flip) or both (both), or its copies gone, the last as it is sent (fetch)
(recovery_cluster.spoil_at_resume): the tier sets the copy aside and reads the other, or the step before.
With --netns (and --nodes 2) the nodes are network namespaces instead (cluster/netns.sh: an IP and a Ray node
each, the test's node-death settings), the driver runs in the head's, and the faults hit node 1: its
RayTrainWorker SIGKILLed (worker), every process in it SIGKILLed and a replacement joined once Ray declared it dead
(node), or every process SIGKILLed for good and a new node joined later (elastic). --sharding picks the layout
(HYBRID_SHARD: one replica per node, the replica the copy; FULL_SHARD: the tier sends each part to the other node).
Each fault runs with the tier off and on (--tier). From each run's metrics.jsonl:
  recovery    the fault to the end of the first step after resuming
  steps lost  steps trained before the fault after the step it resumed from
  bit-exact   every step's loss and the final weights (of the last full checkpoint: --modes full) equal to
              the uninterrupted run's (for elastic: the run stopped at each step the fault run resumed from and
              relaunched from its stored checkpoint on as many workers as it went on with)
  tier        the tier the resume used, and the memory_tier_not_used reason when it refused a snapshot
  stages      where the seconds to the next step went: Ray's detection and the new workers' start, imports, Ray
              Train's setup and the process group, the model's build, the state's load, the first step
              (recovery_cluster.stage_times, the slowest rank's)
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
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from common import Setup, add_model_args, save_results, write_rank_result
from recovery_cluster import (
    SNAPSHOT_TIMES_ENV,
    SPOIL_ENV,
    SPOILS,
    STAGES_ENV,
    Cluster,
    NamespaceNodes,
    SnapshotBytes,
    final_losses,
    final_weights,
    median_step_s,
    netns_cluster_of,
    same_run,
    steps_of,
    train,
)
from recovery_live import live_legs, live_table
from recovery_report import nodes_report, recovery_row, report


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
    if args.cost or set(faults) - {"elastic", "live"}:
        plain = setup.config(*base, f"run.name={label}-uninterrupted")
        train(cluster, plain)
        reference = (final_losses(plain.run_dir), final_weights(plain))
    if args.cost:
        results.append({**cost_leg(args, setup, cluster, base + tier_sets, plain, reference), "sharding": sharding})
        print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
    widths_runs = {}
    stages = Path(os.environ[STAGES_ENV])
    for fault in faults:
        if fault == "live":
            results += live_legs(args, setup, cluster, base, label, at_step)
            continue
        # elastic: a global batch that every worker count from min_workers up divides; Ray looks for room to grow
        # back every 2 s
        extra = [f"scaling.min_workers={args.workers - args.workers // args.nodes}", "train.micro_batch_size=1",
                 f"train.global_batch_size={math.lcm(*range(1, args.workers + 1))}",
                 "scaling.resize_interval_s=2"] if fault == "elastic" else []
        try:
            if fault == "elastic":
                setup.config(*base, *extra, f"scaling.num_workers={args.workers - args.workers // args.nodes}")
        except ConfigError as e:  # HYBRID_SHARD on what is left of 2 nodes: one replica, refused
            results.append({"variant": f"{label} {fault}", "sharding": sharding, "fault": fault, "refused": str(e)})
            print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
            continue
        spoils = [""] + [s for s in args.spoil.split(",") if s] if fault == "worker" else [""]
        # each spoil on the tier's resume after a killed worker (recovery_cluster.spoil_at_resume)
        for tier, spoil, repeat in ((t, s, r) for t in args.tier.split(",") for s in spoils if t == "on" or not s
                                    for r in range(args.repeats)):
            name = f"{fault}+{spoil}" if spoil else fault
            cfg = setup.config(*base, *extra, *(tier_sets if tier == "on" else []),
                               f"run.name={label}-{name}-tier-{tier}-{repeat}")
            shutil.rmtree(stages, ignore_errors=True)
            stages.mkdir(parents=True)
            Path(os.environ[SPOIL_ENV]).write_text(spoil)
            fault_time, return_time = train(cluster, cfg, fault, at_step,
                                            return_after=args.return_after if fault == "elastic" else 0)
            rows = [(name, recovery_row(cfg, fault_time, stages))]
            if return_time is not None:
                rows.append(("return", recovery_row(cfg, return_time, stages)))
            if fault == "elastic":  # held to the run stopped at each change of width and relaunched
                widths = tuple((row["resumed_from"], row["world_size_after"]) for _, row in rows)
                if widths not in widths_runs:
                    widths_runs[widths] = widths_reference(cluster, setup, base + extra, label, widths)
                expected = widths_runs[widths]
            else:
                expected = reference
            exact = same_run(cfg, expected)
            for name, row in rows:
                results.append({"variant": f"{label} {name} tier {tier}", "sharding": sharding, "fault": name,
                                "tier_on": tier == "on", **row, "bit_exact": exact})
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


def widths_reference(cluster: Cluster, setup: Setup, base: list[str], mode: str,
                     widths: tuple[tuple[int, int], ...]) -> tuple:
    """The elastic fault's uninterrupted run: stopped at each (step, workers) of `widths`' step and relaunched from
    its stored checkpoint on that many workers (every worker at first)."""
    name = f"run.name={mode}-widths-{'-'.join(f'{s}x{w}' for s, w in widths)}"
    sizes = [f"scaling.num_workers={setup.args.workers}"] + [f"scaling.num_workers={w}" for _, w in widths]
    stops = [f"train.stop_at_step={s}" for s, _ in widths] + [None]
    for size, stop in zip(sizes, stops, strict=True):
        cfg = setup.config(*base, name, size, *([stop] if stop else []))
        train(cluster, cfg)
    return final_losses(cfg.run_dir), final_weights(cfg)


def verify_worker(loop: dict) -> None:
    """A Ray train worker: the checkpoint verified by rank 0 alone (the others waiting in the broadcast) and by every
    rank its share, alternately."""
    import ray.train
    import torch.distributed as dist

    from raysft.checkpoint.discovery import verified_reason
    from raysft.checkpoint.manifest import incomplete_reason
    from raysft.distributed.collectives import from_rank0

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
    killed, _ = train(cluster, cfg, "worker", every + 2)
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
    parser.add_argument("--spoil", default="", help="with --faults worker and --tier on: also the killed worker's "
                        f"resume with the newest snapshot spoiled, by each of {', '.join(SPOILS)} "
                        "(recovery_cluster.spoil_at_resume), comma-separated")
    parser.add_argument("--memory-every", type=int, default=1, help="checkpoint.memory_every_n_steps when on")
    parser.add_argument("--return-after", type=int, default=3, help="the elastic fault: a node added back once the "
                        "run has trained this many steps on the workers left (0: it never returns)")
    parser.add_argument("--live-steps", type=int, default=80, help="the live fault's runs: train.max_steps (room "
                        "for the replacement to rejoin before the end)")
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
    (setup.work / "snapshot-times").mkdir(parents=True, exist_ok=True)  # the fault runs' workers write there too
    os.environ[STAGES_ENV] = str(setup.work / "stages")
    (setup.work / "stages").mkdir(parents=True, exist_ok=True)  # the uninterrupted runs' workers write there too
    os.environ[SPOIL_ENV] = str(setup.work / "spoil.txt")
    cluster = NamespaceNodes(args, netns_cluster_of(os.environ["RAYSFT_BENCH_NETNS"])) if args.driver \
        else Cluster(args)
    memory_dir = Path(tempfile.mkdtemp(prefix="raysft-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        if args.nodes:
            results = cluster_legs(args, setup, cluster, memory_dir)
            if args.verify_gib:
                results.append(verify_leg(args, setup, cluster))
                print(f"bench: {results[-1]}", file=sys.stderr, flush=True)
            table = "\n".join([nodes_report(results, args, setup.params), *live_table(results, args)])
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


if __name__ == "__main__":
    main()
