"""The Ray edge, on the driver: prepare the launch (raysft.launch.prelaunch), join or start a Ray, check that it can
place the workers, and run a TorchTrainer whose workers run raysft.launch.ray_worker.train_worker; the driver's stop
request (SIGTERM) reaches them through a StopFlag actor, and an error every worker raised alike comes back through
the run directory to be raised here, the first time any worker meets it (EndRunOnRecordedError)."""

from __future__ import annotations

import math
import os
import sys
import threading

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysft.checkpoint import remove_snapshots
from raysft.checkpoint.memory import remove_run, resolve_memory_dir
from raysft.config import ConfigError, TrainConfig, best_mode
from raysft.config import ScalingConfig as RaysftScaling
from raysft.distributed.collectives import process_group_backend
from raysft.distributed.layout import check_hsdp_shard_size_fits_nodes
from raysft.distributed.local_ray import LocalRay, check_reachable, connect, wait_ended
from raysft.errors import CannotPlaceWorkers
from raysft.evals.runner import record_unrecorded_attempts
from raysft.evals.validation import VALIDATION_TASK_RESOURCES, validation_kwargs
from raysft.launch.lease import RunLease
from raysft.launch.paths import resolve_paths
from raysft.launch.prelaunch import Stores, prepare_launch, with_max_steps
from raysft.launch.ray_controller import (
    RAY_GRACE_S,
    EndRunOnRecordedError,
    RunEnded,
    StopFlag,
    clear_run_ending_records,
    forget_evaluation_request,
    recorded_run_ending,
    validate_checkpoint,
)
from raysft.launch.ray_live import live_torch_config
from raysft.launch.ray_train import (
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    LoggingConfig,
    Result,
    RunConfig,
    ScalingConfig,
    TorchConfig,
    TorchTrainer,
    ValidationConfig,
    ValidationTaskConfig,
)
from raysft.launch.ray_worker import train_worker
from raysft.launch.signals import DriverSignals, Stopped
from raysft.storage import location
from raysft.training.gen_log import log_remaining

# Ray waits this long for a worker group's resources before it counts a failed start (its own setting).
START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", 60.0
# How long the stop request may take to reach the StopFlag actor (milliseconds on a live cluster): after a signal to
# the whole job, Ray's own processes are gone and it never does.
STOP_REQUEST_TIMEOUT_S = 10.0
# What is known of an evaluation attempt that left no record, found before a launch or once a run's validations ended
UNRECORDED_BEFORE = ("its launch ended first (Ray cancels a running validation when its run aborts: a stop, an "
                     "error that ended the run; Ray queues such a one again)")
UNRECORDED_AT_END = (f"Ray cancelled it (its own timeout, eval.timeout_s + {RAY_GRACE_S:g} s from the task's "
                     "submission, passed first), or its validation task's process died")
# Ray Train's own INFO lines (each report's TrainingReport(...), worker-group starts, process-group setup) stay off
# the terminal, where raysft's lines are what a user reads; Ray Train's system log files in the Ray session's logs
# directory keep every level. RAYSFT_RAY_TRAIN_LOG_LEVEL=INFO shows them again.
RAY_TRAIN_CONSOLE_LEVEL = os.environ.get("RAYSFT_RAY_TRAIN_LOG_LEVEL", "WARNING")


def train(config: TrainConfig, fresh: bool = False) -> Result:
    """Tokenize the data (or reuse the store), then train on the Ray cluster in RAY_ADDRESS or a local one.

    Launching again with the same run.name and run.storage_path resumes from the run's latest complete checkpoint;
    the run's data, model and schedule must then be the same (ConfigError otherwise). `fresh` starts the run over
    and keeps the old run directory beside it, renamed. One launch at a time: while another live launch holds the
    run (raysft.launch.lease), this one raises RunInUse before it changes anything. A relative path in the config
    means what it means in this process's working directory (raysft.launch.paths): the workers get it absolute.
    """
    config = resolve_paths(config)  # before anything reads a path or ships the config
    check_reachable()  # a cluster in RAY_ADDRESS that nobody answers: named now, not after tokenizing
    lease = RunLease(config.run_dir)
    lease.check_free()  # before the data is tokenized, and before --fresh moves a live launch's run away
    stores = prepare_launch(config, fresh)
    config = with_max_steps(config, stores)  # train.num_epochs in steps, before the workers get the config
    with lease.take():
        return _fit(config, stores)


