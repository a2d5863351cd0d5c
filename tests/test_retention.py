"""Which checkpoints stay in a run directory under Ray: Ray Train's own checkpoint manager (in this process, no
cluster) prunes what it tracks; a checkpoint whose report died with a worker is registered when the run resumes
(raysft.launch.ray_worker.register_lost_checkpoints), so the directory converges to checkpoint.keep (or keep_best)
however many reports were lost. The same faults through a real Ray: tests/test_faults_cluster.py."""

import asyncio
import json
import math
from pathlib import Path

import pytest
from conftest import tiny_config
from ray.train import Checkpoint
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.storage import StorageContext
from ray.train.v2._internal.execution.training_report import _TrainingReport

from raysft.checkpoint import STATE_FILE, checkpoint_dirs
from raysft.checkpoint.manifest import durable_file_list, write_manifest
from raysft.checkpoint.retention import unregistered
from raysft.launch.ray_driver import ray_checkpoint_config
from raysft.launch.ray_worker import recorded_metrics, scored_by


def saved(run_dir: Path, step: int, eval_loss: float | None = None, name: str | None = None) -> Path:
    """A complete checkpoint of `step` (its trainer state and a manifest), as a DirectorySink commit leaves it."""
    ckpt = run_dir / (name or f"checkpoint_{step:08d}")
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step, "eval_loss": eval_loss}))
    write_manifest(ckpt, step, [durable_file_list(ckpt)])
    return ckpt


class RayRun:
    """Ray Train's checkpoint manager for a run directory, with the CheckpointConfig raysft's driver gives Ray."""

    def __init__(self, tmp_path: Path, **sets):
        self.cfg = tiny_config(tmp_path, **sets)
        self.run_dir = self.cfg.run_dir
        self.run_dir.mkdir(parents=True)
        storage = StorageContext(str(self.run_dir.parent), self.run_dir.name)
        self.manager = asyncio.run(self._in_loop(lambda: CheckpointManager(ray_checkpoint_config(self.cfg), storage)))

    @staticmethod
    async def _in_loop(call):
        return call()  # the manager notifies its listeners through the running event loop

    def register(self, ckpt: Path) -> None:
        report = _TrainingReport(checkpoint=Checkpoint(str(ckpt)), validation=False,
                                 metrics=recorded_metrics(ckpt, scored_by(self.cfg)))
        asyncio.run(self._in_loop(lambda: self.manager.register_checkpoint(report)))

    def latest(self) -> str | None:
        result = self.manager.latest_checkpoint_result
        return Path(result.checkpoint.path).name if result else None

    def resume_from(self, ckpt: Path) -> None:
        """What a relaunch's workers register before training on from `ckpt`."""
        for lost in unregistered(self.run_dir, ckpt, self.latest()):
            self.register(lost)

    def on_disk(self) -> list[str]:
        return [p.name for p in checkpoint_dirs(self.run_dir)]

    def tracked(self) -> list[str]:
        snapshot = json.loads((self.run_dir / "checkpoint_manager_snapshot.json").read_text())
        return sorted(Path(r["checkpoint_dir_name"]).name for r in snapshot["checkpoint_results"])


def test_a_checkpoint_whose_report_died_with_a_worker_is_registered_at_resume_and_pruned(tmp_path):
    """A worker killed after the step-6 save, before Ray collected its report; the run resumes from 6, saves 12,
    18 and 24 with keep=2. Unregistered, 6 stayed forever (Ray never tracked it)."""
    run = RayRun(tmp_path, **{"checkpoint.keep": 2})
    six = saved(run.run_dir, 6)  # its report died with the worker
    run.resume_from(six)
    for step in (12, 18, 24):
        run.register(saved(run.run_dir, step))
    assert run.on_disk() == run.tracked() == ["checkpoint_00000018", "checkpoint_00000024"]


def test_several_lost_reports_are_registered_in_order_and_ray_keeps_only_checkpoint_keep(tmp_path):
    run = RayRun(tmp_path, **{"checkpoint.keep": 2})
    run.register(saved(run.run_dir, 3))
    lost = [saved(run.run_dir, s) for s in (6, 9, 12)]  # reported faster than Ray collected, then the worker died
    assert unregistered(run.run_dir, lost[-1], run.latest()) == lost
    run.resume_from(lost[-1])
    assert run.on_disk() == run.tracked() == ["checkpoint_00000009", "checkpoint_00000012"]
    assert run.latest() == "checkpoint_00000012"
    run.register(saved(run.run_dir, 15))
    assert run.on_disk() == run.tracked() == ["checkpoint_00000012", "checkpoint_00000015"]


