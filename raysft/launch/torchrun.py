"""raysft without Ray: the worker run under torchrun, with the same checkpoints and resume as under Ray.

    torchrun --nproc-per-node N [--nnodes M ...] -m raysft.run CONFIG.yaml [--set section.key=value ...] [--fresh]

Rank 0 tokenizes the data (or reuses the store) and claims the run directory; then every rank trains, writing
checkpoints into `<run.storage_path>/<run.name>` (pruned to checkpoint.keep): straight into the directory on a
local or shared (NFS) path, uploaded by each rank on s3://, gs://, ... A relaunch continues from the run's newest
complete checkpoint. Exit codes as `raysft train`: 2 for a configuration error, 143 when SIGTERM stopped it (each
rank checkpoints the step it is at first; torchrun's agent forwards the signal to every rank), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.checkpoint import DirectorySink, UploadSink, existing_checkpoint_names, remove_snapshots, scratch_root
from raysft.config import ConfigError, TrainConfig, best_mode, load_config
from raysft.distributed.collectives import from_rank0, process_group_backend
from raysft.errors import RunInUse, ends_the_run, run_ending_type
from raysft.evals.validation import EvaluatingSink
from raysft.launch.lease import RunLease
from raysft.launch.paths import resolve_paths
from raysft.launch.prelaunch import Stores, prepare_launch, with_max_steps
from raysft.launch.signals import EXIT_SIGINT, EXIT_SIGTERM, WorkerSignals, exit_process, stop_message
from raysft.training.trainer import Trainer, WorkerContext, resume_trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysft.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--fresh", action="store_true",
                        help="start the run over (the old one set aside: kept, renamed; its snapshots reclaimed)")
    args = parser.parse_args(argv)
    try:  # before the process group: parallel.cpu_offload decides its backend
        offload = load_config(args.config, args.overrides).parallel.cpu_offload
    except ConfigError:
        offload = False  # run_launch meets the error again and reports it, on every rank
    ctx = init_distributed(cpu_offload=offload)
    agreed = False
    try:
        code, agreed = run_launch(ctx, args.config, args.overrides, args.fresh)
    finally:
        end_distributed(agreed)
    if code == EXIT_SIGINT or (code == 1 and agreed):  # the run ended here (a crash is torchrun's to restart)
        with contextlib.suppress(Exception):  # a config that does not load: nothing of the run was snapshotted
            config = load_config(args.config, args.overrides)
            remove_snapshots(config.run_dir, config.checkpoint)  # (a normal end or a stop: Checkpointer.close)
    return code


def run_launch(ctx: WorkerContext, config_path: str | None, overrides: list[str], fresh: bool = False) \
        -> tuple[int, bool]:
    """Collective: load the config and launch the run; the exit code, and whether every rank ended the same way
    (then they leave the process group together). An error no relaunch changes (raysft.errors.ends_the_run),
    met by every rank or by some, is one line on stderr, from the first rank that met it, and exit 1 (2 for a
    config error); a rank whose collective broke because another rank ended so exits 1 without a word. Any other
    error is raised, with its traceback."""
    reports = RunEndingReports(ctx.world_size)
    try:
        config = load_config(config_path, overrides)
        signals = WorkerSignals(config.run.stop_grace_s)
        done = launch(ctx, config, fresh, signals.requested.is_set)
        if signals.requested.is_set() and done["step"] < done["end_step"]:
            if ctx.rank == 0:  # stopped early, at a step every rank checkpointed
                print(stop_message(signal.SIGTERM, config.run_dir, f"step {done['step']}"), file=sys.stderr)
            return EXIT_SIGTERM, True
        return 0, True
    except KeyboardInterrupt:
        if ctx.rank == 0:
            print(stop_message(signal.SIGINT, None, None).splitlines()[0], file=sys.stderr)
        return EXIT_SIGINT, False
    except Exception as e:
        if not ends_the_run(e):
            if reports.any():  # this rank's collective broke because another rank ended the run
                return 1, False
            raise
        first = reports.count_in()
        together = reports.every_rank()
        if (ctx.rank == 0) if together else first:  # rank 0's words where all ranks met it (its are the fullest)
            print(f"raysft: config error: {e}" if isinstance(e, ConfigError) else
                  f"raysft: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1, together


class RunEndingReports:
    """Which ranks of this launch met a run-ending error, counted in the process group's store: a rank that met
    one never waits in a collective for the others (they may be inside another one), so ranks that raise together
    print one line, and a rank that raised alone is neither silent nor waited for longer than AGREE_S. Each launch
    counts under a key of its own (a process may launch several runs on one process group)."""

    launches = 0
    AGREE_S = 5.0  # how long a rank that met the error waits for the others to meet it too

    def __init__(self, world_size: int):
        RunEndingReports.launches += 1
        self.key, self.world_size = f"raysft/run_ending/{RunEndingReports.launches}", world_size

    def _add(self, n: int) -> int:
        return dist.distributed_c10d._get_default_store().add(self.key, n)

    def count_in(self) -> bool:
        """Count this rank in; whether it is the first of the launch to meet a run-ending error."""
        return self._add(1) == 1

    def any(self) -> bool:
        """Whether some rank of this launch met one (False where the store cannot tell: the error is raised)."""
        try:
            return self._add(0) > 0
        except Exception:  # noqa: BLE001 - asked while another error is handled, which must not be hidden
            return False

    def every_rank(self) -> bool:
        """Whether every rank met it (within AGREE_S): then none of them is inside a collective."""
        deadline = time.monotonic() + self.AGREE_S
        while self._add(0) < self.world_size:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def end_distributed(agreed: bool) -> None:
    """Leave the process group; when every rank got this far the same way, only once all have (a rank that tears
    gloo down while another still talks to it can abort that one at exit)."""
    if agreed:
        dist.barrier()
    dist.destroy_process_group()


def init_distributed(cpu_offload: bool = False) -> WorkerContext:
    """The process group torchrun describes in the environment: NCCL with one GPU per process, else gloo; with
    `cpu_offload` on a GPU, gloo beside NCCL for the offloaded CPU tensors (process_group_backend)."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device.type, cpu_offload), device_id=device if gpu else None)
    return WorkerContext(dist.get_rank(), dist.get_world_size(), device, int(os.environ.get("GROUP_RANK", 0)))


