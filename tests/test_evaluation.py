"""Validation data and best checkpoints: a held-out split that never shares a record with training, the settings
that cannot work, keep_best retention. The runs with validation (exact and elastic resume, the eval loss against
a recomputation, keep_best and `raysft export RUN --checkpoint best`) are in tests/test_run.py, on its processes."""

import json
from pathlib import Path

import pytest

from raysft.checkpoint import STATE_FILE
from raysft.config import ConfigError, load_config
from raysft.data import prepare_store, read_manifest, read_store
from raysft.retention import to_prune
from raysft.tokenizer import load_tokenizer


def test_eval_fraction_holds_the_same_records_out_every_time_and_never_trains_on_them(tmp_path):
    cfg = load_config(None, ["data.eval_fraction=0.1", "data.max_seq_len=64", f"data.store_dir={tmp_path}"])
    tok = load_tokenizer(cfg.model, cfg.data.chat_template)
    train = prepare_store(cfg.data, tok, tmp_path, split="train")
    held = prepare_store(cfg.data, tok, tmp_path, split="eval")
    whole = prepare_store(load_config(None, ["data.max_seq_len=64"]).data, tok, tmp_path)
    records = [set(read_store(s.path, ["record"])["record"].to_pylist()) for s in (train, held, whole)]
    assert not records[0] & records[1] and records[0] | records[1] == records[2]
    assert 0.05 < len(records[1]) / len(records[2]) < 0.15
    assert read_manifest(train.path)["counts"]["held_out"] == len(records[1])
    assert prepare_store(cfg.data, tok, tmp_path, split="eval").reused  # the same split: the same store


@pytest.mark.parametrize(("sets", "message"), [
    ({"data.eval_fraction": 0.1, "data.eval_paths": "[x.jsonl]"}, "not both"),
    ({"data.eval_paths": "[builtin:demo]"}, "also in data.paths"),
    ({"checkpoint.keep_best": 1}, "checkpoint.keep_best"),
    ({"train.eval_every_n_steps": 5}, "train.eval_every_n_steps"),
])
def test_validation_settings_that_cannot_work_are_config_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"{k}={v}" for k, v in sets.items()])


def fake_checkpoint(run_dir: Path, step: int, eval_loss: float | None) -> Path:
    ckpt = run_dir / f"checkpoint_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"step": step, "eval_loss": eval_loss}))
    return ckpt


def test_keep_best_keeps_the_lowest_eval_losses_and_the_latest(tmp_path):
    losses = {2: 1.5, 4: 0.9, 6: None, 8: 1.1, 10: 0.95, 12: 1.3}  # step 6: a preemption's, not validated
    ckpts = [fake_checkpoint(tmp_path, s, v) for s, v in losses.items()]
    kept = set(ckpts) - set(to_prune(ckpts, keep=2, keep_best=2))
    assert sorted(c.name for c in kept) == ["checkpoint_00000004", "checkpoint_00000010", "checkpoint_00000012"]
    assert to_prune(ckpts, keep=2) == ckpts[:-2]
