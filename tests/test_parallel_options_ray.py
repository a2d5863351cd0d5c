"""bf16, fp16 with loss scaling, CPU offload and non-LLaMA decoder families train under FSDP2 on 2 workers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_workers, tiny_config
from torch.distributed.fsdp import FSDPModule
from transformers import MistralConfig, Qwen2Config

from raysft.checkpoint import save
from raysft.config import TrainConfig
from raysft.data import prepare_store
from raysft.launch import ray_worker_context
from raysft.metrics import read_metrics
from raysft.tokenizer import load_tokenizer
from raysft.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
STEPS = 24
# fp16 starts from a loss scale that overflows for sure: the scaler must skip and back off, then train.
VARIANTS = {
    "bf16": {"parallel.mixed_precision": "bf16"},
    "bf16-reduce-bf16": {"parallel.mixed_precision": "bf16", "parallel.reduce_dtype": "bf16"},
    "fp16": {"parallel.mixed_precision": "fp16", "parallel.fp16_init_scale": 2.0**22},
    "cpu-offload": {"parallel.cpu_offload": True, "parallel.activation_checkpointing": "full"},
    "qwen2": {"model.config": "{tmp}/qwen2"},
    "mistral": {"model.config": "{tmp}/mistral", "parallel.sharding": "SHARD_GRAD_OP"},
}


def _train_variants(loop: dict) -> None:
    ctx = ray_worker_context()
    for name, cfg_dict in loop["variants"].items():
        cfg = TrainConfig.from_dict(cfg_dict)
        trainer = Trainer(cfg, Path(loop["store"]), None, lambda *a: None, ctx)
        sharded = [type(m).__name__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        trainer.train()
        if ctx.rank == 0:
            (Path(loop["out"]) / f"{name}.json").write_text(json.dumps({"sharded": sharded}))
        if name == "fp16":  # the loss scale is part of the checkpoint
            save(Path(loop["out"]) / f"fp16-ckpt{ctx.rank}", "full", trainer.objs, trainer.state)  # all on rank 0
            dist.barrier()
            resumed = Trainer(cfg, Path(loop["store"]), Path(loop["out"]) / "fp16-ckpt0", lambda *a: None, ctx)
            assert resumed.scaler.get_scale() == trainer.scaler.get_scale()
        if name == "qwen2":  # tied embeddings stay one parameter, through training and a sharded checkpoint
            assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
            mine = Path(loop["out"]) / f"qwen2-ckpt-rank{ctx.rank}"
            save(mine, "sharded", trainer.objs, trainer.state)
            shutil.copytree(mine, Path(loop["out"]) / "qwen2-ckpt", dirs_exist_ok=True)
            dist.barrier()
            resumed = Trainer(cfg, Path(loop["store"]), Path(loop["out"]) / "qwen2-ckpt", lambda *a: None, ctx)
            assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
            for (key, a), (_, b) in zip(trainer.model.state_dict().items(), resumed.model.state_dict().items(),
                                        strict=True):
                assert torch.equal(a.to_local(), b.to_local()), key
        dist.barrier()


def test_mixed_precision_offload_and_other_families_train(tmp_path):
    base = tiny_config(tmp_path)
    tokenizer = load_tokenizer(base.model, base.data.chat_template)
    small = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                 eos_token_id=tokenizer.eos_token_id)
    Qwen2Config(**small, tie_word_embeddings=True).save_pretrained(tmp_path / "qwen2")
    MistralConfig(**small).save_pretrained(tmp_path / "mistral")
    variants = {name: tiny_config(tmp_path, **{"train.max_steps": STEPS, "train.log_every_n_steps": 10,
                                                "checkpoint.every_n_steps": 1000, "run.name": name,
                                                **{k: str(v).format(tmp=tmp_path) for k, v in sets.items()}}).to_dict()
                for name, sets in VARIANTS.items()}
    store = prepare_store(base.data, tokenizer, base.store_dir).path
    run_workers(_train_variants, {"variants": variants, "store": str(store), "out": str(tmp_path)}, tmp_path)

    for name in VARIANTS:
        steps = [m for m in read_metrics(base.run_dir.parent / name) if "loss" in m]
        assert len(steps) == STEPS
        trained = [m for m in steps if not m.get("skipped")]
        first, last = [sum(m["loss"] for m in part) / 5 for part in (trained[:5], trained[-5:])]
        assert last < 0.75 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
        assert all(m["peak_mem_gb"] > 0 for m in steps)

    # fully_shard went on each decoder layer (the class the model declares) and on the root
    sharded = {n: json.loads((tmp_path / f"{n}.json").read_text())["sharded"] for n in VARIANTS}
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