def launch(ctx: WorkerContext, config: TrainConfig, fresh: bool = False,
           stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """Collective: one launch of the run on an initialized process group: prepare, claim, train (resuming) until
    the end or until `stop_requested` holds on some rank (then at a checkpointed step). A relative path in the config
    means what it means in the directory torchrun runs in, as under Ray (raysft.launch.paths). What `train`
    returns."""
    if config.live.enabled:
        raise ConfigError("config key 'live.enabled': live fault tolerance needs Ray, which replaces a lost worker "
                          "alone and runs the quorum's Lighthouse: launch with `raysft train`, or set it false")
    config = resolve_paths(config)
    lease = RunLease(config.run_dir) if ctx.rank == 0 else None  # one launch of a run at a time, as under Ray
    stores = prepare_on_rank0(config, fresh, lease)
    try:
        return train(config, stores, ctx, stop_requested)
    finally:
        if lease is not None:
            lease.release()


def prepare_on_rank0(config: TrainConfig, fresh: bool, lease: RunLease | None = None) -> Stores:
    """Collective: rank 0 prepares the stores, claims the run and takes its `lease` (if given); every rank gets the
    stores, or rank 0's error."""
    def prepare() -> tuple[str, Stores | str, str]:
        try:
            if lease is not None:
                lease.check_free()  # before anything is tokenized or moved
            stores = prepare_launch(config, fresh)
            if lease is not None:
                lease.take()
            return "ok", stores, ""
        except RunInUse as e:
            return "refused", str(e), ConfigError.__name__
        except Exception as e:  # noqa: BLE001 - raised on every rank below, not only on rank 0
            return ("refused" if ends_the_run(e) else "error"), str(e), type(e).__name__

    kind, value, name = from_rank0(prepare)
    if kind == "refused":
        raise run_ending_type(name)(value)
    if kind == "error":
        raise RuntimeError(f"rank 0 could not prepare the run: {name}: {value}")
    return value


def train(config: TrainConfig, stores: Stores, ctx: WorkerContext,
          stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """Collective: train the run to train.max_steps (or stop_at_step), resuming from its newest checkpoint. The
    last logged metrics with "step", the step reached, and "end_step", the step this launch was to end at (with
    train.num_epochs, derived from the data's size: the config's max_steps is not the run's length)."""
    trainer = run_trainer(config, stores, ctx, stop_requested)
    t = trainer.cfg.train
    return {**trainer.train(), "end_step": t.stop_at_step or t.max_steps}


def run_trainer(config: TrainConfig, stores: Stores, ctx: WorkerContext,
                stop_requested: Callable[[], bool] = lambda: False) -> Trainer:
    """Collective: the Trainer of this launch, resuming, with the sink for the run's storage; with an eval section,
    each committed checkpoint is evaluated in-process, blocking training (raysft.evals.validation.EvaluatingSink)."""
    config = with_max_steps(config, stores)  # train.num_epochs in steps, the same on every rank
    taken = existing_checkpoint_names(config.run_dir)
    c = config.checkpoint
    best = (c.best_metric, best_mode(c))
    if isinstance(config.run_dir, Path):
        sink = DirectorySink(config.run_dir, ctx.rank, keep=c.keep, taken=taken, keep_best=c.keep_best, best=best)
    else:
        scratch = scratch_root(config.run.name, config.run_dir)
        sink = UploadSink(config.run_dir, ctx.rank, c.keep, scratch, taken, c.keep_best, best)
    if config.eval.path:
        sink = EvaluatingSink(sink, config, ctx.rank, stop_requested)
    return resume_trainer(config, stores.train, ctx, sink, eval_store=stores.eval, stop_requested=stop_requested)


if __name__ == "__main__":
    exit_process(main())
