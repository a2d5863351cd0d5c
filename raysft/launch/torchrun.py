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
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.checkpoint import DirectorySink, UploadSink, existing_checkpoint_names, scratch_root
from raysft.config import ConfigError, TrainConfig, load_config
from raysft.errors import RUN_ENDING
from raysft.launch.lease import RunInUse, RunLease
from raysft.launch.prelaunch import Stores, prepare_launch
from raysft.launch.signals import EXIT_SIGINT, EXIT_SIGTERM, WorkerSignals, exit_process, stop_message
from raysft.parallel.collectives import from_rank0, process_group_backend
from raysft.training.trainer import Trainer, WorkerContext, resume_trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysft.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (default: the embedded demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--fresh", action="store_true", help="start the run over (the old one is kept, renamed)")
    args = parser.parse_args(argv)
    try:  # before the process group: parallel.cpu_offload decides its backend
        config, config_error = load_config(args.config, args.overrides), None
    except ConfigError as e:
        config, config_error = None, e
    ctx = init_distributed(cpu_offload=config is not None and config.parallel.cpu_offload)
    code, agreed = 1, False
    try:
        if config_error is not None:
            raise config_error
        signals = WorkerSignals(config.run.stop_grace_s)
        done = launch(ctx, config, args.fresh, signals.requested.is_set)
        code = 0
        if signals.requested.is_set() and done["step"] < (config.train.stop_at_step or config.train.max_steps):
            code = EXIT_SIGTERM  # stopped early, at a step every rank checkpointed
            if ctx.rank == 0:
                print(stop_message(signal.SIGTERM, config.run_dir, f"step {done['step']}"),
                      file=sys.stderr)
    except ConfigError as e:
        if ctx.rank == 0:
            print(f"raysft: config error: {e}", file=sys.stderr)
        code = 2
    except RUN_ENDING as e:  # raised on every rank at the same step: a message as `raysft train` prints, no traceback
        if ctx.rank == 0:
            print(f"raysft: error: {type(e).__name__}: {e}", file=sys.stderr)
        code, agreed = 1, True
    except KeyboardInterrupt:
        if ctx.rank == 0:
            print(stop_message(signal.SIGINT, None, None).splitlines()[0], file=sys.stderr)
        code = EXIT_SIGINT
    finally:
        end_distributed(agreed=agreed or code in (0, 2, EXIT_SIGTERM))
    return code


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
    the end or until `stop_requested` holds on some rank (then at a checkpointed step)."""
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
    def prepare() -> tuple[str, Stores | str]:
        try:
            if lease is not None:
                lease.check_free()  # before anything is tokenized or moved
            stores = prepare_launch(config, fresh)
            if lease is not None:
                lease.take()
            return "ok", stores
        except (ConfigError, RunInUse) as e:
            return "config", str(e)
        except Exception as e:  # noqa: BLE001 - raised on every rank below, not only on rank 0
            return "error", f"{type(e).__name__}: {e}"

    kind, value = from_rank0(prepare)
    if kind == "config":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(f"rank 0 could not prepare the run: {value}")
    return value


def train(config: TrainConfig, stores: Stores, ctx: WorkerContext,
          stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """Collective: train the run to train.max_steps (or stop_at_step), resuming from its newest checkpoint."""
    return run_trainer(config, stores, ctx, stop_requested).train()


def run_trainer(config: TrainConfig, stores: Stores, ctx: WorkerContext,
                stop_requested: Callable[[], bool] = lambda: False) -> Trainer:
    """Collective: the Trainer of this launch, resuming, with the sink for the run's storage."""
    taken = existing_checkpoint_names(config.run_dir)
    if isinstance(config.run_dir, Path):
        sink = DirectorySink(config.run_dir, ctx.rank, keep=config.checkpoint.keep, taken=taken,
                             keep_best=config.checkpoint.keep_best)
    else:
        scratch = scratch_root(config.run.name, config.run_dir)
        sink = UploadSink(config.run_dir, ctx.rank, config.checkpoint.keep, scratch, taken, config.checkpoint.keep_best)
    return resume_trainer(config, stores.train, ctx, sink, eval_store=stores.eval, stop_requested=stop_requested)


if __name__ == "__main__":
    exit_process(main())
