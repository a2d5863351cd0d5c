"""The Ray edge of live fault tolerance (live.enabled; the trainer's side is raysft.training.live).

On the driver, `live_torch_config`: Ray's TorchftConfig, which starts a torchft Lighthouse as an actor on the
driver's node, gives every worker a process group of its own (a replica group of one) and, when a worker dies,
replaces that worker alone. It is not part of Ray's public API yet (ray.train.v2.torch.torchft_config), so it is
used only on the Ray versions it was tested with (TESTED_RAY) and refused by name on any other.

On each worker, `train_live`: the trainer in the quorum, as rank 0 of a world of one. Ray's `report` is a barrier
of every worker, which a lost worker would hold for good (the survivors wait at it, the replacement waits for them
in its first quorum), so nothing is reported while training: the writer group writes the checkpoints straight into
the run directory and prunes them (checkpoint.keep), and every group registers them with Ray once the run's last
quorum held every group (LiveReplicas.finish).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import ray

from raysft.checkpoint import DirectorySink, existing_checkpoint_names, find_resume_dir
from raysft.config import ConfigError, TrainConfig, best_mode
from raysft.training.live import LiveReplicas
from raysft.training.trainer import WorkerContext, resume_trainer

TESTED_RAY = ("2.60.0",)  # ray.train.v2.torch.torchft_config as these releases have it
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # set by Ray's torchft backend on every worker (its constant's value)


def live_torch_config(config: TrainConfig, backend: str):
    """Ray's TorchftConfig for live.enabled: the Lighthouse forms a quorum of any live groups (min_replicas 1)."""
    if ray.__version__ not in TESTED_RAY:
        raise ConfigError(f"config key 'live.enabled': live fault tolerance uses Ray Train's torchft backend "
                          f"(ray.train.v2.torch.torchft_config), not yet a public API, tested with Ray "
                          f"{', '.join(TESTED_RAY)} only; this is Ray {ray.__version__}")
    try:
        import torchft  # noqa: F401  (the workers import it; a driver without it would start them in vain)
    except ImportError as e:
        raise ConfigError("config key 'live.enabled': needs torchft on the driver and every node: pip install "
                          "'raysft[liveft]'") from e
    from ray.train.v2.torch.torchft_config import TorchftConfig

    check_lighthouse_node()
    v = config.live
    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1, "heartbeat_timeout_ms": v.heartbeat_timeout_ms,
                                            "join_timeout_ms": v.join_timeout_ms}, backend=backend)


def check_lighthouse_node() -> None:
    """Ray's torchft backend pins the Lighthouse actor to the node of Ray Train's controller, which is the driver's
    (the head's under `ray job submit`), and an actor needs a logical CPU there to be placed: on a head started with
    no CPUs (`ray start --head --num-cpus 0`, a common layout) Ray would refuse it after the workers started, and
    the run would fail as if they could not be placed. Named now instead."""
    here = ray.get_runtime_context().get_node_id()
    cpus = next((n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("NodeID") == here), 0.0)
    if cpus < 1:
        raise ConfigError("config key 'live.enabled': Ray runs the quorum's Lighthouse on the driver's node (the "
                          f"head under `ray job submit`), which has {cpus:g} logical CPUs, and it needs one: start "
                          "that node with --num-cpus 1 or more, or run the driver on a node that has a CPU")


def reachable(lighthouse: str, driver_ip: str) -> str:
    """The Lighthouse's address with the driver's node IP for its host: the Lighthouse names itself by its host's
    name, which not every network resolves to the address other nodes reach (network namespaces, some clusters
    without DNS for their nodes); Ray's node IPs are the ones its nodes reach each other by."""
    parts = urllib.parse.urlsplit(lighthouse)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{driver_ip}:{parts.port}"))


def train_live(cfg: TrainConfig, store: Path, stop_requested: Callable[[], bool], driver_ip: str) -> Path | None:
    """This worker's replica group: the trainer in the quorum until the run's last quorum, which holds every group
    (the caller registers the run's checkpoints with Ray then: a barrier of every worker); the run's newest
    complete checkpoint."""
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    live = LiveReplicas(ctx.get_world_rank(), ctx.get_world_size(), reachable(os.environ[LIGHTHOUSE_ENV], driver_ip),
                        device, cfg.live.timeout_s, stop_requested=stop_requested,
                        join_timeout_s=cfg.live.join_timeout_ms / 1000, host=ray.util.get_node_ip_address(),
                        quorum_timeout_s=cfg.live.quorum_timeout_s)
    c = cfg.checkpoint
    sink = DirectorySink(cfg.run_dir, 0, keep=c.keep, keep_best=c.keep_best, best=(c.best_metric, best_mode(c)),
                         taken=existing_checkpoint_names(cfg.run_dir), single_writer=True)
    group = WorkerContext(rank=0, world_size=1, device=device, node=ray.get_runtime_context().get_node_id())
    trainer = resume_trainer(cfg, store, group, sink, live=live)
    try:
        trainer.train()
    finally:
        live.shutdown()
    return find_resume_dir(cfg.run_dir)[0]