def _fit(config: TrainConfig, stores: Stores) -> Result:
    if config.live.enabled:  # torchft's Rust side logs every quorum at INFO: a local Ray's Lighthouse inherits this
        os.environ.setdefault("RUST_LOG", "warn")
    own_local_ray = connect_ray(config.scaling, config.eval.num_cpus if config.eval.path else 0.0)
    check_cluster_can_place(config.scaling)
    check_cluster_can_evaluate(config)
    check_hsdp_shard_size_fits_nodes(config.parallel, config.scaling.num_workers, workers_per_node(config.scaling))
    s = config.scaling
    root = location(config.run.storage_path)
    remote = root.fs if root.local is None else None  # Ray's and the workers' filesystem: the driver's
    stop_flag = StopFlag.remote()
    backend = process_group_backend("cuda" if s.use_gpu else "cpu", config.parallel.cpu_offload)
    trainer = TorchTrainer(
        train_loop_per_worker=train_worker,
        train_loop_config={"config": config.to_dict(), "store": str(stores.train),
                           "eval_store": str(stores.eval) if stores.eval else None, "filesystem": remote,
                           "filesystem_path": root.path, "stop_flag": stop_flag,
                           "driver_ip": ray.util.get_node_ip_address()},  # where live.enabled's Lighthouse runs
        torch_config=(live_torch_config if config.live.enabled else torch_config)(config, backend),
        scaling_config=ScalingConfig(num_workers=(s.min_workers, s.num_workers) if s.min_workers else s.num_workers,
                                     use_gpu=s.use_gpu, resources_per_worker=worker_resources(s),
                                     elastic_resize_monitor_interval_s=s.resize_interval_s),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=root.path,  # with storage_filesystem set, Ray wants the path without its scheme
            storage_filesystem=remote,
            failure_config=FailureConfig(max_failures=s.max_failures,
                                         controller_failure_limit=start_attempts(s) - 1),
            checkpoint_config=ray_checkpoint_config(config),
            callbacks=[EndRunOnRecordedError(config.run_dir)],
            **_quiet_console(),
        ),
        validation_config=gen_eval_validation(config),
    )
    print(f"raysft: run {config.run.name} in {config.run_dir}", flush=True)
    clear_run_ending_records(config.run_dir)
    forget_evaluation_request(config.run_dir)
    record_unrecorded_attempts(config.run_dir, UNRECORDED_BEFORE)  # an earlier launch's: rank 0 logs them
    signals = DriverSignals(config.run.stop_grace_s, on_term=lambda: request_stop(stop_flag))
    try:
        result = signals.run(trainer.fit)  # raises raysft.launch.signals.Stopped on SIGTERM or Ctrl-C
        if config.eval.path:  # fit returned once every evaluation ended: those after the workers', into the log
            record_unrecorded_attempts(config.run_dir, UNRECORDED_AT_END)
            log_remaining(config)
        return result
    except Stopped:
        if own_local_ray and config.checkpoint.memory_every_n_steps:
            ray.shutdown()  # its workers may still train (Ctrl-C): they end before their snapshots are removed
            wait_ended(own_local_ray)
        raise
    except ControllerError as e:
        if isinstance(e.controller_failure, RunEnded):
            raise recorded_run_ending(config.run_dir) or RuntimeError(str(e.controller_failure)) from None
        raise CannotPlaceWorkers(
            f"Ray could not start {s.min_workers or s.num_workers} workers of {worker_resources(s)} in "
            f"{start_attempts(s)} attempts of {start_timeout_s():g} s (scaling.placement_timeout_s="
            f"{s.placement_timeout_s:g}): the cluster has the resources in total, but they stayed taken (other "
            "jobs, or nodes gone). Free them or add nodes, lower scaling.num_workers, set scaling.min_workers to "
            f"start with fewer, or wait longer. Ray's error: {e.controller_failure}") from e
    finally:  # however the run ended, its snapshots in memory go: this host's, then (a cluster's) the other nodes'
        run_id = remove_snapshots(config.run_dir, config.checkpoint)
        if run_id is not None and own_local_ray is None:
            remove_snapshots_on_other_nodes(config.checkpoint.memory_dir, run_id)


