"""Runs on remote storage: an S3-compatible server (moto) on loopback stands in for S3. Storage operations, the run
files, the manifest check and metrics on s3://, then real Ray Train runs that checkpoint into the bucket, resume
from it (sharded checkpoints read by each rank straight from storage), and export from it."""

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
import torch
from conftest import REPO, gloo_processes, ray_connection, tiny_config, train_ends_in_one_line
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import raysft
import raysft.checkpoint.manifest as manifest_module
import raysft.checkpoint.sharded as ckpt_module
from raysft import storage
from raysft.checkpoint import MANIFEST_FILE, ScratchSink, checkpoint_dirs, incomplete_reason
from raysft.checkpoint.dcp_read import StorageReader
from raysft.checkpoint.gen_record import run_records
from raysft.config import ConfigError, TrainConfig, config_from_dict
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch import lease as lease_module
from raysft.launch.lease import LEASE_FILE, RunInUse, RunLease
from raysft.launch.prelaunch import RUN_FILE, claim_run_dir
from raysft.launch.ray_controller import RUN_ENDING_PREFIX
from raysft.storage import Location, location
from raysft.training.metrics import MetricsLogger, read_metrics
from raysft.training.trainer import Trainer

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

BUCKET = "raysft"
STEPS = 8


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port, and the settings a user would export to reach it: credentials
    and AWS_ENDPOINT_URL_S3, which pyarrow's FileSystem.from_uri (what raysft and Ray use) honours."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint,
                    "AWS_EC2_METADATA_DISABLED": "true"}
        for key, value in settings.items():
            env.setenv(key, value)
        fs = pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True)
        fs.create_dir(BUCKET)
        yield SimpleNamespace(endpoint=endpoint, fs=fs, env=settings)
        storage.filesystem._RESOLVED.clear()
    server.stop()


@pytest.fixture(scope="module")
def ray_cluster(s3, ray_head):
    """The suite's Ray, with the S3 settings in this module's job's runtime_env: its workers get them as a cluster's
    workers do from `ray job submit --runtime-env-json '{"env_vars": ...}'`."""
    with ray_connection(ray_head.address, s3.env):
        yield


@pytest.fixture
def prefix(s3, request) -> str:
    """A fresh s3:// prefix for each test."""
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


def s3_config(tmp_path, prefix, **sets) -> TrainConfig:
    return tiny_config(tmp_path, **{"run.storage_path": f"{prefix}/runs", "data.store_dir": str(tmp_path / "datasets"),
                                    **sets})


# --- the storage module, config and run files, without Ray ------------------------------------------------------

