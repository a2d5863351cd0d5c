"""Training on a reused pair of gloo processes (FSDP2, real files, no Ray): the export holds the trained logits and
fine-tunes via model.path, a resume restores every piece of state, mixed
precision, CPU offload and other decoder families train."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cli_in_process, tiny_config
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

import raysft
from raysft.checkpoint import DirectorySink, save
from raysft.config import TrainConfig
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics
from raysft.training.trainer import Trainer

PROBE = torch.tensor([[5, 60, 70, 80, 90, 100, 3, 4], [7, 8, 9, 10, 11, 12, 13, 14]])


def store_for(cfg: TrainConfig) -> Path:
    return prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path


def _train_then_probe(ctx, cfg: TrainConfig, store: Path, out: Path) -> None:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE).logits
    if ctx.rank == 0:
        save_file({"logits": logits.contiguous()}, out)


def test_export_has_the_trained_logits_and_fine_tunes_via_model_path(tmp_path, gloo_pool):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 10})
    gloo_pool.run(_train_then_probe, cfg, store_for(cfg), tmp_path / "live.safetensors")
    out = raysft.export(cfg.run_dir / "checkpoint_00000010", tmp_path / "hf")
    assert not any(n in {p.name for p in out.iterdir()} for n in ("optimizer.safetensors", "trainer_state.json"))
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert model.config.use_cache  # generation from the export uses the KV cache
    with torch.no_grad():
        exported = model(input_ids=PROBE).logits
    live = load_file(tmp_path / "live.safetensors")["logits"]
    torch.testing.assert_close(exported, live, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileExistsError):
        raysft.export(cfg.run_dir / "checkpoint_00000010", tmp_path / "hf")

    # Fine-tuning from the exported directory starts from its weights (and its tokenizer), not a fresh init:
    # the first step's loss (computed before the update) is far below that of a from-scratch run.
    tuned = tiny_config(tmp_path, **{"model.path": str(out), "model.tokenizer": "", "train.max_steps": 2,
                                     "run.name": "tuned"})
    gloo_pool.run(launch, tuned)
    first_loss = {run: next(m["loss"] for m in read_metrics(c.run_dir) if m.get("step") == 1)
                  for run, c in (("scratch", cfg), ("tuned", tuned))}
    assert first_loss["tuned"] < first_loss["scratch"] - 1.0, first_loss


def _resume_then_save(ctx, cfg: TrainConfig, store: Path, resume: Path, out: Path) -> None:
    trainer = Trainer(cfg, store, resume, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    save(out / f"rank{ctx.rank}", "full", trainer.objs, trainer.state)


def test_resume_restores_model_optimizer_schedule_cursor_and_rng(tmp_path, gloo_pool):
    cfg = tiny_config(tmp_path, **{"train.max_steps": 10, "checkpoint.every_n_steps": 5, "checkpoint.mode": "full"})
    gloo_pool.run(launch, cfg)
    saved = cfg.run_dir / "checkpoint_00000005"
    resaved = tmp_path / "resaved" / "rank0"  # a full checkpoint is all on rank 0
    gloo_pool.run(_resume_then_save, cfg, store_for(cfg), saved, resaved.parent)
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        a, b = load_file(saved / name), load_file(resaved / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((saved / "optimizer.json").read_text()) == json.loads((resaved / "optimizer.json").read_text())
    before, after = (json.loads((d / "trainer_state.json").read_text()) for d in (saved, resaved))
    assert after == before and before["step"] == 5 and before["scheduler"]["last_epoch"] == 5


STEPS = 16  # the fp16 run skips its first 5 steps: its last 5 of 11 trained still 0.71 of its first 5
# fp16 starts from a loss scale that overflows for sure: the scaler must skip and back off, then train.
VARIANTS = {
    "bf16": {"parallel.mixed_precision": "bf16"},
    "bf16-reduce-bf16": {"parallel.mixed_precision": "bf16", "parallel.reduce_dtype": "bf16"},
    "fp16": {"parallel.mixed_precision": "fp16", "parallel.fp16_init_scale": 2.0**22},
    "cpu-offload": {"parallel.cpu_offload": True, "parallel.activation_checkpointing": "full"},
    "qwen2": {"model.config": "{tmp}/qwen2"},
    "mistral": {"model.config": "{tmp}/mistral", "parallel.sharding": "SHARD_GRAD_OP"},
}


def _train_variant(ctx, name: str, cfg: TrainConfig, store: Path, out: Path) -> list[str]:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, store, None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    sharded = [type(m).__name__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    trainer.train()
    if name == "fp16":  # the loss scale is part of the checkpoint
        save(out / f"fp16-ckpt{ctx.rank}", "full", trainer.objs, trainer.state)  # all on rank 0
        dist.barrier()
        resumed = Trainer(cfg, store, out / "fp16-ckpt0", DirectorySink(cfg.run_dir, ctx.rank), ctx)
        assert resumed.scaler.get_scale() == trainer.scaler.get_scale()
    if name == "qwen2":  # tied embeddings stay one parameter, through training and a sharded checkpoint
        assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
        mine = out / f"qwen2-ckpt-rank{ctx.rank}"
        save(mine, "sharded", trainer.objs, trainer.state)
        dist.barrier()
        if ctx.rank == 0:
            for rank in (0, 1):
                shutil.copytree(out / f"qwen2-ckpt-rank{rank}", out / "qwen2-ckpt", dirs_exist_ok=True)
        dist.barrier()
        resumed = Trainer(cfg, store, out / "qwen2-ckpt", DirectorySink(cfg.run_dir, ctx.rank), ctx)
        assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
        for (key, a), (_, b) in zip(trainer.model.state_dict().items(), resumed.model.state_dict().items(),
                                    strict=True):
            assert torch.equal(a.to_local(), b.to_local()), key
    dist.barrier()
    return sharded


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_mixed_precision_offload_and_other_families_train(tmp_path, gloo_pool):
    base = tiny_config(tmp_path)
    tokenizer = load_tokenizer(base.model, base.data.chat_template)
    small = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                 eos_token_id=tokenizer.eos_token_id)
    Qwen2Config(**small, tie_word_embeddings=True).save_pretrained(tmp_path / "qwen2")
    MistralConfig(**small).save_pretrained(tmp_path / "mistral")
    store = prepare_store(base.data, tokenizer, base.store_dir).path
    sharded = {}
    for name, sets in VARIANTS.items():
        cfg = tiny_config(tmp_path, **{"train.max_steps": STEPS, "train.log_every_n_steps": 10,
                                       "checkpoint.every_n_steps": 1000, "run.name": name,
                                       **{k: str(v).format(tmp=tmp_path) for k, v in sets.items()}})
        sharded[name] = gloo_pool.run(_train_variant, name, cfg, store, tmp_path)[0]

    for name in VARIANTS:
        steps = [m for m in read_metrics(base.run_dir.parent / name) if "loss" in m]
        assert len(steps) == STEPS
        trained = [m for m in steps if not m.get("skipped")]
        first, last = [sum(m["loss"] for m in part) / 5 for part in (trained[:5], trained[-5:])]
        assert last < 0.75 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
        assert all(m["peak_mem_gb"] > 0 for m in steps)

    # fully_shard went on each decoder layer (the class the model declares) and on the root
    assert sharded["bf16"] == ["FSDPLlamaForCausalLM"] + ["FSDPLlamaDecoderLayer"] * 4
    assert sharded["cpu-offload"] == ["FSDPLlamaForCausalLM"] + ["FSDPCheckpointWrapper"] * 4
    assert sharded["qwen2"] == ["FSDPQwen2ForCausalLM"] + ["FSDPQwen2DecoderLayer"] * 2
    assert sharded["mistral"] == ["FSDPMistralForCausalLM"] + ["FSDPMistralDecoderLayer"] * 2

    # fp16: the first steps overflow and are skipped; each overflow halves the scale (no growth within 2000
    # clean steps), and most steps go through
    fp16 = [m for m in read_metrics(base.run_dir.parent / "fp16") if "loss" in m]
    assert fp16[0]["skipped"] and fp16[0]["loss_scale"] == 2.0**22
    for cur, nxt in zip(fp16, fp16[1:], strict=False):
        assert nxt["loss_scale"] == cur["loss_scale"] * (0.5 if cur["skipped"] else 1.0), (cur, nxt)
    assert sum(m["skipped"] for m in fp16) < STEPS // 2


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_export_in_bf16_fp16_fp32_with_a_generation_config_that_stops_at_the_end_of_turn(tmp_path, gloo_pool):
    from transformers import AutoTokenizer, GenerationConfig

    from raysft.products.export import write_generation_config

    cfg = tiny_config(tmp_path, **{"train.max_steps": 2})
    gloo_pool.run(launch, cfg)
    out = raysft.export(cfg.run_dir / "checkpoint_00000002", tmp_path / "bf16", dtype="bf16")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert GenerationConfig.from_pretrained(out).eos_token_id == tokenizer.eos_token_id  # the demo's <|end|>

    # `raysft export --dtype`: fp32 keeps the trained floats, fp16 and bf16 are their casts
    weights = {}
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        done = cli_in_process("export", str(cfg.run_dir / "checkpoint_00000002"), str(tmp_path / dtype),
                              "--dtype", dtype)
        assert done.returncode == 0, done.stderr[-3000:]
        assert AutoModelForCausalLM.from_pretrained(tmp_path / dtype, local_files_only=True).dtype == torch_dtype
        weights[dtype] = load_file(tmp_path / dtype / "model.safetensors")
        assert all(t.dtype == torch_dtype for t in weights[dtype].values()), dtype
    for name, bf16 in load_file(out / "model.safetensors").items():
        assert torch.equal(weights["fp32"][name].to(torch.bfloat16), bf16), name
        assert torch.equal(weights["fp32"][name].to(torch.float16), weights["fp16"][name]), name

    # a ChatML template: generation stops at <|im_end|> as well as at EOS
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                               "'<|im_end|>\\n' }}{%- endfor -%}")
    tokenizer.save_pretrained(out)
    write_generation_config(out)
    eos = GenerationConfig.from_pretrained(out).eos_token_id
    assert sorted(eos) == sorted([tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id])


@pytest.mark.slow  # three launches (some 45 s on 2 cores); tests/test_optim.py and test_config.py hold the rules
def test_num_epochs_sets_the_run_s_steps_and_training_it_further_keeps_the_lr_from_jumping_back_up(tmp_path,
                                                                                                   gloo_pool):
    """train.num_epochs: 24 conversations in global batches of 8 are 3 steps an epoch (on 2 ranks, in micro-batches
    of 2), so 2 epochs are 6 steps, and the LR schedule is laid out on them. Training the finished run further by a
    third epoch is refused while its schedule's length would change with num_epochs alone (the LR would jump back
    up); with train.schedule_steps at the run's 6 steps it goes on at the schedule's final LR."""
    import dataclasses
    import math

    from conftest import promise

    from raysft.checkpoint import STATE_FILE
    from raysft.checkpoint.discovery import LAUNCH_CONFIG_FILE
    from raysft.training.optim import lr_factor

    data = tmp_path / "small.json"
    demo = Path(raysft.__file__).parent / "assets" / "demo" / "conversations.json"
    data.write_text(json.dumps(json.loads(demo.read_text())[:24]))
    sets = {"data.paths": json.dumps([str(data)]), "train.max_steps": None, "train.num_epochs": 2,
            "train.lr": 1e-3, "train.warmup_steps": 1}
    cfg = tiny_config(tmp_path, **sets)
    gloo_pool.run(launch, cfg)
    lrs = {m["step"]: m["lr"] for m in read_metrics(cfg.run_dir) if "loss" in m}
    with promise("num_epochs 2: two passes of 24 // 8 = 3 steps"):
        assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
        state = json.loads((cfg.run_dir / "checkpoint_00000006" / STATE_FILE).read_text())
        assert state["cursor"] == {"seed": 0, "epoch": 1, "consumed": 24}
        assert json.loads((cfg.run_dir / LAUNCH_CONFIG_FILE).read_text())["train"]["max_steps"] == 6
    with promise("the LR schedule is laid out on the 6 steps"):
        six = dataclasses.replace(cfg.train, max_steps=6)
        assert all(math.isclose(lr, 1e-3 * lr_factor(step - 1, six)) for step, lr in lrs.items()), lrs
    with promise("a third epoch that lays the schedule out again is refused"), \
            pytest.raises(RuntimeError, match=r"ConfigError: .*the LR would jump from 0\.0001 to .* at step 7.*"
                                              r"set train\.schedule_steps=6"):  # every rank's, through the pool
        gloo_pool.run(launch, tiny_config(tmp_path, **{**sets, "train.num_epochs": 3}))
    gloo_pool.run(launch, tiny_config(tmp_path, **{**sets, "train.num_epochs": 3, "train.schedule_steps": 6}))
    further = {m["step"]: m["lr"] for m in read_metrics(cfg.run_dir) if "loss" in m and m["step"] > 6}
    with promise("with schedule_steps at the run's length, the third epoch goes on at the final LR"):
        assert sorted(further) == [7, 8, 9]
        assert further[7] <= lrs[6], (lrs[6], further)  # no jump back up
        assert all(math.isclose(lr, 1e-3 * cfg.train.min_lr_ratio) for lr in further.values()), further
