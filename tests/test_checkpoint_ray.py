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


def test_a_run_stopped_and_resumed_through_ray_equals_the_uninterrupted_one_bit_for_bit(tmp_path, uninterrupted):
    """Two launches of one run through Ray: sharded with async saves to step 6, then full to the end, the second
    found by run name and resumed from the checkpoint Ray registered where the workers wrote it (no copy); the run
    is the uninterrupted one, float for float, and logs and checkpoints what a Ray run should. (Three-leg mode
    switches without Ray: tests/test_run.py.)"""
    ref_losses, ref_weights = uninterrupted
    legs = [{"checkpoint.mode": "sharded", "checkpoint.async": True, "train.stop_at_step": 6},
            {"checkpoint.mode": "full"}]
    for sets in legs:
        cfg = run_config(tmp_path, "resumed", **{"checkpoint.keep": 9, **sets})
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
    assert [m["step"] for m in records if m.get("event") == "stop"] == [6]
    resume = [i for i, m in enumerate(records) if m.get("event") == "resume"]
    assert [records[i]["step"] for i in resume] == [6]
    assert [m["step"] for m in records[resume[0]:] if "loss" in m] == list(range(7, STEPS + 1))
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
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*") if p.is_dir()) == \
        [f"checkpoint_{s:08d}" for s in (3, 6, 9, 12)]
    assert not (cfg.run_dir / ".staging").exists()
    assert step_losses(cfg.run_dir) == ref_losses  # same floats, steps 1..12 each once
    weights = exported_weights(Path(result.checkpoint.path), tmp_path / "hf")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_resume_skips_an_incomplete_checkpoint_and_says_so_and_ray_prunes_it_not_the_good_ones(tmp_path):
    first = run_config(tmp_path, "torn", **{"checkpoint.mode": "sharded", "train.stop_at_step": 6,
                                            "checkpoint.keep": 2})
    raysft.train(first)
    torn = first.run_dir / "checkpoint_00000006"
    shard = torn / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])  # a shard cut short, as by a dying upload
    with pytest.raises(CheckpointError, match="__1_0.distcp has .* bytes, the manifest says"):
        raysft.export(torn, tmp_path / "never")

    raysft.train(run_config(tmp_path, "torn", **{"checkpoint.mode": "sharded", "train.stop_at_step": 7,
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