def torch_config(config: TrainConfig, backend: str) -> TorchConfig:
    """Every worker in one process group of `backend` (live.enabled: ray_live.live_torch_config)."""
    return TorchConfig(backend=backend)


def remove_snapshots_on_other_nodes(memory_dir: str, run_id: str, timeout_s: float = 30.0) -> None:
    """The run's memory-tier snapshots on the nodes Ray has alive but this host (whose went with
    raysft.checkpoint.remove_snapshots; a local Ray the driver started has no other host), through a task on each,
    in a thread the driver waits for at most timeout_s (after a signal to the whole job Ray itself may be gone, and
    a call into it would not return)."""
    def on_every_node() -> None:
        here = ray.util.get_node_ip_address()
        on_node = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in ray.nodes()
                   if n["Alive"] and n["NodeManagerAddress"] != here]
        ray.get([_remove_run_on_node.options(scheduling_strategy=s).remote(memory_dir, run_id) for s in on_node])

    worker = threading.Thread(target=on_every_node, name="raysft-remove-snapshots", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(f"raysft: warning: the run's snapshots in {resolve_memory_dir(memory_dir) / run_id} may be left on "
              f"other nodes: Ray did not answer within {timeout_s:g} s", file=sys.stderr)


@ray.remote(num_cpus=0, max_retries=0)
def _remove_run_on_node(memory_dir: str, run_id: str) -> None:
    remove_run(memory_dir, run_id)


def request_stop(stop_flag) -> None:
    """Raise the StopFlag; a RuntimeError saying why not when Ray does not take the request in time."""
    try:
        ray.get(stop_flag.request.remote(), timeout=STOP_REQUEST_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as e:
        raise RuntimeError(f"Ray did not take the request within {STOP_REQUEST_TIMEOUT_S:g} s ({type(e).__name__}): "
                           "its own processes got the signal too, as from a signal to the whole job, or are "
                           "gone") from e


def ray_checkpoint_config(config: TrainConfig) -> CheckpointConfig:
    """Ray's retention, the same as raysft's own without Ray (checkpoint.retention): checkpoint.keep latest, or with
    checkpoint.keep_best the N best by checkpoint.best_metric (Ray's checkpoint_score_attribute) plus the latest.
    Ray never prunes a checkpoint whose validation (the generation evaluation) is still pending."""
    c = config.checkpoint
    if c.keep_best:
        return CheckpointConfig(num_to_keep=c.keep_best, checkpoint_score_attribute=c.best_metric,
                                checkpoint_score_order=best_mode(c))
    return CheckpointConfig(num_to_keep=c.keep)


def gen_eval_validation(config: TrainConfig) -> ValidationConfig | None:
    """With an eval section, Ray Train's validation (raysft.launch.ray_controller.validate_checkpoint): a task of
    its own per reported checkpoint, which runs the evaluation as a task on eval.num_cpus / eval.num_gpus, its
    metrics joining the checkpoint's. Its timeout is Ray's last resort, RAY_GRACE_S after the evaluation's own
    (which records the timeout before it gives up). Its options: validation_task_options()."""
    if not config.eval.path:
        return None
    return ValidationConfig(validate_checkpoint,
                            task_config=ValidationTaskConfig(fn_kwargs=validation_kwargs(config),
                                                             timeout_s=config.eval.timeout_s + RAY_GRACE_S),
                            ray_remote_kwargs=validation_task_options())


def validation_task_options() -> dict:
    """Ray's options of the validation task, which only waits on the evaluation's (VALIDATION_TASK_RESOURCES). Ray
    2.60 ends the run when that task's process or node dies (it takes only an ordinary error or a cancel as the
    validation's end), so it runs on this, the driver's, node: Ray Train places its controller there (the label
    selector of TrainController in DataParallelTrainer), so losing the node ends the run anyway. The death of its
    process alone is retried (max_retries)."""
    here = ray.get_runtime_context().get_node_id()
    return {**VALIDATION_TASK_RESOURCES, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def connect_ray(scaling: RaysftScaling, eval_cpus: float = 0.0) -> LocalRay | None:
    """Join the cluster in RAY_ADDRESS, or start a local Ray of our own (never another one found on this machine)
    with just enough logical CPUs for the workers, and for the generation evaluation's task (`eval_cpus`) beside
    them, so that it runs while they train; the one it started, if it did."""
    local = connect(num_cpus=math.ceil(scaling.num_workers * scaling.cpus_per_worker + eval_cpus))
    if local:
        print(f"raysft: a local Ray of its own; its logs: {local.logs}", flush=True)
        if local.linked_from:
            print(f"raysft: (RAY_TMPDIR is too long for Ray's socket paths: linked from {local.linked_from})",
                  flush=True)
    return local


def start_timeout_s() -> float:
    return float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))


def start_attempts(scaling: RaysftScaling) -> int:
    """Ray counts every worker-group start that timed out; this many fill scaling.placement_timeout_s."""
    return max(1, math.ceil(scaling.placement_timeout_s / start_timeout_s()))


def worker_resources(scaling: RaysftScaling) -> dict[str, float]:
    return {"CPU": scaling.cpus_per_worker, **({"GPU": 1.0} if scaling.use_gpu else {})}


def workers_per_node(scaling: RaysftScaling) -> list[int]:
    """How many workers each live node holds when idle, one entry per node IP (Ray Train's notion of a node:
    logical nodes sharing an IP are one)."""
    need = worker_resources(scaling)
    per_ip: dict[str, int] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            ip = node.get("NodeManagerAddress", "")
            per_ip[ip] = per_ip.get(ip, 0) + int(min(res.get(k, 0.0) / v for k, v in need.items()))
    return list(per_ip.values())


def check_cluster_can_place(scaling: RaysftScaling) -> None:
    """Fail now, not after Ray's start timeouts, when the live nodes cannot hold the workers even when idle."""
    need = worker_resources(scaling)
    fits = sum(workers_per_node(scaling))
    if fits < (scaling.min_workers or scaling.num_workers):
        raise CannotPlaceWorkers(
            f"the Ray cluster fits {fits} workers of {need}, but scaling.num_workers={scaling.num_workers}"
            f"{f' (scaling.min_workers={scaling.min_workers})' if scaling.min_workers else ''}: lower "
            "scaling.num_workers or scaling.cpus_per_worker, set scaling.min_workers, or add nodes")


def check_cluster_can_evaluate(config: TrainConfig) -> None:
    """Refuse, before training, an evaluation no live node could ever start (eval.num_gpus GPUs, or eval.num_cpus
    CPUs, on one node): Ray would keep its task waiting, and every checkpoint's validation pending, for ever."""
    if not config.eval.path:
        return
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for key, resource, need in (("eval.num_gpus", "GPU", config.eval.num_gpus),
                                ("eval.num_cpus", "CPU", config.eval.num_cpus)):
        most = max((n.get(resource, 0.0) for n in nodes), default=0.0)
        if need > most:
            raise ConfigError(f"config key '{key}': {need:g}, but no node of the Ray cluster has more than "
                              f"{most:g} {resource}s: the generation evaluation could never start. Lower {key} "
                              f"(eval.num_gpus 0 runs it on CPUs) or add a node that has them")


def _quiet_console() -> dict:
    """RunConfig's logging_config: Ray Train's own lines at RAY_TRAIN_CONSOLE_LEVEL on the console."""
    return {"logging_config": LoggingConfig(log_level=RAY_TRAIN_CONSOLE_LEVEL)}
