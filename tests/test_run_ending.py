"""Errors no relaunch changes (raysft.errors.ends_the_run), met inside the ranks: the run ends on the first
occurrence and the user reads one line, no rank's traceback. Ray-free: the torchrun entry's launch
(raysft.launch.torchrun.run_launch) on the suite's gloo pair. Under Ray the same errors end the run without a
restart, as one line: tests/test_storage.py::
test_a_diverged_run_on_s3_ends_on_the_driver_through_the_bucket_not_retried_with_no_nan_checkpoint."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from conftest import cli_in_process

import raysft
import raysft.checkpoint.manifest as manifest_module
from raysft.checkpoint import MANIFEST_FILE, CheckpointError, CheckpointSaveError
from raysft.errors import ConfigError, DataError, WeightsFileError, ends_the_run
from raysft.launch.torchrun import launch

BASE = {"data.max_seq_len": 96, "train.max_steps": 2, "train.warmup_steps": 1, "train.log_every_n_steps": 100,
        "checkpoint.every_n_steps": 2}


def sets(tmp_path: Path, name: str, **more) -> list[str]:
    return [f"{k}={v}" for k, v in {**BASE, "run.name": name, "run.storage_path": str(tmp_path / "runs"),
                                    **more}.items()]


def _run_launch(ctx, overrides: list[str]) -> tuple[int, str]:
    """The torchrun entry's launch on this rank: its exit code and what it wrote to stderr."""
    from raysft.launch.torchrun import run_launch

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, _ = run_launch(ctx, None, overrides)
    return code, err.getvalue()


def _launch(ctx, overrides: list[str]) -> None:
    from raysft.config import load_config

    launch(ctx, load_config(None, overrides))


def run_ending(gloo_pool, overrides: list[str]) -> tuple[int, str]:
    """Both ranks' exit code (the same) and their stderr together."""
    (code0, err0), (code1, err1) = gloo_pool.run(_run_launch, overrides)
    assert code0 == code1, (code0, code1, err0, err1)
    return code0, err0 + err1


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def resign(ckpt: Path) -> None:
    """A manifest matching the files as they are now (a manifest proves completeness, not origin)."""
    (ckpt / MANIFEST_FILE).unlink()
    manifest_module.write_manifest(ckpt, 1, [manifest_module.durable_file_list(ckpt)])


@pytest.fixture(scope="module")
def full_run(gloo_pool, tmp_path_factory) -> tuple[Path, list[str]]:
    """A run of 2 steps with a full checkpoint at step 2, from the demo preset."""
    tmp = tmp_path_factory.mktemp("full")
    overrides = sets(tmp, "full", **{"checkpoint.mode": "full"})
    gloo_pool.run(_launch, overrides)
    return tmp, overrides


def caused_by(error: Exception, cause: Exception) -> Exception:
    """`error` as `raise error from cause` leaves it."""
    error.__cause__ = cause
    return error


def test_the_classification_ends_the_run_for_what_no_retry_changes_and_not_for_storage_hiccups():
    transient = caused_by(CheckpointError("ckpt/trainer_state.json: unreadable trainer state"),
                          OSError(5, "Input/output error"))
    disk_full = caused_by(CheckpointSaveError("step 4: writing model.safetensors failed"),
                          OSError(28, "No space left on device"))
    assert not ends_the_run(transient) and not ends_the_run(OSError(5, "EIO")) and not ends_the_run(RuntimeError())
    assert all(ends_the_run(e) for e in (disk_full, CheckpointError("refused index"), WeightsFileError("shape"),
                                         ConfigError("key"), DataError("record")))


def test_a_refused_split_index_at_resume_is_one_line(gloo_pool, full_run, tmp_path):
    tmp, overrides = full_run
    run = tmp_path / "runs" / "index"
    shutil.copytree(tmp / "runs" / "full", run)
    ckpt = run / "checkpoint_00000002"
    names = _tensor_names(ckpt / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in names} | {names[0]: "optimizer.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    resign(ckpt)
    code, stderr = run_ending(gloo_pool, sets(tmp_path, "index", **{"checkpoint.mode": "full",
                                                                    "train.max_steps": 4}))
    assert code == 1
    assert one_line(stderr).startswith(f"raysft: error: CheckpointError: {ckpt}/model.safetensors.index.json: "
                                       f"weight_map names 'optimizer.safetensors'"), stderr


def test_a_model_whose_config_disagrees_with_its_weights_is_one_line(gloo_pool, full_run, tmp_path):
    tmp, _ = full_run
    model = raysft.export(tmp / "runs" / "full" / "checkpoint_00000002", tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] - 32}))
    code, stderr = run_ending(gloo_pool, sets(tmp_path, "shapes", **{"model.path": str(model)}))
    assert code == 2  # found before any rank reads a weight: the weights' headers against the model's shapes
    assert one_line(stderr).startswith(f"raysft: config error: config key 'model.path': {model}/model.safetensors: "
                                       "tensor "), stderr
    assert "has shape [" in stderr and f"the model's is [{config['intermediate_size'] - 32}, " in stderr


