"""AdamW's settings and groups (raysft.training.optim): weight decay where the Hugging Face Trainer puts it, the
warmup convention, and a resume that applies this launch's optimizer settings in either checkpoint layout (a
reused pair of gloo processes, no Ray)."""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_config, tiny_config
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import (
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    get_cosine_schedule_with_warmup,
)
from transformers import Trainer as HFTrainer

from raysft.checkpoint import DirectorySink
from raysft.config import ConfigError, config_from_dict, load_config
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.model.build import build_meta_model, load_model_config
from raysft.model.lora import add_adapters
from raysft.model.seeded_init import clean_name
from raysft.training.optim import build_optimizer, lr_factor, param_groups


def decayed_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}


def hf_decay_set(model: torch.nn.Module) -> set[str]:
    """The Hugging Face Trainer's own choice (its method uses nothing of the Trainer instance)."""
    return set(HFTrainer.get_decay_parameter_names(None, model))


def test_the_decayed_parameters_are_the_hf_trainers_on_the_tiny_llama():
    cfg = tiny_config(Path("/nonexistent"))
    model = build_meta_model(load_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data.chat_template)), "sdpa")
    optimizer = build_optimizer(model, cfg.train)
    decayed = decayed_names(model, optimizer)
    assert decayed == hf_decay_set(model)
    assert "model.embed_tokens.weight" in decayed and "lm_head.weight" in decayed  # decayed there too
    not_decayed = set(dict(model.named_parameters())) - decayed
    assert not_decayed == {"model.norm.weight", *(f"model.layers.{i}.{n}.weight" for i in range(4)
                                                  for n in ("input_layernorm", "post_attention_layernorm"))}
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.train.weight_decay, 0.0]
    # []: every parameter decayed, in one group (what every earlier raysft did)
    cfg.train.weight_decay_exclude = []
    everything = build_optimizer(model, cfg.train)
    assert len(everything.param_groups) == 1 and decayed_names(model, everything) == set(dict(model.named_parameters()))


@pytest.mark.parametrize("config", [
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256),  # attention biases
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256),  # q_norm, k_norm
    Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),  # four norms a layer, tied embeddings
    MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256),
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, attention_bias=True, mlp_bias=True),
], ids=lambda c: c.model_type + ("-biases" if getattr(c, "mlp_bias", False) else ""))
def test_the_decayed_parameters_are_the_hf_trainers_on_other_llama_style_families(config):
    model = build_meta_model(config, "eager")
    optimizer = build_optimizer(model, tiny_config(Path("/nonexistent")).train)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model.get_parameter(n)) for n in hf_decay_set(model)}  # HF names a tied weight twice
    assert decayed != {id(p) for p in model.parameters()}


def test_lora_groups_hold_only_the_adapters():
    cfg = tiny_config(Path("/nonexistent"), **{"model.lora.r": 4})
    base = build_meta_model(load_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data.chat_template)), "sdpa")
    model = add_adapters(base, cfg.model.lora)
    groups = param_groups(model, cfg.train)
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert [id(p) for g in groups for p in g["params"]] == [id(p) for p in model.parameters() if p.requires_grad]
    assert {id(p) for g in groups for p in g["params"]} == trained and len(groups) == 1  # no bias, no norm adapted


