"""Faults for tests/test_faults_cluster.py, armed from the test process and fired inside Ray's train workers.

`install` is the Ray `worker_process_setup_hook` of that test's cluster. It patches raysft when a worker imports
it. A test arms a fault by writing `<name>.json` into the directory in $RAYSFT_FAULTS_DIR; the fault fires once
(its file is removed when it fires), so the workers Ray starts after a failure run clean.

  pause_in_save  {"step": s}    rank 0 writes its part of the step-s checkpoint, then writes `paused.json` (its
                                pid and the part's directory) and sleeps: the test kills it in the middle of a save
  exit_before_report {"step": s}  rank 0 exits once the step-s checkpoint is complete in the run directory, before
                                it reports it to Ray: Ray never registers that checkpoint, and the run resumes from it
  disk_full      {"step": s}    rank 0's write of model.safetensors at step s fails with ENOSPC
  slow_steps     {"seconds": x} every train step takes x seconds longer (armed until removed); the first one
                                slowed writes `slowed`
  hold_at_step   {"step": s}    a worker whose state is at step s or later writes `held-<pid>-<step>` (and the live
                                quorum's Lighthouse address to `lighthouse`) and waits before its next step until the
                                fault is removed (armed until removed)
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

FAULTS_ENV = "RAYSFT_FAULTS_DIR"


def arm(faults_dir: Path, name: str, **params) -> None:
    (faults_dir / f"{name}.json").write_text(json.dumps(params))


def install() -> None:
    if os.environ.get(FAULTS_ENV):
        install_patches()
        _tick_the_autoscaling_coordinator_often()


def install_patches() -> None:
    """The patches alone, for every Python process of a `raysft train` command (tests/test_signals.py puts a
    sitecustomize calling this on its PYTHONPATH when $RAYSFT_FAULTS_DIR is set)."""
    sys.meta_path.insert(0, _PatchOnImport())


# Ray Train's elastic policy sizes the worker group from Ray Data's AutoscalingCoordinator, which refreshes its view
# of the nodes once per tick (20 s): a node just added is seen within a second in these tests instead.
COORDINATOR_TICK_S = 1


def _tick_the_autoscaling_coordinator_often() -> None:
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S = COORDINATOR_TICK_S


def _take(name: str, once: bool = True) -> dict | None:
    path = Path(os.environ[FAULTS_ENV]) / f"{name}.json"
    try:
        params = json.loads(path.read_text())
        if once:
            path.unlink()
        return params
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _peek(name: str, step: int) -> bool:
    path = Path(os.environ[FAULTS_ENV]) / f"{name}.json"
    try:
        return json.loads(path.read_text())["step"] == step
    except (FileNotFoundError, json.JSONDecodeError):
        return False


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the modules in PATCHES as they are imported, before anything binds their names."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_and_patch(module):
            execute(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_checkpoint(module) -> None:
    """module: raysft.checkpoint.checkpointer, whose Checkpointer calls start_save."""
    import torch.distributed as dist

    import raysft.checkpoint.full as full
    from raysft.hf.shards import MODEL_FILE

    start_save, write_safetensors = module.start_save, full.write_safetensors

    def faulty_start_save(out_dir, mode, objs, state, asynchronous=False, shared=False):
        rank0 = dist.get_rank() == 0
        if rank0 and _peek("disk_full", state.step):
            _take("disk_full")

            def full_disk(path, tensors, metadata=None, only=None):
                if Path(path).name == MODEL_FILE:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                return write_safetensors(path, tensors, metadata=metadata, only=only)

            full.write_safetensors = full_disk
            try:
                return start_save(out_dir, mode, objs, state, asynchronous, shared)
            finally:
                full.write_safetensors = write_safetensors
        pending = start_save(out_dir, mode, objs, state, asynchronous, shared)
        if rank0 and _peek("pause_in_save", state.step):
            _take("pause_in_save")
            paused = Path(os.environ[FAULTS_ENV]) / "paused.json"
            paused.write_text(json.dumps({"pid": os.getpid(), "part": str(out_dir)}))
            time.sleep(600)
        return pending

    module.start_save = faulty_start_save


def _patch_trainer(module) -> None:
    train_step = module.Trainer.train_step

    def slow_train_step(self, *args, **kwargs):
        faults = Path(os.environ[FAULTS_ENV])
        slow = _take("slow_steps", once=False)
        if slow:
            (faults / "slowed").touch()
            time.sleep(slow["seconds"])
        hold = _take("hold_at_step", once=False)
        if hold and self.state.step >= hold["step"]:
            (faults / "lighthouse").write_text(os.environ.get("TORCHFT_LIGHTHOUSE", ""))
            (faults / f"held-{os.getpid()}-{self.state.step}").touch()
            while (faults / "hold_at_step.json").exists() and _take("hold_at_step", once=False) == hold:
                time.sleep(0.05)
        return train_step(self, *args, **kwargs)

    module.Trainer.train_step = slow_train_step


def _patch_ray_worker(module) -> None:
    register_with_ray = module.register_with_ray

    def exit_before_report(final, metrics, *rest):
        params = _take("exit_before_report", once=False)
        if final is not None and params and final.name == f"checkpoint_{params['step']:08d}":
            _take("exit_before_report")
            os._exit(1)
        return register_with_ray(final, metrics, *rest)

    module.register_with_ray = exit_before_report


PATCHES = {"raysft.checkpoint.checkpointer": _patch_checkpoint, "raysft.training.trainer": _patch_trainer,
           "raysft.launch.ray_worker": _patch_ray_worker}