def test_local_paths_map_as_before_and_uris_to_their_filesystem(tmp_path, prefix, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny_config(tmp_path, **{"run.storage_path": "~/runs"}).run_dir == tmp_path.resolve() / "runs" / "t"
    assert tiny_config(tmp_path, **{"run.storage_path": f"file://{tmp_path}"}).run_dir == tmp_path.resolve() / "t"
    run_dir = s3_config(tmp_path, prefix).run_dir
    assert isinstance(run_dir, Location) and isinstance(run_dir.fs, pafs.S3FileSystem)
    assert str(run_dir) == f"{prefix}/runs/t" and run_dir.path == f"{prefix.removeprefix('s3://')}/runs/t"
    assert not (REPO / "s3:").exists() and not Path("s3:").exists()  # nothing treats the URI as a local path


def test_remote_storage_needs_the_tokenized_store_on_a_shared_filesystem(tmp_path):
    with pytest.raises(ConfigError, match=r"data.store_dir.*run.storage_path is 's3://b/runs'.*every node can read"):
        tiny_config(tmp_path, **{"run.storage_path": "s3://b/runs"})
    with pytest.raises(ConfigError, match=r"data.store_dir.*got the URI 's3://b/datasets'"):
        tiny_config(tmp_path, **{"run.storage_path": "s3://b/runs", "data.store_dir": "s3://b/datasets"})


def test_location_lists_reads_writes_and_moves_objects(prefix):
    root = location(prefix)
    (root / "run/checkpoint_00000002/a.bin").write_bytes(b"12345")
    (root / "run/checkpoint_00000001/sub/b.bin").write_bytes(b"1")
    (root / "run/checkpoint_notes.txt").write_text("a file, not a checkpoint")
    (root / "run/other/c").write_text("c")
    assert [d.name for d in (root / "run").dirs("checkpoint_")] == ["checkpoint_00000001", "checkpoint_00000002"]
    assert [d.name for d in checkpoint_dirs(root / "run")] == ["checkpoint_00000001", "checkpoint_00000002"]
    assert (root / "run/checkpoint_00000001").files() == {"sub/b.bin": 1}
    assert (root / "run/checkpoint_notes.txt").read_text() == "a file, not a checkpoint"
    assert (root / "run/missing").files() == {} and (root / "run/missing").dirs() == []
    (root / "run/missing.json").delete()  # missing is fine
    (root / "run").move_dir(root / "moved")
    assert not (root / "run").exists() and (root / "moved/checkpoint_00000002/a.bin").read_bytes() == b"12345"


def test_workers_reach_the_store_through_the_drivers_filesystem_without_the_endpoint_setting(prefix):
    """What train_worker does with the filesystem Ray pickles from the driver, in a process whose environment
    has the credentials but not AWS_ENDPOINT_URL_S3 (a worker node's, say)."""
    root = location(prefix)
    (root / "probe.txt").write_text("hello")
    code = ("import pickle, sys; from raysft import storage; uri, fs, path = pickle.load(sys.stdin.buffer); "
            "storage.use_filesystem(uri, fs, path); print((storage.location(uri) / 'probe.txt').read_text())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((prefix, root.fs, root.path)), env=env,
                         cwd=REPO, capture_output=True, check=True, timeout=120)
    assert out.stdout.decode().strip() == "hello"


def test_a_run_on_s3_records_what_defines_it_and_fresh_keeps_the_old_one(tmp_path, prefix):
    cfg = s3_config(tmp_path, prefix)
    assert claim_run_dir(cfg, "data-a") is None
    assert json.loads((cfg.run_dir / RUN_FILE).read_text())["data"] == "data-a"
    (cfg.run_dir / "checkpoint_00000003/x").write_text("x")
    before = location(prefix).files()
    with pytest.raises(ConfigError, match=r"started with train.seed=0, this launch has 7.*--fresh"):
        claim_run_dir(s3_config(tmp_path, prefix, **{"train.seed": 7}), "data-a")
    assert location(prefix).files() == before  # refused before anything was written
    moved = claim_run_dir(s3_config(tmp_path, prefix, **{"train.seed": 7}), "data-a", fresh=True)
    assert str(moved).startswith(f"{prefix}/runs/t.replaced-") and (moved / "checkpoint_00000003/x").is_file()
    assert sorted((cfg.run_dir).files()) == [RUN_FILE]


def test_a_run_on_s3_is_held_by_one_launch_at_a_time(prefix, monkeypatch):
    monkeypatch.setattr(lease_module, "SETTLE_S", 0.1)
    run_dir = location(f"{prefix}/runs/t")
    with RunLease(run_dir) as first:
        assert json.loads((run_dir / LEASE_FILE).read_text())["token"] == first.token
        with pytest.raises(RunInUse, match=f"run directory {prefix}/runs/t is in use by another launch"):
            RunLease(run_dir).acquire()
    assert not (run_dir / LEASE_FILE).exists()  # released
    with RunLease(run_dir):  # and taken again
        pass


def test_the_manifest_check_on_s3_compares_sizes_and_the_small_files_checksums(tmp_path, prefix):
    """Remote: every size, and the sha256 of every file but the payload (hashing that would read the whole
    checkpoint through rank 0; full checkpoints' payload is checked as rank 0 downloads it)."""
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "__0_0.distcp").write_bytes(os.urandom(4096))
    (local / "trainer_state.json").write_text('{"step": 3}')
    manifest_module.write_manifest(local, 3, [manifest_module.durable_file_list(local)])
    remote = location(prefix) / "ckpt"
    for name in local.iterdir():
        (remote / name.name).upload(name)
    assert incomplete_reason(remote) is None

    shard = bytearray((local / "__0_0.distcp").read_bytes())
    shard[100] ^= 0xFF
    (remote / "__0_0.distcp").write_bytes(bytes(shard))
    assert incomplete_reason(remote) is None  # same size: payload is not hashed on remote storage ...
    assert incomplete_reason(remote, checksums=True) == "__0_0.distcp does not match its sha256 in the manifest"
    (remote / "__0_0.distcp").write_bytes(bytes(shard[:-7]))  # ... a cut-short upload is caught by its size
    assert incomplete_reason(remote) == "__0_0.distcp has 4089 bytes, the manifest says 4096"
    (remote / "__0_0.distcp").upload(local / "__0_0.distcp")
    (remote / "trainer_state.json").write_text('{"step": 4}')
    assert incomplete_reason(remote) == "trainer_state.json does not match its sha256 in the manifest"
    (remote / "trainer_state.json").delete()
    assert incomplete_reason(remote) == "trainer_state.json is missing"
    (remote / MANIFEST_FILE).delete()
    assert incomplete_reason(remote) == f"no {MANIFEST_FILE} (the save did not finish)"