def test_a_model_config_file_edited_between_launches_is_one_line(gloo_pool, full_run, tmp_path):
    tmp, _ = full_run
    config_file = tmp_path / "tiny.json"
    config = json.loads((tmp / "runs" / "full" / "checkpoint_00000002" / "config.json").read_text())
    config_file.write_text(json.dumps(config))
    first = sets(tmp_path, "edited", **{"model.config": str(config_file)})
    gloo_pool.run(_launch, first)
    config_file.write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 32}))
    code, stderr = run_ending(gloo_pool, [*first, "train.max_steps=4"])
    assert code == 1
    assert one_line(stderr).startswith("raysft: error: CheckpointError: "), stderr
    assert str(tmp_path / "runs" / "edited" / "checkpoint_00000002") in stderr


def test_a_sharded_checkpoint_as_model_path_is_refused_with_what_to_do(gloo_pool, tmp_path):
    """Refused on the driver (rank 0 without Ray) before the data is tokenized, under torchrun and `raysft train`
    alike, naming the export that makes it a model directory."""
    gloo_pool.run(_launch, sets(tmp_path, "sharded", **{"checkpoint.mode": "sharded"}))
    ckpt = tmp_path / "runs" / "sharded" / "checkpoint_00000002"
    expected = (f"raysft: config error: config key 'model.path': {ckpt} is a sharded raysft checkpoint: its weights "
                f"are in torch.distributed.checkpoint files (*.distcp), which no Hugging Face load reads. Export it "
                f"first (`raysft export {ckpt} OUT`) and use OUT")
    code, stderr = run_ending(gloo_pool, sets(tmp_path, "on-sharded", **{"model.path": str(ckpt)}))
    assert code == 2 and one_line(stderr).startswith(expected), stderr
    out = cli_in_process("train", "--set", f"model.path={ckpt}", *[f"--set={s}" for s in sets(tmp_path, "cli")])
    assert out.returncode == 2 and one_line(out.stderr).startswith(expected), out.stderr
    assert not (tmp_path / "runs" / "on-sharded").exists() and not (tmp_path / "runs" / "cli").exists()


def _tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())  # noqa: SIM118 - safe_open has no __iter__


def _rank_1_meets_it_alone(ctx) -> tuple[bool, ...]:
    import time

    from raysft.launch.torchrun import RunEndingReports

    reports = RunEndingReports(ctx.world_size)
    reports.AGREE_S = 0.5
    if ctx.rank == 1:
        return reports.count_in(), reports.every_rank()
    deadline = time.monotonic() + 30
    while not reports.any() and time.monotonic() < deadline:  # rank 0 stands for a rank inside a collective
        time.sleep(0.05)
    return (reports.any(),)


def test_a_rank_that_meets_the_error_alone_prints_it_and_waits_for_no_one(gloo_pool):
    """What the torchrun entry counts in the store when only rank 1 raised: rank 1 is the first (it prints the
    line) and finds within RunEndingReports.AGREE_S that the others did not meet it (it leaves without the barrier
    they would never reach); rank 0, whose collective breaks when rank 1 leaves, learns that a peer ended the run
    (it exits 1 without a word)."""
    assert gloo_pool.run(_rank_1_meets_it_alone) == [(True,), (True, False)]


def _rank_0_reads_with_an_io_error(ctx, overrides: list[str], ckpt: str) -> bool:
    """Resume from a full checkpoint while rank 0's read of its headers fails with EIO: whether this rank's error
    ends the run."""
    import errno

    import raysft.checkpoint.full as full
    from raysft.checkpoint import DirectorySink
    from raysft.config import load_config
    from raysft.data import prepare_store
    from raysft.data.tokenizer import load_tokenizer
    from raysft.training.trainer import Trainer

    cfg = load_config(None, overrides)
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)

    def eio(ckpt_dir, stem):
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as e:
            raise CheckpointError(f"{ckpt_dir}: cannot read: {e}") from e

    original = full.hf_shards.tensor_map
    full.hf_shards.tensor_map = eio if ctx.rank == 0 else original
    try:
        trainer.checkpointer.load(Path(ckpt))
    except CheckpointError as e:
        return ends_the_run(e)
    finally:
        full.hf_shards.tensor_map = original
    return True


def test_a_checkpoint_read_that_failed_on_an_io_error_on_rank_0_is_left_to_a_retry_on_every_rank(gloo_pool,
                                                                                                  full_run):
    """Rank 0 reads a full checkpoint's headers for all ranks: its storage hiccup reaches the others as its
    message, and none of them ends the run for it (Ray retries; the retry reads the checkpoint again)."""
    tmp, overrides = full_run
    assert gloo_pool.run(_rank_0_reads_with_an_io_error, overrides,
                         str(tmp / "runs" / "full" / "checkpoint_00000002")) == [False, False]
