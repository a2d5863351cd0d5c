"""raysft.run: the worker run without Ray (torchrun, or here a reused pair of gloo processes), with the same
checkpoints and resume as under Ray, written once, straight into the run directory; validation and keep_best on
the same processes (the rest of validation: tests/test_evaluation.py)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, STEPS, final_weights, model_file, run_config, step_losses
from transformers import AutoModelForCausalLM

import raysft
from raysft.checkpoint import MANIFEST_FILE, STAGING_DIR, STATE_FILE, CheckpointError, checkpoint_dirs
from raysft.checkpoint.retention import select_checkpoint
from raysft.cli import main as cli
from raysft.data import IGNORE_INDEX, prepare_store, read_store
from raysft.data.demo import DEMO_CONVERSATIONS
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_run_stopped_and_resumed_across_modes_equals_the_uninterrupted_one_bit_for_bit(tmp_path, gloo_pool,
                                                                                          uninterrupted):
    """Three launches: sharded with async saves to step 4, full to step 8, sharded to the end; each resumes from
    the other mode's checkpoint, and the run is the uninterrupted one, float for float."""
    ref_losses, ref_weights = uninterrupted
    legs = [{"checkpoint.mode": "sharded", "checkpoint.async": True, "train.stop_at_step": 4},
            {"checkpoint.mode": "full", "train.stop_at_step": 8},
            {"checkpoint.mode": "sharded"}]
    for sets in legs:
        cfg = run_config(tmp_path, "resumed", **{"checkpoint.keep": 9, **sets})
        gloo_pool.run(launch, cfg)
        stop = sets.get("train.stop_at_step", STEPS)
        ckpt = cfg.run_dir / f"checkpoint_{stop:08d}"
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["mode"] == sets["checkpoint.mode"] and state["scheduler"]["last_epoch"] == stop
        files = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
        if sets["checkpoint.mode"] == "sharded":  # both ranks wrote into the one directory, each its own shard
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.json"} <= set(files)
        # written once: the directory holds exactly the manifest's files and nothing is left aside
        assert {p.name for p in ckpt.iterdir()} == {*files, MANIFEST_FILE}
        assert not (cfg.run_dir / STAGING_DIR).exists()
    records = read_metrics(cfg.run_dir)
    assert [m["step"] for m in records if m.get("event") == "resume"] == [4, 8]
    saved = [m for m in records if m.get("event") == "checkpoint"]
    assert [m["step"] for m in saved] == [3, 4, 6, 8, 9, 12]
    for m in saved:  # the size reported is the size on disk (the event rounds to 0.1 MB)
        assert m["gb"] * 1e9 == pytest.approx(dir_bytes(cfg.run_dir / f"checkpoint_{m['step']:08d}"), abs=1e5)
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*")) == \
        [f"checkpoint_{s:08d}" for s in (3, 4, 6, 8, 9, 12)]
    assert step_losses(cfg.run_dir) == ref_losses
    weights = final_weights(cfg.run_dir, tmp_path / "hf")
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def launch_stopped_by_rank1(ctx, cfg, after_checks: int) -> dict:
    """A launch in which rank 1 alone asks to stop from its `after_checks`-th notice check on (as one rank that got
    SIGTERM first would), with a check after every step whatever the machine's speed."""
    import raysft.checkpoint.checkpointer as checkpointer_module

    checks, every_s = [], checkpointer_module.NOTICE_CHECK_S

    def stop_requested() -> bool:
        checks.append(1)
        return ctx.rank == 1 and len(checks) >= after_checks

    checkpointer_module.NOTICE_CHECK_S = 0.0
    try:
        return launch(ctx, cfg, stop_requested=stop_requested)
    finally:
        checkpointer_module.NOTICE_CHECK_S = every_s


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_stop_request_on_one_rank_stops_every_rank_at_one_checkpointed_step(tmp_path, gloo_pool, uninterrupted):
    """The stop request of SIGTERM (raysft.launch.signals) on rank 1 only: both ranks checkpoint the same step, say
    so and return; the relaunch goes on from that checkpoint to the uninterrupted run's losses and weights, bit for
    bit."""
    ref_losses, ref_weights = uninterrupted
    cfg = run_config(tmp_path, "stopped", **{"checkpoint.every_n_steps": 100})
    done = gloo_pool.run(launch_stopped_by_rank1, cfg, 5)
    step = done[0]["step"]
    assert step == done[1]["step"] == 5
    assert [p.name for p in cfg.run_dir.glob("checkpoint_*")] == [f"checkpoint_{step:08d}"]
    assert (cfg.run_dir / f"checkpoint_{step:08d}" / MANIFEST_FILE).is_file()
    assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "stopped"] == [step]
    gloo_pool.run(launch, cfg)
    assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == [step]
    assert step_losses(cfg.run_dir) == ref_losses
    weights = final_weights(cfg.run_dir, tmp_path / "hf")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_run_with_dropout_resumes_each_ranks_random_numbers_and_a_swap_of_them_shows(tmp_path, gloo_pool):
    """Dropout draws from each rank's RNG, so a resume must restore every rank's own state: stopped at step 3 and
    resumed, a run with attention dropout equals the uninterrupted one float for float, and with the two ranks'
    saved states swapped before the resume its losses after step 3 differ (the demo model has no dropout: without
    one, a resume that restored any RNG state would pass every other resume test)."""
    dropout = {"model.config": model_file(tmp_path / "model", attention_dropout=0.1), "train.max_steps": 6}
    reference = run_config(tmp_path, "reference", **dropout)
    gloo_pool.run(launch, reference)
    losses = {}
    for name in ("resumed", "swapped"):
        gloo_pool.run(launch, run_config(tmp_path, name, **dropout, **{"train.stop_at_step": 3}))
        cfg = run_config(tmp_path, name, **dropout)
        if name == "swapped":
            swap_rank_rng_states(cfg.run_dir / "checkpoint_00000003")
        gloo_pool.run(launch, cfg)
        assert [m["step"] for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"] == [3]
        losses[name] = step_losses(cfg.run_dir)
    assert losses["resumed"] == step_losses(reference.run_dir)
    assert losses["swapped"][:3] == losses["resumed"][:3]
    assert all(a != b for a, b in zip(losses["swapped"][3:], losses["resumed"][3:], strict=True)), losses


BASE_SAVES = [{"checkpoint.mode": "full"}, {"checkpoint.mode": "sharded", "checkpoint.async": True}]


def launch_with_the_base_saved(ctx, cfg, then_train: bool) -> None:
    """A launch that saves the base (step 0) before its first step, as `train()` does with eval.at_start (whose
    generation evaluation of it is left out here), then trains on or stops there."""
    from raysft.launch.torchrun import prepare_on_rank0, run_trainer

    trainer = run_trainer(cfg, prepare_on_rank0(cfg, False), ctx)
    trainer.checkpointer.save(trainer.state, {}, urgent=True)
    if then_train:
        trainer.train()
    else:
        trainer.checkpointer.close(0)
        trainer.log.close()


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
@pytest.mark.parametrize("mode", BASE_SAVES,
                         ids=["full", "sharded-async"])
def test_saving_the_base_changes_no_training_float_and_a_resume_from_it_is_exact(tmp_path, gloo_pool, uninterrupted,
                                                                                  mode):
    """Before the first step the optimizer holds no state, and torch's get_optimizer_state_dict makes one by a step of
    zero gradients, which Adam counts in its bias correction: the base's checkpoint (eval.at_start) must not leave
    it to the training, nor to a launch that resumes from that checkpoint."""
    ref_losses, ref_weights = uninterrupted
    for name, then_train in (("trained", True), ("resumed", False)):
        cfg = run_config(tmp_path, name, **mode)
        gloo_pool.run(launch_with_the_base_saved, cfg, then_train)
        if not then_train:
            assert [c.name for c in checkpoint_dirs(cfg.run_dir)] == ["checkpoint_00000000"]
            gloo_pool.run(launch, cfg)
        assert step_losses(cfg.run_dir) == ref_losses, name
        weights = final_weights(cfg.run_dir, tmp_path / f"hf-{name}")
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), name


