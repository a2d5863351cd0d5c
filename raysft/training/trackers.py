"""Experiment trackers (metrics.trackers) fed by rank 0 beside metrics.jsonl, each through its own library, an
optional extra imported only when configured: TensorBoard (`raysft[tensorboard]`), MLflow (`raysft[mlflow]`),
Weights & Biases (`raysft[wandb]`).

Every backend is the same tiny interface, `Tracker`: `log(step, values)`, `log_eval(...)` (a generation evaluation's
scores at its checkpoint's step, and its per-sample table: a TensorBoard text, an MLflow artifact, a W&B table) and
`close()`. The run's config goes in as parameters when a backend opens. A run is one tracker run across all its
launches: the id each backend got is kept in `<run>/raysft_trackers.json` and reopened by a resumed launch, which
continues that run instead of starting another (TensorBoard: the same log directory, the steps trained again after
the checkpoint purged).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path
from typing import Protocol

from raysft.config import ConfigError, TrainConfig
from raysft.storage import location

TRACKERS_FILE = "raysft_trackers.json"
MODULES = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


class Tracker(Protocol):
    run_id: str
    """What reopens this tracker run in a resumed launch (kept in TRACKERS_FILE)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def log_eval(self, step: int, values: dict[str, float], rows: list[dict], table: Path, checkpoint: str) -> None:
        """A generation evaluation of the checkpoint of `step`: its scores, the first rows of its per-sample table
        and the table's file (raysft.training.gen_log)."""

    def close(self) -> None: ...


def check_trackers(cfg: TrainConfig) -> None:
    """On the driver, before any worker starts: every configured tracker's library imports, and what needs a
    local run directory has one. ConfigError naming metrics.trackers and the extra to install otherwise."""
    for name in cfg.metrics.trackers:
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            raise ConfigError(f"config key 'metrics.trackers': {name} needs its library, which does not import "
                              f"({e}): pip install 'raysft[{name}]'") from None
    remote = not isinstance(cfg.run_dir, Path)
    if remote and "tensorboard" in cfg.metrics.trackers:
        raise ConfigError("config key 'metrics.trackers': tensorboard writes event files into the run directory, "
                          f"which must be local or shared (NFS), not {cfg.run.storage_path}")
    if remote and "mlflow" in cfg.metrics.trackers and not _mlflow_uri(cfg, default=""):
        raise ConfigError("config key 'metrics.mlflow_tracking_uri': run.storage_path is remote, so MLflow has no "
                          "local store in the run directory: set a tracking server URI")


def flat_config(cfg: TrainConfig) -> dict[str, str]:
    """`section.key` -> value as text: the parameters every tracker records."""
    return {f"{section}.{key}": json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            for section, values in cfg.to_dict().items() for key, value in values.items()}


