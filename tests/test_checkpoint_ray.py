"""Checkpoints through real Ray Train: full and sharded, exact resume, stop_at_step, elastic resume across worker
counts, strategies and modes, incomplete checkpoints, streaming export."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_workers, tiny_config
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

import raysft
from raysft.checkpoint import MANIFEST_FILE, CheckpointError, auto_mode, incomplete_reason
from raysft.config import TrainConfig
from raysft.data import prepare_store
from raysft.hf_export import INDEX_FILE
from raysft.launch import ray_worker_context
from raysft.metrics import read_metrics
from raysft.tokenizer import load_tokenizer
from raysft.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
STEPS = 12


def config(tmp_path, name, **sets):
    return tiny_config(tmp_path, **{"train.max_steps": STEPS, "checkpoint.every_n_steps": 3, "run.name": name,
                                    "train.log_every_n_steps": 100, **sets})


def step_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(run_dir) if "loss" in m]


def exported_weights(checkpoint: Path, out: Path, **kw) -> dict[str, torch.Tensor]:
    raysft.export(checkpoint, out, **kw)
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    """The reference: 12 steps on 2 workers in one go."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = config(tmp, "reference", **{"checkpoint.mode": "auto"})
    result = raysft.train(cfg)
    start = next(m for m in read_metrics(cfg.run_dir) if m.get("event") == "start")
    assert start["checkpoint_mode"] == "full"  # auto: a tiny model's state fits rank 0's memory many times
    return step_losses(cfg.run_dir), exported_weights(Path(result.checkpoint.path), tmp / "hf")