def test_a_weight_decay_exclusion_that_is_no_regular_expression_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.weight_decay_exclude': '\(norm' is not a regular expression"):
        load_config(None, ["train.weight_decay_exclude=['(norm']"])
    with pytest.raises(ConfigError, match="train.eps"):
        load_config(None, ["train.eps=0"])


def test_warmup_gives_step_s_the_rate_hf_gives_step_s_plus_1():
    """raysft's step s (0-based) runs at (s + 1) / W of the rate; transformers' cosine schedule runs its step s at
    s / W, its first step at 0 (docs/CONFIGURATION.md, "The optimizer")."""
    cfg = tiny_config(Path("/nonexistent"), **{"train.warmup_steps": 4, "train.max_steps": 20,
                                               "train.min_lr_ratio": 0.0})
    hf = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 4, 20)
    hf_factor = hf.lr_lambdas[0]
    assert [lr_factor(s, cfg.train) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [hf_factor(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(lr_factor(s, cfg.train) == hf_factor(s + 1) for s in range(4))
    # after warmup both decay over max_steps - warmup_steps; raysft's step s is HF's step s there
    assert all(math.isclose(lr_factor(s, cfg.train), hf_factor(s)) for s in range(4, 20))



def test_a_resume_whose_schedule_length_changed_with_max_steps_alone_is_refused_and_schedule_steps_says_which():
    """The scheduler's state records its length; resumed by a launch whose max_steps lays the cosine out over
    another length, the LR would jump at once: refused, naming both ways on. train.schedule_steps at the old length
    goes on at the schedule's final LR; set to the new one, or a change that warmup hides, or nothing left to
    train, passes; a checkpoint that recorded no length is not checked."""
    from raysft.training.optim import build_lr_scheduler, check_lr_continues

    def resumed(step: int, saved: dict, **sets):
        cfg = tiny_config(Path("/nonexistent"), **{"train.warmup_steps": 2, "train.lr": 1e-3, **sets}).train
        scheduler = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr), cfg)
        scheduler.load_state_dict({**saved, "last_epoch": step})
        check_lr_continues(scheduler, cfg, step)
        return cfg, scheduler

    first = tiny_config(Path("/nonexistent"), **{"train.warmup_steps": 2, "train.max_steps": 10}).train
    saved = build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), first).state_dict()
    assert saved["length"] == 10 and "resumed_length" not in saved
    with pytest.raises(ConfigError, match=r"'train.max_steps': this launch lays the LR schedule out over 20 steps, "
                                          r"but the run's checkpoint of step 10 is on one of 10: the LR would jump "
                                          r"from 0\.0001 to 0\.000.* at step 11\. .* set train\.schedule_steps=10; .*"
                                          r"set train\.schedule_steps=20"):
        resumed(10, saved, **{"train.max_steps": 20})
    cfg, scheduler = resumed(10, saved, **{"train.max_steps": 20, "train.schedule_steps": 10})
    assert scheduler.length == 10 and scheduler.resumed_length == 10
    assert [lr_factor(s, cfg) for s in (10, 15, 19)] == [0.1, 0.1, 0.1]  # min_lr_ratio from the old end on
    resumed(10, saved, **{"train.max_steps": 20, "train.schedule_steps": 20})  # laid out again, knowingly
    resumed(1, saved, **{"train.max_steps": 20})  # in warmup: the same LR on either length
    resumed(10, saved, **{"train.max_steps": 10})  # nothing left to train
    resumed(10, {k: v for k, v in saved.items() if k != "length"}, **{"train.max_steps": 20})  # an older checkpoint


def test_num_epochs_is_max_steps_in_passes_over_the_store_and_not_both():
    """An epoch is the store's samples // global_batch_size steps (a step takes global_batch_size samples over all
    workers; the last partial batch is dropped); max_steps is num_epochs of them, rounded, at least 1. Setting
    max_steps too is refused naming both keys, and so is a stop_at_step past the derived end."""
    from raysft.launch.prelaunch import Stores, with_max_steps

    def steps(samples: int, **sets) -> int:
        config = load_config(None, [f"{k}={v}" for k, v in {"train.global_batch_size": 8, **sets}.items()])
        return with_max_steps(config, Stores(Path("store"), None, samples)).train.max_steps

    assert steps(1200, **{"train.num_epochs": 2}) == 300
    assert steps(100, **{"train.num_epochs": 3}) == 36  # 12 full batches an epoch, 4 samples dropped
    assert steps(100, **{"train.num_epochs": 0.5}) == 6
    assert steps(8, **{"train.num_epochs": 0.01}) == 1
    assert steps(1200, **{"train.max_steps": 7}) == 7  # without num_epochs: max_steps as it is
    with pytest.raises(ConfigError, match=r"'train.max_steps' and 'train.num_epochs' are both set"):
        load_config(None, ["train.max_steps=100", "train.num_epochs=2"])
    with pytest.raises(ConfigError, match=r"'train.stop_at_step': 40 is past the run's end, step 36"):
        steps(100, **{"train.num_epochs": 3, "train.stop_at_step": 40})
    with pytest.raises(ConfigError, match=r"'train.num_epochs': must be >= 0"):
        load_config(None, ["train.num_epochs=-1"])


