"""Non-finite steps and loss spikes (raysft.training.step_guard) and the checkpoint's refusal of non-finite state, under
plain torch.distributed (the suite's gloo pair, no Ray)."""

import dataclasses
import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from conftest import run_config, step_losses, tiny_config
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import raysft.training.sft
from raysft.checkpoint import (
    STATE_FILE,
    Checkpointer,
    CheckpointError,
    DirectorySink,
    NonFiniteStateError,
    checkpoint_dirs,
    read_trainer_state,
)
from raysft.config import ConfigError
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.torchrun import launch
from raysft.training.metrics import progress_line, read_metrics
from raysft.training.trainer import Trainer


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> str:
    """One data store for the module's runs (the same demo data and length): tokenized once."""
    return str(tmp_path_factory.mktemp("stores"))


def _store(cfg):
    return prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(trainer: Trainer) -> dict:
    """This rank's weights, AdamW state (step counts included) and schedule position."""
    opt = {f"{i}.{k}": _local(v) for i, s in enumerate(trainer.optimizer.state.values()) for k, v in s.items()}
    return {"params": {n: _local(p) for n, p in trainer.model.named_parameters()}, "opt": opt,
            "lr_epoch": trainer.scheduler.last_epoch}


def _same(a: dict, b: dict) -> bool:
    return (a["lr_epoch"] == b["lr_epoch"] and a["opt"].keys() == b["opt"].keys()
            and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
            and all(torch.equal(a["opt"][k], b["opt"][k]) for k in a["opt"]))


def _skip_and_spike(ctx, cfg, store) -> dict:
    real = raysft.training.sft.micro_batch_loss_sum
    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    for _ in range(8):  # eight applied steps: the spike guard's history
        trainer.train_step()
    out = {}

    def poisoned(poison, ranks):
        def loss_sum(model, batch):
            ce = real(model, batch)
            return poison(ce) if ctx.rank in ranks else ce
        return loss_sum

    inf_only = torch.tensor(float("inf"))  # added, not multiplied: the loss is inf, the gradients stay finite
    for name, poison, ranks in (("nan_on_rank1", lambda ce: ce * float("nan"), {1}),
                                ("inf_on_both", lambda ce: ce * float("inf"), {0, 1}),
                                ("inf_loss_on_rank0", lambda ce: ce + inf_only, {0}),
                                ("spike", lambda ce: ce * 50.0, {0, 1})):
        before, cursor = _snapshot(trainer), trainer.sampler.cursor.state_dict()
        raysft.training.sft.micro_batch_loss_sum = poisoned(poison, ranks)
        try:
            metrics = trainer.train_step()
        finally:
            raysft.training.sft.micro_batch_loss_sum = real
        out[name] = {"unchanged": _same(before, _snapshot(trainer)), "metrics": metrics,
                     "cursor_moved": trainer.sampler.cursor.state_dict() != cursor}
    before = _snapshot(trainer)
    out["applied"] = {"metrics": trainer.train_step(), "changed": not _same(before, _snapshot(trainer))}
    out["skipped_steps"] = trainer.state.skipped_steps
    return out


def test_a_non_finite_or_spiking_step_is_skipped_on_every_rank_without_changing_anything(tmp_path, gloo_pool, stores):
    cfg = tiny_config(tmp_path, **{"train.loss_spike_factor": 3, "train.log_every_n_steps": 1,
                                   "data.store_dir": stores})
    ranks = gloo_pool.run(_skip_and_spike, cfg, _store(cfg))
    for out in ranks:
        for name in ("nan_on_rank1", "inf_on_both", "inf_loss_on_rank0", "spike"):  # one rank's NaN skips on both
            assert out[name]["unchanged"] and out[name]["cursor_moved"], name  # the batch is passed over
            assert out[name]["metrics"]["skipped"], name
        assert out["applied"]["changed"] and not out["applied"]["metrics"]["skipped"]
        assert out["skipped_steps"] == 4
    m = ranks[0]
    assert m["nan_on_rank1"]["metrics"]["skip_reason"].startswith("non-finite loss and gradient norm")
    assert m["inf_on_both"]["metrics"]["skip_reason"].startswith("non-finite loss")
    # the global gradient norm, as clip_grad_norm_ returned it on each rank (not summed over the ranks)
    inf_loss = m["inf_loss_on_rank0"]["metrics"]
    assert inf_loss["skip_reason"] == f"non-finite loss (loss inf, gradient norm {inf_loss['grad_norm']})"
    assert m["spike"]["metrics"]["skip_reason"].startswith("loss spike")
    assert m["applied"]["metrics"]["skipped_steps"] == 4
    assert "skipped 4" in progress_line(12, 20, {**m["applied"]["metrics"], "tokens_per_s": 1.0}, None)
    rows = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert [r["step"] for r in rows if r["skipped"]] == [9, 10, 11, 12] and rows[-1]["skipped_steps"] == 4
    events = [r for r in read_metrics(cfg.run_dir) if r.get("event") == "skipped_step"]
    assert [e["step"] for e in events] == [9, 10, 11, 12]