class Trackers:
    """The configured backends, opened (or reopened, on resume) on rank 0."""

    def __init__(self, cfg: TrainConfig, resume_step: int | None):
        self.ids_file = location(cfg.run_dir) / TRACKERS_FILE
        ids = json.loads(self.ids_file.read_text()) if self.ids_file.is_file() else {}
        self.backends: list[Tracker] = []
        try:
            for name in cfg.metrics.trackers:
                self.backends.append(BACKENDS[name](cfg, ids.get(name), resume_step))
        except BaseException:
            self.close()
            raise
        opened = {**ids, **{name: b.run_id for name, b in zip(cfg.metrics.trackers, self.backends, strict=True)}}
        if opened != ids:
            self.ids_file.write_text(json.dumps(opened, indent=1))

    def log(self, step: int, metrics: dict) -> None:
        values = {k: float(v) for k, v in metrics.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for backend in self.backends:
            backend.log(step, values)

    def log_eval(self, step: int, values: dict[str, float], rows: list[dict], table: Path, checkpoint: str) -> None:
        for backend in self.backends:
            backend.log_eval(step, values, rows, table, checkpoint)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


class TensorBoardTracker:
    """Event files in <run>/tensorboard; a resumed launch purges the steps after its checkpoint (TensorBoard's
    purge_step), so the curves show the run's surviving history. The config is a text summary per launch."""

    def __init__(self, cfg: TrainConfig, run_id: str | None, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = "tensorboard"
        self.writer = SummaryWriter(str(cfg.run_dir / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)
        table = "\n".join(f"| {k} | {v} |" for k, v in flat_config(cfg).items())
        self.writer.add_text("config", f"| key | value |\n| --- | --- |\n{table}", global_step=resume_step or 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_eval(self, step: int, values: dict[str, float], rows: list[dict], table: Path, checkpoint: str) -> None:
        self.writer.add_text("gen/samples", f"{checkpoint}: `{table}`\n\n{markdown_table(rows)}", global_step=step)
        self.log(step, values)

    def close(self) -> None:
        self.writer.close()


def _mlflow_uri(cfg: TrainConfig, default: str | None = None) -> str:
    uri = cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri or (f"sqlite:///{cfg.run_dir / 'mlflow.db'}" if default is None else default)


class MlflowTracker:
    """A run in experiment metrics.project named run.name, through MlflowClient (no global active run). MLflow
    parameters cannot change: a resumed launch adds the keys the run lacks and records changed values as tags
    `changed_at_step_<step>.<key>`."""

    def __init__(self, cfg: TrainConfig, run_id: str | None, resume_step: int | None):
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(_mlflow_uri(cfg))
        params = flat_config(cfg)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.metrics.project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                cfg.metrics.project)
            run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
            logged = {}
        else:
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = self.client.get_run(run_id).data.params
        self.run_id = run_id
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(run_id, params=new[i : i + 100])
        for key, value in params.items():
            if key in logged and logged[key] != value:
                self.client.set_tag(run_id, f"changed_at_step_{resume_step}.{key}", value)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_eval(self, step: int, values: dict[str, float], rows: list[dict], table: Path, checkpoint: str) -> None:
        self.log(step, values)
        self.client.log_artifact(self.run_id, str(table), artifact_path=f"gen_eval/{checkpoint}")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A run in project metrics.project named run.name, its files under the run directory when that is local.
    WANDB_MODE=offline (W&B's own setting) keeps it on disk for `wandb sync`."""

    def __init__(self, cfg: TrainConfig, run_id: str | None, resume_step: int | None):
        import wandb

        wandb_dir = cfg.run_dir if isinstance(cfg.run_dir, Path) else None
        self.run = wandb.init(project=cfg.metrics.project, name=cfg.run.name, id=run_id,
                              resume="allow" if run_id else None, dir=str(wandb_dir) if wandb_dir else None,
                              reinit="create_new")
        self.run.config.update(flat_config(cfg), allow_val_change=True)
        self.run_id = self.run.id
        # a generation evaluation ends after later steps were logged, and W&B refuses a step lower than its last:
        # the gen/ metrics are plotted against a step of their own, the checkpoint's
        self.run.define_metric(GEN_STEP)
        self.run.define_metric("gen/*", step_metric=GEN_STEP)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_eval(self, step: int, values: dict[str, float], rows: list[dict], table: Path, checkpoint: str) -> None:
        import wandb

        samples = wandb.Table(columns=list(TABLE_COLUMNS), data=[[_cell(r, c) for c in TABLE_COLUMNS] for r in rows])
        self.run.log({**values, GEN_STEP: step, "gen/samples": samples})

    def close(self) -> None:
        self.run.finish()


BACKENDS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}
GEN_STEP = "gen_step"  # W&B's step of the gen/ metrics: the evaluated checkpoint's training step
TABLE_COLUMNS = ("prompt", "generation", "expected", "scores")


def _cell(row: dict, column: str) -> str:
    value = row.get(column, "")
    return value if isinstance(value, str) else json.dumps(value)


def markdown_table(rows: list[dict]) -> str:
    """The per-sample table's rows as Markdown (TensorBoard renders text summaries as Markdown)."""
    def cell(row: dict, column: str) -> str:
        return _cell(row, column).replace("|", "\\|").replace("\n", " ")

    lines = [f"| {' | '.join(TABLE_COLUMNS)} |", f"|{'---|' * len(TABLE_COLUMNS)}"]
    return "\n".join(lines + [f"| {' | '.join(cell(r, c) for c in TABLE_COLUMNS)} |" for r in rows])