@pytest.mark.parametrize("reached", [30, 20])
def test_torchrun_says_stopped_early_only_before_the_steps_num_epochs_derived(tmp_path, monkeypatch, capsys,
                                                                               reached):
    """A SIGTERM under torchrun: exit 143 and "stopped by SIGTERM" only if the launch stopped before its end, and
    with train.num_epochs that end is derived from the data's size (here 2 epochs of 120 // 8 = 30 steps), not the
    config's max_steps (300 by default): a run that reached step 30 finished."""
    from types import SimpleNamespace

    from raysft.launch import torchrun
    from raysft.launch.prelaunch import Stores
    from raysft.launch.signals import EXIT_SIGTERM

    class Trainer:  # what the launch trains with: the config the launch derived, and the step it got to
        def __init__(self, cfg, *args, **kwargs):
            self.cfg = cfg

        def train(self):
            return {"step": reached}

    monkeypatch.setattr(torchrun, "prepare_on_rank0", lambda *a, **k: Stores(tmp_path / "store", None, 120))
    monkeypatch.setattr(torchrun, "resume_trainer", Trainer)
    monkeypatch.setattr(torchrun, "WorkerSignals", lambda grace_s: SimpleNamespace(
        requested=SimpleNamespace(is_set=lambda: True)))  # a SIGTERM came during the launch
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        code, _ = torchrun.run_launch(SimpleNamespace(rank=0, world_size=1), None, [
            "train.num_epochs=2", "train.global_batch_size=8", f"run.storage_path={tmp_path}"])
    finally:
        dist.destroy_process_group()
    stderr = capsys.readouterr().err
    if reached == 30:
        assert (code, stderr) == (0, ""), "a run that reached its derived end was said to stop early"
    else:
        assert code == EXIT_SIGTERM and "step 20" in stderr, stderr

# --- a resume applies this launch's optimizer settings ---------------------------------------------------------

SAVED = {"train.lr": 3e-3, "train.betas": [0.9, 0.95], "train.eps": 1e-8, "train.weight_decay": 0.01}
LAUNCHED = {"train.lr": 1e-3, "train.betas": [0.8, 0.99], "train.eps": 1e-6, "train.weight_decay": 0.1}


def _settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _optimizer_built(fused: bool):
    """raysft's AdamW, fused as a launch on GPUs builds it (CPU has a fused AdamW too), or as it is here."""
    def build(model, cfg):
        optimizer = build_optimizer(model, cfg)
        for group in optimizer.param_groups:
            group["fused"] = True if fused else None
        return optimizer
    return build


def _resume_with_other_settings(ctx, saved: dict, launched: dict, store: Path, mode: str, per_rank: bool,
                                fused: tuple[bool, bool]) -> dict:
    """Two steps with `saved`'s settings, a checkpoint, and a Trainer of `launched`'s settings resumed from it (fused
    AdamW or not in each); what the resumed optimizer holds, and whether it steps."""
    import raysft.checkpoint.full as full
    import raysft.training.trainer as trainer_module
    from raysft.training.trainer import Trainer

    def trainer(cfg, resume_dir, fused_adamw):
        trainer_module.build_optimizer = _optimizer_built(fused_adamw)
        try:
            return Trainer(cfg, store, resume_dir, DirectorySink(cfg.run_dir, ctx.rank), ctx)
        finally:
            trainer_module.build_optimizer = build_optimizer

    first = config_from_dict(saved)
    first.run_dir.mkdir(parents=True, exist_ok=True)
    before = trainer(first, None, fused[0])
    before.checkpointer.mode = mode
    before.model.train()
    for _ in range(2):
        metrics = before.train_step()
    moments = _moments(before)
    before.checkpointer.save(before.state, metrics)
    dist.barrier()
    present = full._all_present
    full._all_present = present if per_rank else (lambda _: False)  # as on remote storage: rank 0 reads, broadcasts
    try:
        resumed = trainer(config_from_dict(launched), first.run_dir / "checkpoint_00000002", fused[1])
    finally:
        full._all_present = present
    got = {"settings": _settings(resumed.optimizer), "decayed": decayed_names(resumed.model, resumed.optimizer),
           "last_lr": resumed.scheduler.get_last_lr()}
    resumed_moments = _moments(resumed)
    got["same_moments"] = resumed_moments.keys() == moments.keys() and all(
        torch.equal(resumed_moments[k], v) for k, v in moments.items())
    resumed.model.train()
    return {**got, "finite_loss": math.isfinite(resumed.train_step()["loss"])}


