"""Checkpoints through real Ray Train: written straight into the run directory, registered where they lie, and a
run stopped and resumed through Ray equal, float for float, to the same run without Ray. (Elastic resume, torn
checkpoints, async saves and export run without Ray: tests/test_run.py, tests/test_checkpointer.py; a torn
checkpoint here, because what counts is how Ray prunes it.)"""

import json
from pathlib import Path

import pytest
import torch
from conftest import STEPS, run_config, step_losses
from safetensors.torch import load_file

import raysft
from raysft.checkpoint import MANIFEST_FILE, CheckpointError, incomplete_reason
from raysft.training.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name != MANIFEST_FILE)


def exported_weights(checkpoint: Path, out: Path, **kw) -> dict[str, torch.Tensor]:
    raysft.export(checkpoint, out, **kw)
    return load_file(out / "model.safetensors")


def test_a_run_stopped_and_resumed_through_ray_past_a_torn_checkpoint_equals_the_uninterrupted_one(tmp_path,
                                                                                                    uninterrupted):
    """Two launches of one run through Ray: sharded with async saves to step 6, then full to the end, the second
    found by run name. Between them a shard of checkpoint 6 is cut short (as by a dying upload): export refuses
    it, and the resume says so, skips it, and goes on from checkpoint 3, the newest whole one, registered by Ray
    where the workers wrote it (no copy). The run is the uninterrupted one, float for float (steps 4 to 6 trained
    again alike), logs and checkpoints what a Ray run should, and Ray's checkpoint.keep=2 prunes the torn one with
    the others. (Three-leg mode switches without Ray: tests/test_run.py.)"""
    ref_losses, ref_weights = uninterrupted
    legs = [{"checkpoint.mode": "sharded", "checkpoint.async": True, "train.stop_at_step": 6},
            {"checkpoint.mode": "full"}]
    torn = tmp_path / "runs" / "resumed" / "checkpoint_00000006"
    for sets in legs:
        cfg = run_config(tmp_path, "resumed", **{"checkpoint.keep": 2, **sets})
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
            assert ckpt == torn
            shard = torn / "__1_0.distcp"
            shard.write_bytes(shard.read_bytes()[:-7])
            with pytest.raises(CheckpointError, match="__1_0.distcp has .* bytes, the manifest says"):
                raysft.export(torn, tmp_path / "never")
        else:
            assert (ckpt / "model.safetensors").is_file() and not list(ckpt.glob("*.distcp"))

    records = read_metrics(cfg.run_dir)
    assert [m["step"] for m in records if m.get("event") == "stop"] == [6]
    skipped = [m for m in records if m.get("event") == "skipped_incomplete_checkpoint"]
    assert len(skipped) == 1 and skipped[0]["checkpoint"] == str(torn) and "__1_0.distcp" in skipped[0]["reason"]
    resume = [i for i, m in enumerate(records) if m.get("event") == "resume"]
    assert [records[i]["step"] for i in resume] == [3]
    assert [m["step"] for m in records[resume[0]:] if "loss" in m] == list(range(4, STEPS + 1))
    steps = [m for m in records if "loss" in m]
    assert all(m["tokens"] > 0 and m["mfu"] is None for m in steps)  # no known peak on a CPU
    assert "eta_s" not in steps[0] and steps[4]["eta_s"] > 0  # the ETA needs one step's duration
    last = [m for m in records if m.get("event") == "checkpoint"][-1]
    assert last["step"] == STEPS and last["gb"] * 1e9 == pytest.approx(dir_bytes(ckpt), abs=1e5)
    assert last["gb_per_s"] == pytest.approx(last["gb"] / last["save_s"], rel=0.05)
    assert {"model.safetensors", "config.json", "optimizer.safetensors", "rng.safetensors", "trainer_state.json",
            "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    assert state["step"] == STEPS
    assert state["cursor"] == {"seed": 0, "epoch": 0, "consumed": STEPS * cfg.train.global_batch_size}
    # the new step-6 checkpoint got its own directory beside the torn one; Ray kept the last two (the torn one
    # counted among them while it was newest, and went as 9 and 12 came)
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*") if p.is_dir()) == \
        [f"checkpoint_{s:08d}" for s in (9, 12)]
    assert all(incomplete_reason(p) is None for p in cfg.run_dir.glob("checkpoint_*") if p.is_dir())
    assert not (cfg.run_dir / ".staging").exists()
    assert step_losses(cfg.run_dir) == ref_losses[:6] + ref_losses[3:]  # same floats; 4..6 twice, alike
    weights = exported_weights(Path(result.checkpoint.path), tmp_path / "hf")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)

    # a flipped byte keeps the size; the checksum catches it, for export and (through the same check) for resume
    rng = ckpt / "rng.safetensors"
    data = bytearray(rng.read_bytes())
    data[-1] ^= 0xFF
    rng.write_bytes(bytes(data))
    assert incomplete_reason(rng.parent) == "rng.safetensors does not match its sha256 in the manifest"
    with pytest.raises(CheckpointError, match="rng.safetensors does not match its sha256"):
        raysft.export(rng.parent, tmp_path / "never")