def test_nothing_is_registered_again_when_ray_has_the_checkpoint_resumed_from_or_a_newer_one(tmp_path):
    run = RayRun(tmp_path, **{"checkpoint.keep": 3})
    six, nine = saved(run.run_dir, 6), saved(run.run_dir, 9)
    run.register(six)
    run.register(nine)
    assert unregistered(run.run_dir, nine, run.latest()) == []  # Ray's latest is the one resumed from
    # Ray's latest cut short (no manifest): the resume takes 6, and 9 is Ray's to prune once newer ones come
    (nine / "manifest.json").unlink()
    assert unregistered(run.run_dir, six, run.latest()) == []
    assert unregistered(run.run_dir, None, None) == []  # a fresh start


@pytest.mark.parametrize("lost_loss, kept", [
    (1.2, ["checkpoint_00000018", "checkpoint_00000024"]),  # the lost one is not the best: it goes
    (0.5, ["checkpoint_00000012", "checkpoint_00000024"]),  # the lost one is the best: its recorded loss keeps it
])
def test_keep_best_ranks_a_registered_lost_checkpoint_by_the_eval_loss_it_recorded(tmp_path, lost_loss, kept):
    run = RayRun(tmp_path, **{"checkpoint.keep_best": 1, "data.eval_fraction": 0.1})
    run.register(saved(run.run_dir, 6, eval_loss=1.0))
    twelve = saved(run.run_dir, 12, eval_loss=lost_loss)
    run.resume_from(twelve)
    run.register(saved(run.run_dir, 18, eval_loss=0.9))
    run.register(saved(run.run_dir, 24, eval_loss=0.95))
    assert run.on_disk() == run.tracked() == kept


def ray_validation(ckpt: Path, cfg) -> tuple:
    """What Ray's validation manager gets from raysft's validation function (the evaluation's, in this process):
    its metrics when it returns, a failed validation when it raises."""
    from dataclasses import asdict

    from ray.train.v2.api.reported_checkpoint import ReportedCheckpointStatus

    from raysft.evals.validation import validate_checkpoint

    try:
        return validate_checkpoint(Checkpoint(str(ckpt)), asdict(cfg.eval), cfg.data.system_prompt, "hf"), \
            ReportedCheckpointStatus.VALIDATED
    except Exception:  # noqa: BLE001 - what Ray's manager does with the task's error
        return {}, ReportedCheckpointStatus.VALIDATION_FAILED


def evaluated(run: RayRun, step: int, score: float | None) -> Path:
    """A checkpoint with its evaluation recorded as raysft's runner leaves it (score None: none, so evaluating it
    is tried, and fails on this checkpoint without weights)."""
    from raysft.checkpoint.gen_record import write_result
    from raysft.evals.runner import evaluation_key

    ckpt = saved(run.run_dir, step)
    if score is not None:
        write_result(ckpt, {"step": step, "finished": 1000.0 + step, "metrics": {"gen/exact_match": score},
                            "key": evaluation_key(run.cfg.eval, run.cfg.data.system_prompt, "hf"), "samples": 4,
                            "table": "samples.jsonl", "engine": "hf", "started": 999.0, "seconds": 1.0})
    return ckpt


def test_keep_best_by_a_generation_score_ranks_by_what_validation_adds_and_never_prunes_a_pending_one(tmp_path):
    """checkpoint.best_metric gen/exact_match against Ray's own checkpoint manager, with raysft's side real: each
    checkpoint reported with the score NaN and its validation asked for (raysft.launch.ray_worker), Ray keeping
    every pending one, then the metrics raysft's validation function returns (a recorded evaluation's) merged into
    each, and the one whose evaluation raises ranked last. The validation task under a real Ray:
    tests/test_train_ray.py."""
    from raysft.launch.ray_worker import evaluation_wanted, scored_metrics
    from raysft.storage import location

    run = RayRun(tmp_path, **{"checkpoint.keep_best": 1, "checkpoint.best_metric": "gen/exact_match",
                              "eval.path": "builtin:demo-eval", "eval.every_checkpoint": True})
    reports = {}
    for step, score in ((2, 0.5), (4, 0.9), (6, None), (8, 0.1)):
        ckpt = evaluated(run, step, score)
        metrics = scored_metrics({"step": step}, scored_by(run.cfg))
        assert math.isnan(metrics["gen/exact_match"])
        reports[step] = _TrainingReport(checkpoint=Checkpoint(str(ckpt)), metrics=metrics,
                                        validation=evaluation_wanted(run.cfg, location(ckpt), step))
        asyncio.run(run._in_loop(lambda r=reports[step]: run.manager.register_checkpoint(r)))
    assert all(r.validation for r in reports.values())
    assert run.on_disk() == [f"checkpoint_{s:08d}" for s in (2, 4, 6, 8)]  # all pending: none pruned
    for report in reports.values():
        result = ray_validation(Path(report.checkpoint.path), run.cfg)
        asyncio.run(run._in_loop(lambda c=report.checkpoint, r=result:
                                 run.manager.update_checkpoints_with_validation_result({c: r})))
    assert run.on_disk() == run.tracked() == ["checkpoint_00000004", "checkpoint_00000008"]  # the best, the latest