def _moments(trainer) -> dict[str, torch.Tensor]:
    """This rank's AdamW state by parameter name (FSDP2's local shards), step counts included."""
    sd = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    return {f"{fqn}/{k}": (v.to_local() if isinstance(v, DTensor) else v).clone()
            for fqn, state in sd["state"].items() for k, v in state.items()}


def _prepared(cfg) -> Path:
    return prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path


@pytest.mark.parametrize("mode, per_rank", [("full", True), ("full", False), ("sharded", True)],
                         ids=["full", "full-broadcast", "sharded"])
def test_a_resume_applies_this_launchs_optimizer_settings(tmp_path, gloo_pool, mode, per_rank):
    """lr, betas, eps, weight decay and fused AdamW come from the launch (docs/RUNS.md: everything but the run's
    identity applies from the resumed step on), the moments and step counts from the checkpoint. The checkpoint was
    written by an unfused optimizer of one group that decays everything (the layout of every earlier raysft
    checkpoint, as a CPU run writes it) and is resumed by a fused one (a GPU launch) in the two groups of the default
    weight_decay_exclude, under activation checkpointing."""
    saved = run_config(tmp_path, "settings", **SAVED, **{"train.weight_decay_exclude": "[]"})
    launched = run_config(tmp_path, "settings", **LAUNCHED, **{"parallel.activation_checkpointing": "full"})
    outcomes = gloo_pool.run(_resume_with_other_settings, saved.to_dict(), launched.to_dict(), _prepared(saved), mode,
                             per_rank, (False, True))
    lr = 1e-3 * lr_factor(2, launched.train)
    for got in outcomes:
        assert [(g["lr"], g["initial_lr"], g["betas"], g["eps"], g["weight_decay"], g["fused"])
                for g in got["settings"]] == [(lr, 1e-3, (0.8, 0.99), 1e-6, 0.1, True),
                                              (lr, 1e-3, (0.8, 0.99), 1e-6, 0.0, True)]
        assert got["last_lr"] == [lr, lr]
        assert got["same_moments"] and got["finite_loss"]
    model = build_meta_model(load_model_config(launched.model, load_tokenizer(launched.model, "auto")), "sdpa")
    assert outcomes[0]["decayed"] == hf_decay_set(model)  # FSDP2's DTensors under checkpoint wrappers


@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_a_fused_two_group_checkpoint_resumes_unfused_decaying_everything(tmp_path, gloo_pool, mode):
    """The other way round: a checkpoint of fused AdamW in two groups, resumed by a launch without fused and with
    weight_decay_exclude []: one group, decaying every parameter, not fused."""
    saved = run_config(tmp_path, "unfused", **SAVED)
    launched = run_config(tmp_path, "unfused", **LAUNCHED, **{"train.weight_decay_exclude": "[]"})
    outcomes = gloo_pool.run(_resume_with_other_settings, saved.to_dict(), launched.to_dict(), _prepared(saved), mode,
                             True, (True, False))
    for got in outcomes:
        assert [(g["betas"], g["eps"], g["weight_decay"], g["fused"]) for g in got["settings"]] == \
            [((0.8, 0.99), 1e-6, 0.1, None)]
        assert got["same_moments"] and got["finite_loss"]