def test_metrics_on_s3_are_uploaded_at_events_and_appended_across_launches(prefix):
    run_dir = location(prefix) / "run"
    first = MetricsLogger(run_dir, max_steps=100, log_every=10**9)
    first.event("start", world_size=2)
    first.step(1, {"loss": 2.0})
    assert [r.get("event") for r in read_metrics(run_dir)] == ["start"]  # a step waits for the next upload
    first.event("checkpoint", step=1)
    second = MetricsLogger(run_dir, max_steps=100, log_every=10**9)  # a relaunch, maybe on another node
    second.event("resume", step=1)
    assert [r.get("event", r.get("step")) for r in read_metrics(run_dir)] == ["start", 1, "checkpoint", "resume"]
    assert first.path != second.path and first.path.is_file()  # each appends to a local copy, then uploads


# --- real runs through Ray Train --------------------------------------------------------------------------------

def step_losses(run_dir) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(run_dir) if "loss" in m]


def export_weights(checkpoint, out: Path) -> dict[str, torch.Tensor]:
    raysft.export(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    return weights


@pytest.fixture(scope="module")
def runs(ray_cluster, s3_processes, tmp_path_factory):
    """An uninterrupted local run of 8 steps (without Ray: the same floats), and the same run on s3:// through Ray
    in two launches: stopped at step 3 (sharded), then continued (full: rank 0 alone writes) to the end, with its
    checkpoints' generation evaluation (Ray's validation task reading them from the bucket)."""
    from raysft.launch.torchrun import launch

    tmp = tmp_path_factory.mktemp("storage-runs")
    sets = {"train.max_steps": STEPS, "checkpoint.every_n_steps": 3, "checkpoint.keep": 9,
            "train.log_every_n_steps": 100}
    local = tiny_config(tmp, **{**sets, "run.name": "local", "checkpoint.mode": "sharded"})
    s3_processes.run(launch, local)
    remote = s3_config(tmp, f"s3://{BUCKET}/e2e", **{**sets, "run.name": "remote"})
    results = [raysft.train(s3_config(tmp, f"s3://{BUCKET}/e2e", **{**sets, "run.name": "remote", **leg}))
               for leg in ({"checkpoint.mode": "sharded", "train.stop_at_step": 3},
                           {"checkpoint.mode": "full", "eval.path": "builtin:demo-eval", "eval.max_samples": 4,
                            "eval.max_new_tokens": 4})]
    return SimpleNamespace(tmp=tmp, local=local, remote=remote, result=results[-1])


def test_a_run_on_s3_checkpoints_into_the_bucket_and_resumes_from_it_like_an_uninterrupted_local_run(runs):
    run_dir = runs.remote.run_dir
    assert isinstance(run_dir, Location)
    assert [d.name for d in checkpoint_dirs(run_dir)] == \
        ["checkpoint_00000003", "checkpoint_00000006", "checkpoint_00000008"]
    files = json.loads((run_dir / "checkpoint_00000003" / MANIFEST_FILE).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.json"} <= set(files)
    assert set((run_dir / "checkpoint_00000003").files()) == {*files, MANIFEST_FILE}
    assert "model.safetensors" in (run_dir / "checkpoint_00000006").files()
    assert all(incomplete_reason(d, checksums=True) is None for d in checkpoint_dirs(run_dir))
    assert (run_dir / RUN_FILE).is_file() and not any(f.name.startswith(RUN_ENDING_PREFIX) for f in run_dir.children())
    assert runs.result.checkpoint.filesystem.type_name == "s3"
    assert runs.result.checkpoint.path == f"{BUCKET}/e2e/runs/remote/checkpoint_00000008"

    records = read_metrics(run_dir)
    resumes = [m for m in records if m.get("event") == "resume"]
    assert [(r["step"], r["checkpoint"]) for r in resumes] == [(3, f"{run_dir}/checkpoint_00000003")]
    assert step_losses(run_dir) == step_losses(runs.local.run_dir)  # same floats, steps 1..8 each once
    assert not (REPO / "s3:").exists()
    # the second launch's checkpoints, evaluated from the bucket (or, saved while one ran, skipped), the last always
    events = {m["step"]: m["event"] for m in records if m.get("event", "").startswith("gen_eval")}
    assert events[8] == "gen_eval" and events.get(6) in ("gen_eval", "gen_eval_skipped"), events
    assert {name for name, kind, _ in run_records(run_dir) if kind == "result"} >= {"checkpoint_00000008"}


def test_export_reads_remote_checkpoints_of_both_modes_into_models_transformers_loads(runs):
    tmp, local_dir, run_dir = runs.tmp, runs.local.run_dir, runs.remote.run_dir
    for step in ("00000003", "00000006"):  # sharded (read piece by piece), full (downloaded)
        expected = export_weights(local_dir / f"checkpoint_{step}", tmp / f"local-{step}")
        weights = export_weights(f"{run_dir}/checkpoint_{step}", tmp / f"remote-{step}")
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def _load_from_storage(ctx, loop: dict) -> None:
    """Resume a Trainer from a sharded checkpoint on s3://, recording each rank's DCP reader and its bytes."""
    readers = []
    original = ckpt_module.dcp_reader

    def recording_reader(ckpt):
        readers.append(original(ckpt))
        return readers[-1]

    ckpt_module.dcp_reader = recording_reader
    try:
        trainer = Trainer(config_from_dict(loop["config"]), Path(loop["store"]), loop["checkpoint"],
                          ScratchSink(lambda *a: None, Path(loop["out"]) / f"scratch{ctx.rank}"), ctx)
    finally:
        ckpt_module.dcp_reader = original
    Path(loop["out"], f"rank{ctx.rank}.json").write_text(json.dumps({
        "step": trainer.state.step, "readers": [type(r).__name__ for r in readers],
        "bytes_read": sum(r.bytes_read for r in readers)}))


def test_a_sharded_checkpoint_on_s3_is_read_by_each_rank_from_storage_not_downloaded(runs, tmp_path, s3_processes):
    """Each rank fetches the byte ranges of its own shards: its own __<rank>_0.distcp (written by the same
    topology), nowhere near the whole checkpoint, and no rank downloads it first. (On the module's gloo pair: what
    is read is the Trainer's, with or without Ray.)"""
    ckpt = runs.remote.run_dir / "checkpoint_00000003"
    values = runs.remote.to_dict()
    cfg = config_from_dict({**values, "run": {**values["run"], "name": "load-probe"}})  # its own metrics
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    s3_processes.run(_load_from_storage, {"config": cfg.to_dict(), "store": str(store), "checkpoint": ckpt,
                                          "out": str(tmp_path)})
    sizes = ckpt.files()
    total = sum(size for name, size in sizes.items() if name.endswith(".distcp"))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["step"] == 3 and seen["readers"] == [StorageReader.__name__]
        own = sizes[f"__{rank}_0.distcp"]  # give or take the replicated scalars (AdamW's step), saved once
        assert 0.9 * own < seen["bytes_read"] < 1.1 * own < 0.6 * total, (rank, seen["bytes_read"], sizes)


def test_a_diverged_run_on_s3_ends_on_the_driver_through_the_bucket_not_retried_with_no_nan_checkpoint(
        tmp_path, prefix, ray_cluster):
    """train.lr=1e20 on s3:// through `raysft train`: the workers' TrainingDivergedError, a run-ending error, is
    left in raysft_error.<rank>.json in the bucket; the driver raises it instead of Ray retrying (scaling.max_failures
    3: no second start), and the terminal shows it as its one line. Every checkpoint Ray kept holds finite weights.
    (Which errors end a run: test_run_ending.py; the layout errors the workers meet: test_layout.py.)"""
    cfg = s3_config(tmp_path, prefix, **{"train.lr": 1e20, "train.warmup_steps": 0, "train.max_steps": 12,
                                         "checkpoint.every_n_steps": 2, "checkpoint.mode": "full",
                                         "train.max_skipped_steps": 3, "scaling.max_failures": 3})
    train_ends_in_one_line(cfg, tmp_path / "diverged.yaml", 1, r"raysft: error: TrainingDivergedError: step \d+: 3 "
                                                               r"steps in a row skipped .* non-finite loss.*")
    records = [json.loads(f.read_text()) for f in cfg.run_dir.children() if f.name.startswith(RUN_ENDING_PREFIX)]
    assert records and all(r["type"] == "TrainingDivergedError" for r in records), records
    assert [r["event"] for r in read_metrics(cfg.run_dir) if r.get("event") in ("start", "resume")] == ["start"]
    kept = checkpoint_dirs(cfg.run_dir)
    assert kept
    for ckpt in kept:
        weights = load_file(raysft.export(str(ckpt), tmp_path / ckpt.name) / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), ckpt.name


@pytest.fixture(scope="module")
def s3_processes(s3, tmp_path_factory):
    """Gloo processes of this module's own, started after the S3 settings are in the environment (they inherit
    them)."""
    with gloo_processes(2, tmp_path_factory.mktemp("gloo-s3")) as pool:
        yield pool


def test_without_ray_a_run_on_s3_uploads_each_checkpoint_and_resumes_from_it(tmp_path, prefix, s3_processes):
    """raysft.run on s3://: every rank uploads its files, rank 0 the manifest last; a relaunch resumes from the
    bucket (sharded → full, then from a full checkpoint in files with an index, which rank 0 downloads and
    broadcasts), and checkpoint.keep prunes there too; the vLLM engine evaluates such a checkpoint from its export
    on the bucket."""
    from raysft.launch.torchrun import launch

    sets = {"train.max_steps": 4, "checkpoint.every_n_steps": 1, "checkpoint.keep": 2, "run.storage_path": prefix,
            "data.store_dir": str(tmp_path / "store"), "train.log_every_n_steps": 100}
    s3_processes.run(launch, tiny_config(tmp_path, **{**sets, "checkpoint.mode": "sharded",
                                                              "train.stop_at_step": 3}))
    cfg = tiny_config(tmp_path, **{**sets, "checkpoint.mode": "full"})
    s3_processes.run(_launch_in_small_files, cfg)
    run = location(cfg.run_dir)
    assert [d.name for d in run.dirs("checkpoint_")] == ["checkpoint_00000003", "checkpoint_00000004"]
    assert incomplete_reason(run / "checkpoint_00000003") is None and incomplete_reason(run / "checkpoint_00000004") \
        is None
    assert {"__0_0.distcp", "__1_0.distcp"} <= set((run / "checkpoint_00000003").files())
    split = set((run / "checkpoint_00000004").files())
    assert {"model.safetensors.index.json", "optimizer.safetensors.index.json"} <= split, split
    assert "model.safetensors" not in split
    s3_processes.run(launch, tiny_config(tmp_path, **{**sets, "checkpoint.mode": "full", "train.max_steps": 5,
                                                      "train.schedule_steps": 5}))  # its LR laid out again
    assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == [3, 4]
    assert [d.name for d in run.dirs("checkpoint_")] == ["checkpoint_00000004", "checkpoint_00000005"]

    # the vLLM engine's model while it evaluates a remote checkpoint: its bf16 export, uploaded beside the checkpoint
    # (storage every node reads; Ray's vLLM stage downloads a URI on its node), gone once the evaluation ends
    from raysft.evals.runner import VLLM_EXPORT, model_directory

    ckpt = run / "checkpoint_00000005"
    expected = export_weights(ckpt, tmp_path / "fp32")
    with model_directory(ckpt, "vllm") as model:
        assert model == f"{prefix}/t/checkpoint_00000005/eval/{VLLM_EXPORT}", model
        shared = location(model)
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(shared.files()), shared.files()
        (shared / "model.safetensors").download(tmp_path / "bf16.safetensors")
        weights = load_file(tmp_path / "bf16.safetensors")
        assert weights.keys() == expected.keys()
        assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], expected[k].bfloat16())
                   for k in weights)
    assert shared.files() == {} and not any(f.name == VLLM_EXPORT for f in (ckpt / "eval").children())


def _launch_in_small_files(ctx, cfg) -> dict:
    """raysft.run's launch with full checkpoints cut into files of 256 KiB (HF's 5 GiB would keep a toy model in
    one file): in the pool's processes, where the save runs."""
    import raysft.hf.shards as hf_shards
    from raysft.launch.torchrun import launch

    default, hf_shards.SHARD_BYTES = hf_shards.SHARD_BYTES, 2**18
    try:
        return launch(ctx, cfg)
    finally:
        hf_shards.SHARD_BYTES = default
