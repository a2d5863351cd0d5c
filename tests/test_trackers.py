"""metrics.trackers: TensorBoard, MLflow (a real `mlflow server` on loopback) and W&B (offline) get the run's steps,
config and each checkpoint's generation evaluation (its scores and per-sample table) from rank 0, and a resumed
launch continues the same tracker run; each is read back with its own library's reader. No Ray: a pair of gloo
processes runs the launches (raysft.run)."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import http_status, run_config, step_losses

from raysft.config import ConfigError
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics
from raysft.training.trackers import TRACKERS_FILE, check_trackers


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free loopback port, its store in a temp directory; ended by its pid's group at the end."""
    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--workers", "1",
                               "--default-artifact-root", str(root / "artifacts")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if http_status(f"{url}/health") == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started, and nothing else
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def launch_offline(ctx, cfg):
    """A launch in a worker whose W&B runs offline (W&B's own setting, read in the process that logs)."""
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    return launch(ctx, cfg)


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file (W&B's leveldb-style log: 32 KiB blocks of records,
    each with a 7-byte header; wandb 0.31 has no Python reader of its own any more)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        space = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if space >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += space
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_trackers_get_every_step_and_the_config_and_a_resume_continues_their_runs(tmp_path, gloo_pool,
                                                                                    mlflow_server):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "eval.jsonl").write_text('{"prompt": "What is 2 plus 3?", "answer": "5"}\n')  # scored at each save
    sets = {"train.max_steps": 6, "metrics.trackers": "[tensorboard, mlflow, wandb]",
            "metrics.mlflow_tracking_uri": mlflow_server, "eval.path": str(tmp_path / "eval.jsonl"),
            "eval.max_new_tokens": 4, "eval.scorers": "[contains]"}
    gloo_pool.run(launch_offline, run_config(tmp_path, "tracked", **sets, **{"train.stop_at_step": 4}))
    cfg = run_config(tmp_path, "tracked", **sets)
    gloo_pool.run(launch_offline, cfg)
    losses = dict(step_losses(cfg.run_dir))
    assert sorted(losses) == list(range(1, 7))
    ids = json.loads((cfg.run_dir / TRACKERS_FILE).read_text())

    board = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("loss")} == pytest.approx(losses, rel=1e-6)
    assert "config/text_summary" in board.Tags()["tensors"]
    scored = {e["step"]: e["gen/contains"] for e in read_metrics(cfg.run_dir) if e.get("event") == "gen_eval"}
    assert sorted(scored) == [3, 4, 6]  # each checkpoint's generation evaluation, logged once over both launches
    assert {e.step: e.value for e in board.Scalars("gen/contains")} == scored
    assert "gen/samples/text_summary" in board.Tags()["tensors"]  # the per-sample table, as Markdown

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("raysft").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]  # one run, continued by the second launch
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")}
    assert history == pytest.approx(losses, rel=1e-9)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["train.max_steps"] == "6" and run.data.params["train.stop_at_step"] == "4"
    assert run.data.tags["changed_at_step_4.train.stop_at_step"] == "0" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "gen/contains")] == sorted(
        scored.items())
    tables = [a.path for d in client.list_artifacts(ids["mlflow"], "gen_eval")
              for a in client.list_artifacts(ids["mlflow"], d.path)]
    assert tables == [f"gen_eval/checkpoint_{s:08d}/samples.jsonl" for s in (3, 4, 6)]

    files = sorted((cfg.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{ids['wandb']}.wandb" for f in files)  # one run, two launches
    logged, config, gen = {}, {}, {}
    for f in files:
        for record in wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                if "loss" in row:
                    logged[row["_step"]] = row["loss"]
                if "gen_step" in row:  # against the checkpoint's step, with the table beside
                    gen[row["gen_step"]] = (row["gen/contains"], row["gen/samples/_type"], row["gen/samples/nrows"])
            elif kind == "config":
                config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
    assert logged == pytest.approx(losses, rel=1e-9)
    assert gen == {step: (value, "table-file", 1) for step, value in scored.items()}  # a table of the 1 sample
    assert config["train.max_steps"] == "6" and config["run.name"] == "tracked"


def test_a_tracker_whose_library_is_missing_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ConfigError, match=r"metrics.trackers.*wandb.*pip install 'raysft\[wandb\]'"):
        check_trackers(run_config(tmp_path, "x", **{"metrics.trackers": "[wandb]"}))
