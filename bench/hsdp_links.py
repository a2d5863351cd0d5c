"""Why HYBRID_SHARD, measured: 2 nodes x 2 workers on real node boundaries (network namespaces, cluster/netns.sh)
whose links are shaped with tc tbf (1 Gbit/s each way by default), while the two workers of one node talk over the
namespace's loopback, unshaped. FULL_SHARD over all 4 workers against HYBRID_SHARD (shard within a node,
replicate across), same model and global batch, in one run; for each, the step time and the bytes each node's
link carried per step (the veth's counters in /sys/class/net/eth0/statistics, read by each node's first worker
around the timed steps), beside what the collectives must send.

    python bench/hsdp_links.py                          # needs root (network namespaces)
    python bench/hsdp_links.py --rate 100mbit --hidden 256 --layers 2 --steps 3

Theory, per node and step, for P bytes of parameters (fp32) and bandwidth-optimal ring collectives over the 4
ranks ordered node by node (two of the ring's four edges cross between the nodes):
  FULL_SHARD     all-gather in forward, again in backward (resharded after forward), reduce-scatter of the
                 gradients: each moves 3/4 P over every ring edge, so a node sends 3 x 3/4 P = 2.25 P
  HYBRID_SHARD   all-gathers and reduce-scatters stay inside the node; the gradient shards (P/2 per worker) are
                 all-reduced with the one worker of the same shard on the other node: each pair sends P/2 each
                 way, so a node sends 2 x P/2 = P
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import BENCH_DIR, Setup, add_model_args, save_results, write_rank_result

STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD")


def _link_bytes() -> int:
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def _measure(loop: dict) -> None:
    """On every worker: build the Trainer, take the warm-up steps, then time the measured ones; each node's first
    worker reads its node's link counters around them (sent + received: both directions cross the link)."""
    import ray.train
    import torch.distributed as dist

    from raysft.checkpoint import DirectorySink
    from raysft.config import config_from_dict
    from raysft.launch.ray_worker import ray_worker_context
    from raysft.training.trainer import Trainer

    ctx = ray_worker_context()
    cfg = config_from_dict(loop["config"])
    trainer = Trainer(cfg, Path(loop["store"]), None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    for _ in range(loop["warmup"]):
        trainer.train_step()
    first = ray.train.get_context().get_local_rank() == 0
    step_s = []
    dist.barrier()
    before = _link_bytes() if first else 0
    for _ in range(loop["steps"]):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        step_s.append(time.perf_counter() - start)
    dist.barrier()
    link = (_link_bytes() - before) / loop["steps"] if first else None
    write_rank_result(loop, ctx.rank, {"node_rank": ctx.node_rank, "step_s": step_s,
                                       "link_bytes_per_step": link, "mesh": list(trainer.mesh.shape)})


def drive(args: argparse.Namespace) -> list[dict]:
    """Inside node 0's namespace: each strategy on a fresh worker group of the cluster in RAY_ADDRESS."""
    import ray

    setup = Setup(args, "hsdp-links")
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(BENCH_DIR), str(BENCH_DIR.parent)])}})
    param_bytes = setup.params * 4
    results = []
    for strategy in STRATEGIES:
        cfg = setup.config(f"parallel.sharding={strategy}", f"run.name={strategy}")
        ranks = setup.run(_measure, strategy, {"config": cfg.to_dict(), "steps": args.steps, "warmup": args.warmup})
        per_node = [r["link_bytes_per_step"] for r in ranks if r["link_bytes_per_step"] is not None]
        theory = (2.25 if strategy == "FULL_SHARD" else 1.0) * param_bytes * 2  # sent + received
        results.append({"strategy": strategy, "mesh": ranks[0]["mesh"], "params": setup.params,
                        "step_s_median": statistics.median(s for r in ranks for s in r["step_s"]),
                        "step_s": [r["step_s"] for r in ranks], "link_bytes_per_step": per_node,
                        "theory_link_bytes_per_step": theory})
    return results


def table(results: list[dict], rate: str) -> str:
    rows = ["| strategy | mesh | step time (s, median) | bytes per step over each node's link, measured (sent + "
            "received) | theory (ring collectives) | measured / theory |",
            "|---|---|---:|---:|---:|---:|"]
    for r in results:
        measured = statistics.mean(r["link_bytes_per_step"])
        rows.append(f"| {r['strategy']} | {' x '.join(map(str, r['mesh']))} | {r['step_s_median']:.2f} | "
                    f"{measured / 1e6:.1f} MB | {r['theory_link_bytes_per_step'] / 1e6:.1f} MB | "
                    f"{measured / r['theory_link_bytes_per_step']:.2f} |")
    full, hybrid = results
    rows.append(f"\nLinks shaped to {rate} each way; {full['params'] / 1e6:.1f}M parameters (fp32). HYBRID_SHARD's "
                f"step takes {hybrid['step_s_median'] / full['step_s_median']:.2f}x FULL_SHARD's and sends "
                f"{statistics.mean(hybrid['link_bytes_per_step']) / statistics.mean(full['link_bytes_per_step']):.2f}x"
                " its bytes across nodes.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, workers=4)
    parser.add_argument("--rate", default="1gbit", help="each node's link, each way (tc tbf's units)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=str(BENCH_DIR.parent / "docs" / "bench" / "cpu-hsdp-links.json"))
    parser.add_argument("--driver", metavar="RESULTS", help=argparse.SUPPRESS)  # inside node 0: write results here
    parser.set_defaults(hidden=512, layers=4, seq_len=128)
    args = parser.parse_args()
    if args.workers != 4:
        parser.error("the comparison is 2 nodes x 2 workers: --workers 4")
    if args.driver:
        Path(args.driver).write_text(json.dumps(drive(args)))
        return

    sys.path.insert(0, str(BENCH_DIR.parent / "tests"))
    import netns_cluster

    reason = netns_cluster.unavailable()
    if reason:
        sys.exit(f"bench: {reason}")
    cluster = netns_cluster.start(2, cpus=2, rate=args.rate)
    try:
        results_file = cluster.state / "results.json"
        out = cluster.run(0, sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--driver",
                          str(results_file),
                          env=cluster.driver_env(PYTHONPATH=os.pathsep.join([str(BENCH_DIR), str(BENCH_DIR.parent)])),
                          timeout=3600)
        if out.returncode:
            sys.exit(f"bench: the driver failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        results = json.loads(results_file.read_text())
    finally:
        cluster.down()
    save_results(args.out, args, results, table(results, args.rate))


if __name__ == "__main__":
    main()