def test_a_run_stopped_and_resumed_across_modes_equals_the_uninterrupted_one_bit_for_bit(tmp_path, uninterrupted):
    """Three launches of one run: sharded with async saves to step 4, full to step 8, sharded to the end. Each
    resumes from the other mode's checkpoint, and the run is the uninterrupted one, float for float."""
    ref_losses, ref_weights = uninterrupted
    legs = [{"checkpoint.mode": "sharded", "checkpoint.async": True, "train.stop_at_step": 4},
            {"checkpoint.mode": "full", "train.stop_at_step": 8},
            {"checkpoint.mode": "sharded"}]
    for sets in legs:
        cfg = config(tmp_path, "resumed", **{"checkpoint.keep": 9, **sets})
        result = raysft.train(cfg)
        stop = sets.get("train.stop_at_step", STEPS)
        ckpt = cfg.run_dir / f"checkpoint_{stop:08d}"
        assert Path(result.checkpoint.path) == ckpt
        state = json.loads((ckpt / "trainer_state.json").read_text())
        # the schedule stays 12 steps long, whatever step a launch stops at
        assert state["mode"] == sets["checkpoint.mode"] and state["scheduler"]["last_epoch"] == stop
        if sets["checkpoint.mode"] == "sharded":  # every worker wrote its own shard; the manifest lists them all
            files = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.json", "rng.safetensors"} <= \
                set(files)
            assert not (ckpt / "model.safetensors").exists()
        else:
            assert (ckpt / "model.safetensors").is_file() and not list(ckpt.glob("*.distcp"))

    records = read_metrics(cfg.run_dir)
    assert [m["step"] for m in records if m.get("event") == "stop"] == [4, 8]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [4, 8]
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*") if p.is_dir()) == \
        [f"checkpoint_{s:08d}" for s in (3, 4, 6, 8, 9, 12)]
    assert step_losses(cfg.run_dir) == ref_losses  # same floats, steps 1..12 each once
    weights = exported_weights(Path(result.checkpoint.path), tmp_path / "hf")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_elastic_resume_across_worker_counts_strategies_and_modes(tmp_path, uninterrupted):
    """4 → 2 → 4 → 2 workers, four strategies, sharded → sharded → full → sharded: the global batch, and so the
    samples and optimizer steps, stay the same; only the reduction order (float rounding) changes."""
    ref_losses, ref_weights = uninterrupted
    legs = [
        {"scaling.num_workers": 4, "parallel.sharding": "HYBRID_SHARD", "parallel.hsdp_shard_size": 2,
         "checkpoint.mode": "sharded", "train.stop_at_step": 3},
        {"scaling.num_workers": 2, "parallel.sharding": "FULL_SHARD", "checkpoint.mode": "sharded",
         "train.stop_at_step": 6},   # sharded, written by 4 workers, read by 2
        {"scaling.num_workers": 4, "parallel.sharding": "NO_SHARD", "checkpoint.mode": "full",
         "train.stop_at_step": 9},   # sharded by 2 → 4 workers; saves full
        {"scaling.num_workers": 2, "parallel.sharding": "SHARD_GRAD_OP",
         "checkpoint.mode": "sharded"},  # full → sharded
    ]
    for sets in legs:
        cfg = config(tmp_path, "elastic", **{"train.micro_batch_size": 2, "checkpoint.keep": 9, **sets})
        result = raysft.train(cfg)
    # HSDP's two replicas hold the same values: together they wrote each tensor once (weights + 2 AdamW moments)
    hsdp = cfg.run_dir / "checkpoint_00000003"
    written = sum(f.stat().st_size for f in hsdp.glob("__*_0.distcp"))
    once = 3 * 4 * sum(v.numel() for v in ref_weights.values())
    assert len(list(hsdp.glob("__*_0.distcp"))) == 4 and once <= written < 1.05 * once, (written, once)
    resumes = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [3, 6, 9]
    losses = step_losses(cfg.run_dir)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    torch.testing.assert_close([v for _, v in losses], [v for _, v in ref_losses], rtol=1e-4, atol=1e-5)
    weights = exported_weights(Path(result.checkpoint.path), tmp_path / "hf")
    for key, value in weights.items():
        torch.testing.assert_close(value, ref_weights[key], rtol=1e-3, atol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_resume_skips_an_incomplete_checkpoint_and_says_so_and_ray_prunes_it_not_the_good_ones(tmp_path):
    first = config(tmp_path, "torn", **{"checkpoint.mode": "sharded", "train.stop_at_step": 6, "checkpoint.keep": 2})
    raysft.train(first)
    torn = first.run_dir / "checkpoint_00000006"
    shard = torn / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])  # a shard cut short, as by a dying upload
    with pytest.raises(CheckpointError, match="__1_0.distcp has .* bytes, the manifest says"):
        raysft.export(torn, tmp_path / "never")

    raysft.train(config(tmp_path, "torn", **{"checkpoint.mode": "sharded", "train.stop_at_step": 7,
                                             "checkpoint.keep": 2}))
    records = read_metrics(first.run_dir)
    skipped = [m for m in records if m.get("event") == "skipped_incomplete_checkpoint"]
    assert len(skipped) == 1 and skipped[0]["checkpoint"] == str(torn) and "__1_0.distcp" in skipped[0]["reason"]
    assert [m["step"] for m in records if m.get("event") == "resume"] == [3]
    # steps 4..6 are trained again; the new step-6 checkpoint gets its own directory beside the torn one. The torn
    # one took a place among Ray's checkpoint.keep=2 (it was registered whole): Ray deleted the step-3 one only once
    # 6.1 was registered, and the torn one once 7 was, so a complete checkpoint was there all along.
    assert sorted(p.name for p in first.run_dir.glob("checkpoint_*") if p.is_dir()) == \
        ["checkpoint_00000006.1", "checkpoint_00000007"]
    assert all(incomplete_reason(p) is None for p in first.run_dir.glob("checkpoint_*") if p.is_dir())

    # a flipped byte keeps the size; the checksum catches it, for export and (through the same check) for resume
    rng = first.run_dir / "checkpoint_00000007" / "rng.safetensors"
    data = bytearray(rng.read_bytes())
    data[-1] ^= 0xFF
    rng.write_bytes(bytes(data))
    assert incomplete_reason(rng.parent) == "rng.safetensors does not match its sha256 in the manifest"
    with pytest.raises(CheckpointError, match="rng.safetensors does not match its sha256"):
        raysft.export(rng.parent, tmp_path / "never")


