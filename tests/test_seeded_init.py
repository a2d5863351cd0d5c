"""The seeded from-scratch initialization (raysft.model.seeded_init): the same weights, bit for bit, on 1, 2 and 4 ranks
under every strategy (gloo, no Ray), uneven and empty shards included; no rank holding a full copy while it
initializes; and its scheme in the run identity and in a LoRA export."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import LlamaConfig

from raysft.checkpoint import CheckpointError
from raysft.config import ConfigError, LoraConfig, ModelConfig, ParallelConfig
from raysft.distributed.layout import ParallelDims
from raysft.launch.prelaunch import RUN_FILE, claim_run_dir
from raysft.model.build import build_full_model, build_meta_model, load_initial_weights, materialize
from raysft.model.lora import add_adapters, record
from raysft.model.seeded_init import INIT_SCHEME
from raysft.parallel.fsdp import parallelize
from raysft.products.adapters import scratch_base

SEED = 5
LORA = LoraConfig(r=2)  # lora_A has 2 rows: on 4 ranks, ranks 2 and 3 hold empty shards of it
# Dimensions that 4 ranks do not divide (embedding rows 101, MLP width 50: pieces of 26/26/26/23, 13/13/13/11);
# with tied embeddings and without.
UNEVEN = dict(hidden_size=36, intermediate_size=50, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
              vocab_size=101, max_position_embeddings=64)


def _configs() -> dict[str, LlamaConfig]:
    return {"untied": LlamaConfig(**UNEVEN, tie_word_embeddings=False),
            "tied": LlamaConfig(**UNEVEN, tie_word_embeddings=True)}


def _sharded_weights(ctx, variants: list[tuple[str, str, bool]]) -> dict:
    """On every rank: each (config, strategy, LoRA or not) built as the Trainer builds it, initialized, gathered."""
    out = {}
    for name, sharding, lora in variants:
        config, lora_cfg = _configs()[name], LORA if lora else LoraConfig()
        cfg = ParallelConfig(sharding=sharding, hsdp_shard_size=2 if sharding == "HYBRID_SHARD" else 0)
        model = add_adapters(build_meta_model(config, "sdpa"), lora_cfg)
        parallelize(model, ParallelDims.from_config(cfg, [0] * ctx.world_size).build_mesh("cpu"), cfg)
        materialize(model, torch.device("cpu"))
        load_initial_weights(model, ModelConfig(path="", lora=lora_cfg), config, SEED)
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out[(name, sharding, lora)] = weights if ctx.rank == 0 else None
    return out


@pytest.mark.slow  # starts the 4-rank pool: make test-fast leaves it out
def test_the_seeded_initialization_is_the_same_on_1_2_and_4_ranks_under_every_strategy(gloo_pool, gloo_pool4):
    # every layout: shards of 2 and 4 (uneven, and empty for lora_A), 2 x 2 HYBRID, whole copies under NO_SHARD;
    # a LoRA variant checks the base weights too (they equal the model's without LoRA, below)
    two = gloo_pool.run(_sharded_weights, [("untied", "FULL_SHARD", True), ("untied", "NO_SHARD", True),
                                           ("tied", "SHARD_GRAD_OP", False)])[0]
    four = gloo_pool4.run(_sharded_weights, [("untied", "FULL_SHARD", True), ("untied", "HYBRID_SHARD", False),
                                             ("tied", "FULL_SHARD", True)])[0]
    for name, config in _configs().items():
        one = build_full_model(ModelConfig(), config, SEED).state_dict()  # one process: the reference
        one_lora = add_adapters(build_full_model(ModelConfig(), config, SEED), LORA, SEED).state_dict()
        for key, value in one.items():  # a base weight is the same with LoRA or without it
            assert torch.equal(one_lora[key.replace("proj.weight", "proj.base_layer.weight")], value), key
        assert torch.count_nonzero(one_lora["model.layers.1.mlp.up_proj.lora_A.default.weight"]) > 0
        assert torch.count_nonzero(one_lora["model.layers.1.mlp.up_proj.lora_B.default.weight"]) == 0
        assert torch.equal(one["lm_head.weight"], one["model.embed_tokens.weight"]) == config.tie_word_embeddings
        for (config_name, sharding, lora), weights in [*two.items(), *four.items()]:
            if config_name != name:
                continue
            reference = one_lora if lora else one
            assert weights.keys() == reference.keys()
            for key, value in weights.items():
                assert torch.equal(value, reference[key]), f"{name} {sharding} lora={lora} {key}"
    # a seed per module: no two weights of one shape alike
    q = [one[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(2)]
    assert not torch.equal(*q)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _init_peak(ctx, config: LlamaConfig) -> dict:
    """On every rank: the resident set's peak while the shards are initialized, above what it was before. The
    shards are written first, so that their pages are resident before the peak is reset and only what the
    initialization allocates on top of them counts."""
    import gc

    cfg = ParallelConfig(sharding="FULL_SHARD")
    model = build_meta_model(config, "sdpa")
    parallelize(model, ParallelDims.from_config(cfg, [0] * ctx.world_size).build_mesh("cpu"), cfg)
    materialize(model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _vm_kib("VmRSS")
    load_initial_weights(model, ModelConfig(path=""), config, SEED)
    return {"peak_mib": (_vm_kib("VmHWM") - before) / 1024,
            "largest_module_mib": max(sum(p.numel() for p in m.parameters(recurse=False)) * 4
                                      for m in model.modules()) / 2**20}


def test_no_rank_holds_a_full_copy_of_the_model_while_initializing(gloo_pool):
    # ~100 MiB in fp32, in modules of at most 1.3 MiB: a full copy on any rank would be seen at once
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=24, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=64)
    with torch.device("meta"):
        full_mib = sum(p.numel() for p in build_meta_model(config, "sdpa").parameters()) * 4 / 2**20
    assert full_mib > 90
    for rank, result in enumerate(gloo_pool.run(_init_peak, config)):
        # one module at a time, plus what the C allocator keeps: far below a copy of the model (or of a shard)
        assert result["peak_mib"] < 0.2 * full_mib, f"rank {rank}: {result} against a model of {full_mib:.0f} MiB"


def test_a_lora_run_from_scratch_records_the_initialization_scheme_and_refuses_another(tmp_path):
    cfg = tiny_config(tmp_path, **{"model.lora.r": 4})
    assert claim_run_dir(cfg, "data-a") is None
    run_file = cfg.run_dir / RUN_FILE
    recorded = json.loads(run_file.read_text())
    assert recorded["model.init"] == INIT_SCHEME
    assert record(cfg)["base"] == {"path": "", "seed": cfg.train.seed, "init": INIT_SCHEME}
    assert claim_run_dir(cfg, "data-a") is None  # the same scheme continues
    del recorded["model.init"]  # a run started before the scheme was recorded (its base initialized otherwise)
    run_file.write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match="model.init=None, this launch has 'per-module-seed-1' .*seeded "
                                          "initialization of its from-scratch LoRA base"):
        claim_run_dir(cfg, "data-a")
    # full fine-tuning resumes its weights from its checkpoints: the scheme is not part of its identity
    full = tiny_config(tmp_path, **{"run.name": "full"})
    claim_run_dir(full, "data-a")
    assert "model.init" not in json.loads((full.run_dir / RUN_FILE).read_text())


def test_a_lora_export_refuses_a_from_scratch_base_of_another_scheme(tmp_path):
    LlamaConfig(**UNEVEN).save_pretrained(tmp_path)
    base = scratch_base(tmp_path, {"path": "", "seed": SEED, "init": INIT_SCHEME})
    assert torch.equal(base.state_dict()["lm_head.weight"],
                       build_full_model(ModelConfig(), LlamaConfig(**UNEVEN), SEED).state_dict()["lm_head.weight"])
    with pytest.raises(CheckpointError, match=f"{tmp_path}: its from-scratch base was initialized by scheme None"):
        scratch_base(tmp_path, {"path": "", "seed": SEED})