def swap_rank_rng_states(ckpt: Path) -> None:
    """Ranks 0 and 1's RNG states exchanged in a checkpoint, its manifest made to match (a complete checkpoint)."""
    from safetensors.torch import load_file, save_file

    rng = ckpt / "rng.safetensors"
    states = load_file(rng)
    states["cpu.0"], states["cpu.1"] = states["cpu.1"], states["cpu.0"]
    save_file(states, rng)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"][rng.name] = {"size": rng.stat().st_size, "sha256": hashlib.sha256(rng.read_bytes()).hexdigest()}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name != MANIFEST_FILE)


def test_without_ray_checkpoint_keep_prunes_the_oldest(tmp_path, gloo_pool):
    cfg = run_config(tmp_path, "pruned", **{"checkpoint.keep": 2, "train.max_steps": 7,
                                            "checkpoint.every_n_steps": 2})
    gloo_pool.run(launch, cfg)
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*")) == ["checkpoint_00000006", "checkpoint_00000007"]


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_torchrun_runs_the_documented_command(tmp_path):
    """`torchrun -m raysft.run CONFIG --set ...` trains, checkpoints and exits 0."""
    common = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "raysft.run"]
    sets = ["--set", "data.max_seq_len=64", "--set", "train.max_steps=2", "--set", "train.warmup_steps=1",
            "--set", f"run.storage_path={tmp_path / 'runs'}", "--set", "run.name=cli"]
    env = {"PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false", "HOME": str(tmp_path)}
    done = subprocess.run([*common, *sets], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "cli" / "checkpoint_00000002" / MANIFEST_FILE).is_file()
    # a run that diverges ends every rank with the error's name and message, as `raysft train` does, no traceback
    diverged = [*sets, "--set", "run.name=nan", "--set", "train.lr=1e20", "--set", "train.max_skipped_steps=1"]
    done = subprocess.run([*common, *diverged], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "raysft: error: TrainingDivergedError: step 2: 1 steps in a row" in done.stderr
    assert "raysft/training/trainer.py" not in done.stderr, done.stderr[-3000:]  # no rank's traceback


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_elastic_resume_across_worker_counts_strategies_and_modes(tmp_path, uninterrupted, gloo_pool,
                                                                  gloo_pool4):
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
        cfg = run_config(tmp_path, "elastic", **{"train.micro_batch_size": 2, "checkpoint.keep": 9, **sets})
        (gloo_pool4 if sets["scaling.num_workers"] == 4 else gloo_pool).run(launch, cfg)
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
    weights = final_weights(cfg.run_dir, tmp_path / "hf")
    for key, value in weights.items():
        torch.testing.assert_close(value, ref_weights[key], rtol=1e-3, atol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


# --- validation (raysft.training.evaluation) and best checkpoints (raysft.checkpoint.retention) ---------------


def eval_file(tmp_path: Path) -> Path:
    """21 demo conversations: validation data that is not data.paths (and not a multiple of any batch)."""
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(json.loads(DEMO_CONVERSATIONS.read_text())[:21]))
    return path


def reference_eval_loss(ckpt: Path, store: Path, out: Path) -> float:
    """The eval loss recomputed in one process, from the exported weights, sample by sample."""
    model = AutoModelForCausalLM.from_pretrained(raysft.export(ckpt, out), dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in read_store(store, ["input_ids", "labels"]).to_pylist():
            logits = model(torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            total += F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_validation_changes_no_training_float_and_resumes_exactly_and_elastically(tmp_path, gloo_pool, gloo_pool4,
                                                                                 uninterrupted):
    """2 workers to step 6, resumed on 2 to step 9, then on 4 workers to the end, validating every 4 steps and at
    every checkpoint: the training losses are those of a run without validation (bit for bit on the same workers,
    across the resume), and every eval loss is the one recomputed in a single process from that step's checkpoint."""
    data = {"data.eval_paths": f"[{eval_file(tmp_path)}]", "train.eval_every_n_steps": 4, "checkpoint.keep": 9}
    for stop in (6, 9):
        gloo_pool.run(launch, run_config(tmp_path, "validated", **data, **{"train.stop_at_step": stop}))
    cfg = run_config(tmp_path, "validated", **data, **{"scaling.num_workers": 4, "train.micro_batch_size": 2})
    gloo_pool4.run(launch, cfg)
    losses, without_eval = step_losses(cfg.run_dir), uninterrupted[0]
    assert losses[:9] == without_eval[:9]
    torch.testing.assert_close([v for _, v in losses], [v for _, v in without_eval], rtol=1e-4, atol=1e-5)
    evals = {m["step"]: m for m in read_metrics(cfg.run_dir) if "eval_loss" in m}
    assert sorted(evals) == [3, 4, 6, 8, 9, 12]  # every 4 steps and every checkpoint (every 3)
    assert all(m["eval_s"] > 0 and m["eval_tokens"] == evals[3]["eval_tokens"] for m in evals.values())
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir,
                          split="eval").path
    assert evals[3]["eval_tokens"] == sum(read_store(store, ["num_loss_tokens"])["num_loss_tokens"].to_pylist())
    for step in (6, 12):  # written by 2 and by 4 workers
        ckpt = cfg.run_dir / f"checkpoint_{step:08d}"
        assert json.loads((ckpt / STATE_FILE).read_text())["eval_loss"] == evals[step]["eval_loss"]
        assert evals[step]["eval_loss"] == pytest.approx(reference_eval_loss(ckpt, store, tmp_path / f"hf{step}"),
                                                         rel=1e-4)


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_export_picks_the_best_latest_or_a_step_of_a_run(tmp_path, gloo_pool):
    """keep_best=1 without Ray: what survives is the best by recorded eval loss and the latest; `raysft export RUN
    --checkpoint best` exports the best, `--checkpoint latest` the latest."""
    best = {"data.eval_fraction": 0.05, "checkpoint.keep_best": 1}
    gloo_pool.run(launch, run_config(tmp_path, "best", **best, **{"train.max_steps": 3}))
    cfg = run_config(tmp_path, "best", **best, **{"train.lr": 1.0, "train.max_steps": 9,  # a rate that makes it worse
                                                  "train.schedule_steps": 9})  # laid out again over the 9 steps
    gloo_pool.run(launch, cfg)  # resumed at step 3 with the higher rate
    evals = {m["step"]: m["eval_loss"] for m in read_metrics(cfg.run_dir) if "eval_loss" in m}
    assert sorted(evals) == [3, 6, 9]
    assert min(evals, key=evals.get) == 3, evals  # the first evaluation is the best: best and latest differ
    assert [d.name for d in checkpoint_dirs(cfg.run_dir)] == ["checkpoint_00000003", "checkpoint_00000009"]
    assert select_checkpoint(cfg.run_dir, "best").name == "checkpoint_00000003"
    assert select_checkpoint(cfg.run_dir).name == "checkpoint_00000009"
    for picked, step in (("best", 3), ("latest", 9)):
        assert cli(["export", str(cfg.run_dir), str(tmp_path / picked), "--checkpoint", picked]) == 0
        assert json.loads((tmp_path / picked / "raysft_export.json").read_text())["step"] == step
    with pytest.raises(CheckpointError, match="no complete checkpoint of step 5"):
        select_checkpoint(cfg.run_dir, "5")
    picked = ["--checkpoint", "best"]  # of a checkpoint directory: a mistake, not the directory itself
    assert cli(["export", str(cfg.run_dir / "checkpoint_00000009"), str(tmp_path / "x"), *picked]) == 1