def test_export_streams_shards_with_an_index_that_transformers_loads(tmp_path):
    """A sharded checkpoint exported in shards of at most 1 MiB: safetensors shards + index, same weights."""
    cfg = config(tmp_path, "shards", **{"checkpoint.mode": "sharded", "train.max_steps": 3})
    result = raysft.train(cfg)
    out = raysft.export(result.checkpoint.path, tmp_path / "hf", max_shard_bytes=2**20)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((out / s).stat().st_size <= 2**20 + 2**16 for s in shards)
    assert not any(p.suffix == ".distcp" or p.name in ("trainer_state.json", MANIFEST_FILE) for p in out.iterdir())
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    merged = {}
    for s in shards:
        merged.update(load_file(out / s))
    assert set(merged) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in merged.items())


def _async_saves(loop: dict) -> None:
    """Async saves hold the state of the step they were asked for while training goes on, and a write that fails
    in the background fails the save on every rank."""
    import raysft.checkpoint as ckpt_module

    ctx = ray_worker_context()
    out = Path(loop["out"])
    cfg = TrainConfig.from_dict(loop["config"])

    def merge_like_ray(metrics, checkpoint_dir, step):  # what Ray does with every worker's directory
        if checkpoint_dir is not None:
            shutil.copytree(checkpoint_dir, out / f"{trainer.checkpoint_mode}-{step}", dirs_exist_ok=True)

    trainer = Trainer(cfg, Path(loop["store"]), None, merge_like_ray, ctx)
    trainer.model.train()
    for mode in ("sharded", "full"):
        trainer.checkpoint_mode = mode
        metrics = trainer.train_step()
        expected = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
        if ctx.rank == 0:
            save_file({k: v.contiguous() for k, v in expected.items()}, out / f"expected-{trainer.state.step}.st")
        trainer.save_checkpoint(metrics)
        assert trainer.pending is not None  # still being written
        trainer.train_step()
        trainer.train_step()  # the weights move on
        trainer.finish_checkpoint()
        dist.barrier()

    original = ckpt_module.save_file

    def failing_save_file(tensors, path, metadata=None):
        if Path(path).name == "model.safetensors":
            raise OSError("No space left on device (injected)")
        return original(tensors, path, metadata=metadata)

    if ctx.rank == 0:
        ckpt_module.save_file = failing_save_file
    outcome = "no error"
    try:
        trainer.save_checkpoint(trainer.train_step())
        trainer.train_step()
        trainer.finish_checkpoint()
    except CheckpointError as e:
        outcome = str(e)
    finally:
        ckpt_module.save_file = original
    (out / f"failure-rank{ctx.rank}.txt").write_text(outcome)


def test_async_save_keeps_its_step_while_training_goes_on_and_raises_background_failures(tmp_path):
    cfg = config(tmp_path, "async", **{"checkpoint.async": True})
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    run_workers(_async_saves, {"config": cfg.to_dict(), "store": str(store), "out": str(tmp_path)}, tmp_path)
    for mode, step in (("sharded", 1), ("full", 4)):
        expected = load_file(tmp_path / f"expected-{step}.st")
        weights = exported_weights(tmp_path / f"{mode}-{step}", tmp_path / f"hf-{mode}")
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], expected[k]) for k in weights), mode
    for rank in (0, 1):
        message = (tmp_path / f"failure-rank{rank}.txt").read_text()
        assert "writing the checkpoint of step 7 failed on 1 rank(s)" in message, message
    assert "No space left on device (injected)" in (tmp_path / "failure-rank0.txt").read_text()


@pytest.mark.parametrize("state_gb, available_gb, mode", [(1, 64, "full"), (16, 64, "full"), (17, 64, "sharded"),
                                                         (14 * 12, 512, "sharded")])
def test_auto_mode_gathers_only_what_rank_0_can_hold_four_times(state_gb, available_gb, mode):
    assert auto_mode(state_gb * 2**30, available_gb * 2**30) == mode