def test_checkpoints_saved_while_an_evaluation_runs_are_not_held_for_one(tmp_path):
    """eval.every_checkpoint false against Ray's own checkpoint manager (checkpoint.keep 1): a checkpoint saved
    while the evaluation asked for before has not ended is reported without a validation, so Ray prunes it as any
    other; only the one being evaluated and the run's last wait for theirs, however many were saved meanwhile."""
    from raysft.launch.ray_controller import evaluation_ended
    from raysft.launch.ray_worker import evaluation_wanted
    from raysft.storage import location

    run = RayRun(tmp_path, **{"checkpoint.keep": 1, "eval.path": "builtin:demo-eval", "train.max_steps": 12})
    reports = {}
    for step in range(2, 14, 2):  # step 2's evaluation runs all along; step 12 is the run's last
        ckpt = evaluated(run, step, 0.5)
        reports[step] = _TrainingReport(checkpoint=Checkpoint(str(ckpt)), metrics={"step": step},
                                        validation=evaluation_wanted(run.cfg, location(ckpt), step))
        asyncio.run(run._in_loop(lambda r=reports[step]: run.manager.register_checkpoint(r)))
    assert [s for s, r in reports.items() if r.validation] == [2, 12]
    assert run.on_disk() == ["checkpoint_00000002", "checkpoint_00000012"]  # 4 to 10 pruned at once
    for step in (2, 12):
        result = ray_validation(Path(reports[step].checkpoint.path), run.cfg)
        evaluation_ended(run.run_dir, f"checkpoint_{step:08d}")
        asyncio.run(run._in_loop(lambda c=reports[step].checkpoint, r=result:
                                 run.manager.update_checkpoints_with_validation_result({c: r})))
    assert run.on_disk() == run.tracked() == ["checkpoint_00000012"]


def scored(ckpt: Path, step: int, score: float) -> None:
    """The generation evaluation's record of `ckpt`, as the runner writes it: gen/exact_match = score."""
    from raysft.checkpoint.gen_record import write_result

    write_result(ckpt, {"step": step, "key": {}, "finished": 1000.0 + step, "metrics": {"gen/exact_match": score},
                        "samples": 4, "table": "samples.jsonl", "engine": "hf", "started": 999.0, "seconds": 1.0,
                        "cut": 0, "stderr": {"gen/exact_match": 0.25}})


def test_export_checkpoint_best_ranks_by_the_run_s_best_metric_or_metric_and_names_one_no_checkpoint_has(
        tmp_path, monkeypatch, capsys):
    """`raysft export RUN --checkpoint best` ranks by the checkpoint.best_metric the run's latest launch recorded
    (a gen/ score: no validation data, no eval loss), `--metric` overrides it, and a metric that no checkpoint
    recorded is an error naming it."""
    from raysft import cli
    from raysft.checkpoint.discovery import LAUNCH_CONFIG_FILE, RUN_FILE
    from raysft.products import export as export_module

    run = tmp_path / "run"
    for step, loss, score in ((2, 0.5, 0.25), (4, 0.9, 0.75), (6, 0.7, 0.5)):
        scored(saved(run, step, loss), step, score)
    (run / RUN_FILE).write_text("{}")
    exported = []
    monkeypatch.setattr(export_module, "export", lambda ckpt, out, **kw: exported.append(Path(ckpt).name) or out)

    def best(*flags: str) -> str | None:
        code = cli.main(["export", str(run), str(tmp_path / "out"), "--checkpoint", "best", *flags])
        return exported.pop() if code == 0 else None

    assert best() == "checkpoint_00000002"  # no record of the run's config (an older raysft's run): eval_loss
    (run / LAUNCH_CONFIG_FILE).write_text(json.dumps({"checkpoint": {"best_metric": "gen/exact_match",
                                                                    "best_mode": "auto"}}))
    assert best() == "checkpoint_00000004"  # the highest score: gen/ is higher-is-better
    assert "by gen/exact_match (highest)" in capsys.readouterr().out
    assert best("--metric", "eval_loss") == "checkpoint_00000002"
    (run / LAUNCH_CONFIG_FILE).write_text(json.dumps({"checkpoint": {"best_metric": "gen/exact_match",
                                                                    "best_mode": "min"}}))
    assert best() == "checkpoint_00000002"  # the run's own best_mode
    assert best("--metric", "gen/contains") is None
    assert "no checkpoint of the run has recorded gen/contains" in capsys.readouterr().err