def test_lr_1e20_ends_the_run_naming_the_step_and_keeps_only_finite_checkpoints(tmp_path, gloo_pool, stores):
    """The issue's run: train.lr=1e20 trained 30 steps at loss nan, exited 0 and left NaN checkpoints. Now every
    non-finite step is skipped, the run ends with TrainingDivergedError after train.max_skipped_steps in a row,
    and every checkpoint on disk (checkpoint.keep: 2 prunes only among good ones) holds finite weights."""
    cfg = run_config(tmp_path, "lr1e20", **{"train.lr": 1e20, "train.max_steps": 30, "train.warmup_steps": 0,
                                            "checkpoint.every_n_steps": 1, "checkpoint.keep": 2,
                                            "train.max_skipped_steps": 4, "checkpoint.mode": "full",
                                            "data.store_dir": stores})
    with pytest.raises(RuntimeError, match=r"TrainingDivergedError: step (\d+): 4 steps in a row skipped "
                       r"\(train.max_skipped_steps=4\), the last for non-finite loss") as raised:
        gloo_pool.run(launch, cfg)
    stopped = int(raised.value.args[0].split("step ")[1].split(":")[0])
    assert stopped < 30
    rows = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert rows[-1]["step"] == stopped and all(r["skipped"] for r in rows[-4:])
    assert all(math.isfinite(r["loss"]) for r in rows if not r["skipped"])
    kept = checkpoint_dirs(cfg.run_dir)
    assert kept, "the checkpoints before the divergence are kept"
    for ckpt in kept:
        weights = load_file(ckpt / "model.safetensors")
        assert all(torch.isfinite(w).all() for w in weights.values()), ckpt.name
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["step"] <= stopped  # and the run's skips so far go into the checkpoint
        assert state["skipped_steps"] == sum(r["skipped"] for r in rows if r["step"] <= state["step"]) > 0


def _launch_with_spikes(ctx, cfg, spikes: set[int]) -> dict:
    """raysft.launch.torchrun.launch with the loss (and so the gradients) of the steps in `spikes` 50 times what it
    is."""
    real_loss, real_step = raysft.training.sft.micro_batch_loss_sum, Trainer.train_step
    current = [0]

    def train_step(self, *args, **kwargs):
        current[0] = self.state.step + 1
        return real_step(self, *args, **kwargs)

    def loss_sum(model, batch):
        ce = real_loss(model, batch)
        return ce * 50.0 if current[0] in spikes else ce

    raysft.training.sft.micro_batch_loss_sum, Trainer.train_step = loss_sum, train_step
    try:
        return launch(ctx, cfg)
    finally:
        raysft.training.sft.micro_batch_loss_sum, Trainer.train_step = real_loss, real_step


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_run_with_the_spike_guard_stopped_and_resumed_equals_the_uninterrupted_one_bit_for_bit(tmp_path, gloo_pool,
                                                                                                  stores):
    """The guard's recent losses and skips in a row go into the checkpoint: resumed at step 9, just after a skipped
    spike, the run skips the spike of step 10 as the uninterrupted run does (a fresh guard has no history to
    measure it against, and would apply it)."""
    sets = {"train.loss_spike_factor": 3, "train.log_every_n_steps": 1, "checkpoint.mode": "full",
            "checkpoint.keep": 9, "data.store_dir": stores}
    whole = run_config(tmp_path, "whole", **sets)
    gloo_pool.run(_launch_with_spikes, whole, {9, 10})
    for leg in ({"train.stop_at_step": 9}, {}):
        resumed = run_config(tmp_path, "resumed", **sets, **leg)
        gloo_pool.run(_launch_with_spikes, resumed, {9, 10})
    for run_dir in (whole.run_dir, resumed.run_dir):
        assert [r["step"] for r in read_metrics(run_dir) if r.get("event") == "skipped_step"] == [9, 10]
    assert [r["step"] for r in read_metrics(resumed.run_dir) if r.get("event") == "resume"] == [9]
    assert step_losses(resumed.run_dir) == step_losses(whole.run_dir)
    ends = [checkpoint_dirs(run_dir)[-1] for run_dir in (whole.run_dir, resumed.run_dir)]
    assert [d.name for d in ends] == ["checkpoint_00000012"] * 2
    weights = [load_file(d / "model.safetensors") for d in ends]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert read_trainer_state(ends[0])["step_guard"] == read_trainer_state(ends[1])["step_guard"]
    at_9 = read_trainer_state(resumed.run_dir / "checkpoint_00000009")["step_guard"]
    assert len(at_9["recent"]) == 8 and at_9["in_a_row"] == 1


