"""Validation data and best checkpoints: a held-out split that never shares a record with training, the settings
that cannot work, keep_best retention. The runs with validation (exact and elastic resume, the eval loss against
a recomputation, keep_best and `raysft export RUN --checkpoint best`) are in tests/test_run.py, on its processes."""

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raysft.checkpoint import STATE_FILE
from raysft.checkpoint.retention import to_prune
from raysft.config import ConfigError, load_config
from raysft.data import IGNORE_INDEX, prepare_store, read_store, read_store_manifest
from raysft.data.dataloader import micro_batches
from raysft.data.store import write_samples
from raysft.data.tokenizer import load_tokenizer
from raysft.distributed.layout import SequenceShard
from raysft.training.evaluation import Evaluator


def test_eval_fraction_holds_the_same_records_out_every_time_and_never_trains_on_them(tmp_path):
    cfg = load_config(None, ["data.eval_fraction=0.1", "data.max_seq_len=64", f"data.store_dir={tmp_path}"])
    tok = load_tokenizer(cfg.model, cfg.data.chat_template)
    train = prepare_store(cfg.data, tok, tmp_path, split="train")
    held = prepare_store(cfg.data, tok, tmp_path, split="eval")
    whole = prepare_store(load_config(None, ["data.max_seq_len=64"]).data, tok, tmp_path)
    records = [set(read_store(s.path, ["record"])["record"].to_pylist()) for s in (train, held, whole)]
    assert not records[0] & records[1] and records[0] | records[1] == records[2]
    assert 0.05 < len(records[1]) / len(records[2]) < 0.15
    assert read_store_manifest(train.path)["counts"]["held_out"] == len(records[1])
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


def tiny_store(path: Path, lengths: list[int]) -> Path:
    """A store of samples 0..n-1, sample i of lengths[i] tokens, its label the token itself from the second on."""
    ids = [[(i + k) % 7 for k in range(n)] for i, n in enumerate(lengths)]
    labels = [[IGNORE_INDEX, *row[1:]] for row in ids]
    path.mkdir()
    write_samples(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                            "labels": pa.array(labels, pa.list_(pa.int32())),
                            "num_loss_tokens": pa.array([n - 1 for n in lengths], pa.int32()),
                            "num_tokens": pa.array(lengths, pa.int32())}), path / "samples.parquet")
    return path


class DrawingLM(torch.nn.Module):
    """Logits from an embedding table, and a draw from the global RNG in every forward (as dropout would)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(7, 7)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        torch.rand(3)
        return SimpleNamespace(logits=self.table(input_ids))


@pytest.fixture(scope="module")
def gloo_one():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env.setenv("MASTER_PORT", str(s.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def test_eval_loss_is_summed_over_label_tokens_and_leaves_the_rng_and_the_mode_as_they_were(tmp_path, gloo_one):
    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=4", "train.loss_chunk_tokens=0"])
    evaluator = Evaluator(tiny_store(tmp_path / "s", [3, 5, 2, 6, 4]), cfg, SequenceShard(0, 1), torch.device("cpu"),
                          pad_id=0)
    model = DrawingLM().train()
    before = torch.get_rng_state()
    result = evaluator.run(model)
    assert torch.equal(torch.get_rng_state(), before) and model.training
    total = sum(F.cross_entropy(model.table(torch.tensor(row[:-1])), torch.tensor(row[1:]), reduction="sum").item()
                for row in read_store(tmp_path / "s", ["input_ids"])["input_ids"].to_pylist())
    assert result["eval_tokens"] == 2 + 4 + 1 + 5 + 3 and result["eval_s"] > 0
    assert result["eval_loss"] == pytest.approx(total / result["eval_tokens"], rel=1e-6)


def test_every_rank_runs_as_many_eval_micro_batches_and_only_real_ones_count(tmp_path):
    """5 samples over 2 ranks in rounds of 4: rank 0 gets 3, rank 1 gets 2; FSDP needs the same number of forwards
    on both, so rank 1 runs one more, whose loss it drops. With a token budget, the same."""
    store = tiny_store(tmp_path / "s", [3, 5, 2, 6, 4])
    for sets in (["train.micro_batch_size=1"], ["data.packing=true", "train.micro_batch_tokens=512",
                                                "train.micro_batch_size=1", "data.max_seq_len=8"]):
        cfg = load_config(None, [*sets, "train.global_batch_size=4"])
        per_rank = [Evaluator(store, cfg, SequenceShard(r, 2), torch.device("cpu"), 0) for r in range(2)]
        cuts = [[(e._micro_batches(chunk)) for chunk in (np.arange(0, 4), np.arange(4, 5))] for e in per_rank]
        for round_ in range(2):
            assert len(cuts[0][round_]) == len(cuts[1][round_])
        real = sorted(int(i) for rank in cuts for round_ in rank for idx, ok in round_ if ok for i in idx)
        assert real == [0, 1, 2, 3, 4]  # every sample once, on one rank


def test_eval_cuts_a_round_into_micro_batches_as_training_cuts_a_step(tmp_path):
    """With a token budget, each rank's eval micro-batches of a full round are the ones training would cut from a
    global batch of those samples (raysft.data.dataloader.micro_batches), not a cut of their own."""
    lengths = [3, 5, 2, 6, 4, 7, 1, 8]
    store = tiny_store(tmp_path / "s", lengths)
    cfg = load_config(None, ["data.packing=true", "train.micro_batch_tokens=8", "data.max_seq_len=8",
                             "train.micro_batch_size=1", "train.global_batch_size=8"])
    chunk = np.arange(8)
    for rank in range(2):
        evaluator = Evaluator(store, cfg, SequenceShard(rank, 2), torch.device("cpu"), 0)
        trained = micro_batches(chunk, np.array(lengths), rank, 2, 1, 8)
        assert [(i.tolist(), real) for i, real in evaluator._micro_batches(chunk)] == [(i.tolist(), True)
                                                                                      for i in trained]