@pytest.mark.parametrize("guard", [
    [], {"recent": []}, {"recent": "1.0", "in_a_row": 0}, {"recent": [1.0, float("nan")], "in_a_row": 0},
    {"recent": [True], "in_a_row": 0}, {"recent": [1.0] * 33, "in_a_row": 0}, {"recent": [], "in_a_row": -1},
    {"recent": [], "in_a_row": 1.5}])
def test_a_malformed_step_guard_state_is_a_checkpoint_error_naming_the_file(tmp_path, guard):
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps({"format_version": 1, "mode": "full", "step": 9, "cursor": {}, "scheduler": {},
                                "world_size": 2, "step_guard": guard}))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: step_guard: "):
        read_trainer_state(tmp_path)


def _refuse_non_finite(ctx, cfg, store, poison: str) -> dict:
    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    trainer.train_step()
    out = {}
    for mode, asynchronous in (("full", False), ("sharded", False), ("sharded", True), ("full", True)):
        name = f"{mode}{'-async' if asynchronous else ''}"
        run_dir = cfg.run_dir / name
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, mode=mode, async_save=asynchronous)
        checkpointer = Checkpointer(ckpt_cfg, trainer.objs, DirectorySink(run_dir, ctx.rank, keep=1), trainer.log,
                                    ctx.rank)
        dist.barrier()
        checkpointer.save(trainer.state, {})  # a good one, committed
        checkpointer.finish()
        good = trainer.state.step
        param = next(p for n, p in trainer.model.named_parameters() if n.endswith("layers.1.mlp.up_proj.weight"))
        tensor = param if poison == "weight" else trainer.optimizer.state[param]["exp_avg"]
        saved = _local(tensor)
        trainer.state.step += 1
        with torch.no_grad():
            if ctx.rank == 1:
                tensor.to_local()[0, 0] = float("nan")
        try:
            checkpointer.save(trainer.state, {})
            checkpointer.finish()
            out[name] = "saved"
        except NonFiniteStateError as e:
            out[name] = str(e)
        with torch.no_grad():
            tensor.to_local().copy_(saved)
        dist.barrier()
        out[name + "-kept"] = [json.loads((d / "trainer_state.json").read_text())["step"]
                               for d in checkpoint_dirs(run_dir)] == [good]
        out[name + "-staging"] = sorted(p.name for p in (run_dir / ".staging").glob("*")) if (
            run_dir / ".staging").exists() else []
    return out


@pytest.mark.parametrize("poison", ["weight", "optimizer"])
def test_a_checkpoint_of_nan_is_refused_in_every_layout_and_the_earlier_one_is_kept(tmp_path, gloo_pool, stores,
                                                                                    poison):
    cfg = run_config(tmp_path, f"nan-{poison}", **{"data.store_dir": stores})
    for out in gloo_pool.run(_refuse_non_finite, cfg, _store(cfg), poison):
        for name in ("full", "sharded", "sharded-async", "full-async"):
            assert re.match(r"step \d+: not saving a checkpoint of non-finite values \(rank 1: ", out[name]), out[name]
            what = "model.layers.1.mlp.up_proj.weight"
            assert (f"optimizer exp_avg of {what}" if poison == "optimizer" else f"rank 1: {what})") in out[name]
            assert out[name + "-kept"] and out[name + "-staging"] == [], name  # keep: 1 pruned nothing for it


@pytest.mark.parametrize(("key", "value"), [("train.max_skipped_steps", -1), ("train.loss_spike_factor", 0.5)])
def test_guard_settings_out_of_range_are_config_errors(tmp_path, key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_config(tmp_path, **{key: value})
