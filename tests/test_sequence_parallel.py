"""Ulysses sequence parallelism (parallel.sequence_parallel) computes what one process computes: 4 gloo processes,
no Ray, against tests/test_strategies.py's one-process reference on the same global batches."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TEST_DATA, cli_in_process, tiny_config
from safetensors.torch import load_file, save_file
from test_strategies import STEPS, reference
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raysft.checkpoint import DirectorySink
from raysft.config import ConfigError, ParallelConfig, TrainConfig, config_from_dict
from raysft.data import IGNORE_INDEX, prepare_store
from raysft.data.dataloader import DataCursor, GlobalBatchSampler, TokenizedDataset, collate, rank_micro_batches
from raysft.data.tokenizer import load_tokenizer
from raysft.distributed.layout import ParallelDims, SequenceShard
from raysft.model.build import load_model_config
from raysft.model.loss import loss_inputs
from raysft.parallel.sequence import check_sequence_parallel, split_batch
from raysft.training.metrics import read_metrics
from raysft.training.trainer import Trainer, resume_trainer

SP = {"data.packing": "true", "model.attn_implementation": "varlen"}
EVAL_PATHS = f"[{TEST_DATA / 'fastchat' / 'dummy_conversation.json'}]"
# (run name, overrides): demo-tiny has 4 heads and 2 KV heads, so N=4 repeats each KV head; rows of 2 packed
# samples of up to 96 tokens, so a worker's share (a quarter or a half of the row) is shorter than a sample and
# samples straddle the split
# sp4-ac-batch2: N=4 on 4 workers is one data-parallel group, so a global batch of one micro-batch (2) is a step;
# sp2-bf16: bf16 compute, against the fp32 reference at bf16's tolerance
VARIANTS = [
    ("sp4-ac-batch2", {"parallel.sequence_parallel": 4, "parallel.activation_checkpointing": "full",
                       "train.global_batch_size": 2}),
    ("sp2-noshard-eval", {"parallel.sequence_parallel": 2, "parallel.sharding": "NO_SHARD",
                          "data.eval_paths": EVAL_PATHS, "train.eval_every_n_steps": STEPS}),
    ("sp2-lora", {"parallel.sequence_parallel": 2, "model.lora.r": 4}),
    ("sp2-bf16", {"parallel.sequence_parallel": 2, "parallel.mixed_precision": "bf16"}),
]


def _config(tmp_path, name: str, **sets) -> TrainConfig:
    return tiny_config(tmp_path, **{"train.max_steps": STEPS, "train.global_batch_size": 16,
                                    "train.micro_batch_size": 2, "scaling.num_workers": 4, "run.name": name,
                                    "checkpoint.every_n_steps": 100, **SP, **sets})


def _save_weights(trainer: Trainer, path) -> None:
    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.ctx.rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
    dist.barrier()


def _train_variants(ctx, configs: list[dict], stores: dict, out) -> None:
    for config in configs:
        cfg = config_from_dict(config)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        trainer = resume_trainer(cfg, stores["train"], ctx, DirectorySink(cfg.run_dir, ctx.rank),
                                 eval_store=stores["eval"] if cfg.data.eval_paths else None)
        trainer.train()
        if trainer.state.step == cfg.train.max_steps:
            _save_weights(trainer, out / f"{cfg.run.name}.safetensors")


def _eval_loss(cfg: TrainConfig, weights: dict, eval_store) -> float:
    """The reference model's loss over every label token of the eval store, in one padded batch."""
    from raysft.model.build import build_full_model

    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    model = build_full_model(cfg.model, load_model_config(cfg.model, tokenizer), cfg.train.seed)
    model.load_state_dict(weights)
    dataset = TokenizedDataset(eval_store)
    batch = collate(dataset, np.arange(len(dataset)), tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum").item() / int(dataset.num_loss_tokens.sum())


def _losses(tmp_path, name: str) -> list[float]:
    return [m["loss"] for m in read_metrics(tmp_path / "runs" / name) if "loss" in m]


def _assert_matches(tmp_path, name: str, ref_losses: list[float], ref_weights: dict) -> None:
    losses = _losses(tmp_path, name)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} losses: {m}")
    weights = load_file(tmp_path / f"{name}.safetensors")
    assert weights.keys() == ref_weights.keys()
    # atol 1e-4: AdamW divides by sqrt(v), so an embedding row whose token is rare (gradients near 0) turns the
    # reduction order's rounding into differences of a fraction of lr; the losses above hold to 1e-5.
    for key, value in weights.items():
        torch.testing.assert_close(value, ref_weights[key], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, k=key: f"{name} {k}: {m}")


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_sequence_parallel_matches_a_single_process_reference(tmp_path, gloo_pool4):
    """N=2 and N=4, with activation checkpointing, NO_SHARD's replicated mesh, eval, LoRA, a global batch of one
    micro-batch per data-parallel group, and a run stopped at step 2 under N=4 and resumed under N=2 from its sharded
    checkpoint: the one-process run's losses and weights. bf16 under N=2: the fp32 losses within bf16's rounding."""
    base = _config(tmp_path, "base")
    tokenizer = load_tokenizer(base.model, base.data.chat_template)
    store = prepare_store(base.data, tokenizer, base.store_dir).path
    with_eval = _config(tmp_path, "e", **dict(VARIANTS[1][1]))
    eval_store = prepare_store(with_eval.data, tokenizer, with_eval.store_dir, split="eval").path
    resume = {"parallel.sequence_parallel": 4, "checkpoint.mode": "sharded", "checkpoint.every_n_steps": 2}
    configs = [_config(tmp_path, name, **sets).to_dict() for name, sets in VARIANTS]
    configs += [_config(tmp_path, "sp4-then-sp2", **resume, **{"train.stop_at_step": 2}).to_dict(),
                _config(tmp_path, "sp4-then-sp2", **{**resume, "parallel.sequence_parallel": 2}).to_dict()]
    gloo_pool4.run(_train_variants, configs, {"train": store, "eval": eval_store}, tmp_path)

    padded = {"data.packing": "false", "model.attn_implementation": "sdpa"}  # the reference: padded, SDPA
    ref_losses, ref_weights = reference(_config(tmp_path, "ref", **padded), store)
    for name in ("sp2-noshard-eval", "sp4-then-sp2"):
        _assert_matches(tmp_path, name, ref_losses, ref_weights)
    batch2 = {**padded, "train.global_batch_size": 2, "scaling.num_workers": 1}  # the reference is one process
    _assert_matches(tmp_path, "sp4-ac-batch2", *reference(_config(tmp_path, "ref-batch2", **batch2), store))
    # bf16 keeps 8 bits of mantissa (a relative rounding of 2^-8 per operation); fp32 master weights keep the
    # steps from drifting further. The losses differ from fp32's (bf16 did compute) by less than 1%.
    bf16 = _losses(tmp_path, "sp2-bf16")
    torch.testing.assert_close(bf16, ref_losses, rtol=1e-2, atol=0, msg=lambda m: f"sp2-bf16 losses: {m}")
    assert max(abs(a - b) for a, b in zip(bf16, ref_losses, strict=True)) > 1e-4
    lora_losses, lora_weights = reference(_config(tmp_path, "ref-lora", **padded, **{"model.lora.r": 4}), store)
    _assert_matches(tmp_path, "sp2-lora", lora_losses, lora_weights)

    evals = [m["eval_loss"] for m in read_metrics(tmp_path / "runs" / "sp2-noshard-eval") if "eval_loss" in m]
    expected = _eval_loss(_config(tmp_path, "ref", **padded), ref_weights, eval_store)
    assert evals == [pytest.approx(expected, rel=1e-5)]
    resumed = [m["step"] for m in read_metrics(tmp_path / "runs" / "sp4-then-sp2") if m.get("event") == "resume"]
    assert resumed == [2]
    # every sample's tokens counted once per step, not once per worker of a sequence group
    dataset = TokenizedDataset(store)
    sampler = GlobalBatchSampler(len(dataset), 2, DataCursor(seed=base.train.seed))
    tokens = [int(dataset.num_tokens[sampler.next_batch()].sum()) for _ in range(STEPS)]
    assert [m["tokens"] for m in read_metrics(tmp_path / "runs" / "sp4-ac-batch2") if "tokens" in m] == tokens


def test_split_batch_gives_each_token_and_label_to_one_worker(tmp_path):
    """A packed row of 3 samples over 2, 3 and 4 workers: padded to a multiple of N with a pad sample of its own;
    the slices put back together are the row, and their loss positions are the row's, each label once (the label
    of a slice's last token comes from the next slice)."""
    cfg = tiny_config(tmp_path, **SP)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    dataset = TokenizedDataset(prepare_store(cfg.data, tokenizer, cfg.store_dir).path)
    indices = np.array([0, 1, 2])
    batch = collate(dataset, indices, tokenizer.pad_token_id, packing=True)
    length = batch["input_ids"].shape[1]
    whole = loss_inputs(batch["labels"])
    for n in (2, 3, 4):
        parts = [split_batch(dict(batch), SequenceShard(0, 1, r, n), pad_id=-5) for r in range(n)]
        share = parts[0]["input_ids"].shape[1]
        assert share * n >= length > share * (n - 1)
        ids = torch.cat([p["input_ids"] for p in parts], dim=1)
        assert torch.equal(ids[:, :length], batch["input_ids"]) and (ids[0, length:] == -5).all()
        positions = torch.cat([p["position_ids"] for p in parts], dim=1)
        assert torch.equal(positions[:, :length], batch["position_ids"])
        cu = parts[0]["cu_seq_lens_q"].tolist()
        assert cu[: len(indices) + 1] == batch["cu_seq_lens_q"].tolist() and cu[-1] == share * n
        flat = torch.cat([p["loss_positions"] + r * share for r, p in enumerate(parts)])
        assert torch.equal(flat, whole["loss_positions"])
        assert torch.equal(torch.cat([p["loss_targets"] for p in parts]), whole["loss_targets"])


def test_every_sample_goes_to_one_sequence_group_per_step():
    """World 8, N=4: two groups; the 4 workers of a group take the same samples; the groups none in common, and
    together the whole global batch."""
    cursor = DataCursor(seed=3)
    sampler = GlobalBatchSampler(40, 8, cursor)
    seen = []
    for _ in range(5):  # one epoch
        batch = sampler.next_batch()
        shards = [ParallelDims(1, 2, 4).place(rank) for rank in range(8)]
        taken = [np.concatenate(rank_micro_batches(batch, s.dp_rank, s.dp_size, 2)) for s in shards]
        for rank in range(8):
            assert np.array_equal(taken[rank], taken[rank - rank % 4])
        seen += [*taken[0], *taken[4]]
    assert sorted(seen) == list(range(40))


def test_mesh_carves_the_sequence_dimension_out_of_the_shard_group():
    def shape(sharding, n, node_ranks, **kw):
        return ParallelDims.from_config(ParallelConfig(sharding=sharding, sequence_parallel=n, **kw), node_ranks)

    assert shape("FULL_SHARD", 2, [0] * 4) == ParallelDims(1, 2, 2)
    assert shape("FULL_SHARD", 4, [0] * 4) == ParallelDims(1, 1, 4)
    assert shape("NO_SHARD", 2, [0] * 8) == ParallelDims(4, 1, 2)
    assert shape("HYBRID_SHARD", 2, [0] * 4 + [1] * 4) == ParallelDims(2, 2, 2)
    assert shape("HYBRID_SHARD", 2, [0] * 8, hsdp_shard_size=4) == ParallelDims(2, 2, 2)
    assert shape("FULL_SHARD", 1, [0] * 4).mesh_names == ("shard",)  # without it, the mesh FSDP always had
    with pytest.raises(ConfigError, match="sequence_parallel': 4 does not divide the shard group of 2"):
        shape("HYBRID_SHARD", 4, [0] * 2 + [1] * 2)


@pytest.mark.parametrize(("sets", "message"), [
    ({"parallel.sequence_parallel": 3, "scaling.num_workers": 3, "train.global_batch_size": 12},
     "the model has 4 attention heads, which 3 does not divide"),
    ({"parallel.sequence_parallel": 4, "scaling.num_workers": 4, "scaling.min_workers": 2,
      "train.global_batch_size": 48}, "4 does not divide 2 workers"),
    ({"parallel.sequence_parallel": 4, "scaling.num_workers": 8, "parallel.sharding": "HYBRID_SHARD",
      "parallel.hsdp_shard_size": 2, "train.global_batch_size": 16}, "4 does not divide the shard group of 2"),
    ({"parallel.sequence_parallel": 2, "model.attn_implementation": "sdpa"}, "only varlen takes"),
    ({"parallel.sequence_parallel": 2, "train.loss_chunk_tokens": 0}, "needs train.loss_chunk_tokens > 0"),
    ({"parallel.sequence_parallel": 0}, "must be >= 1"),
    ({"parallel.sequence_parallel": 2, "scaling.num_workers": 4, "train.micro_batch_size": 2,
      "train.global_batch_size": 6},
     r"micro_batch_size × data-parallel groups \(4 workers / 2 = 2\) = 2 × 2 = 4"),
    ({"parallel.sequence_parallel": 2, "scaling.num_workers": 4, "train.micro_batch_tokens": 512,
      "train.global_batch_size": 3}, r"multiple of the data-parallel groups \(4 workers / 2 = 2\)"),
])
def test_layouts_sequence_parallelism_cannot_run_are_refused_on_the_driver(tmp_path, sets, message):
    """Loading the configuration checks the layout (ParallelDims.check_config, for every elastic worker count)
    and the batch; check_sequence_parallel what needs the model's config."""
    with pytest.raises(ConfigError, match=message):
        cfg = tiny_config(tmp_path, **{**SP, **sets})
        check_sequence_parallel(cfg, load_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data.chat_template)))


@pytest.mark.parametrize("sets", [
    {"parallel.sequence_parallel": 4, "train.global_batch_size": 2},
    {"parallel.sequence_parallel": 2, "train.global_batch_size": 4},
    {"parallel.sequence_parallel": 4, "train.micro_batch_tokens": 512, "train.global_batch_size": 1},
])
def test_the_global_batch_divides_over_data_parallel_groups_not_workers(tmp_path, sets):
    """4 workers in groups of N take a step's samples as 4 / N data-parallel groups: a global batch of one
    micro-batch per group is accepted."""
    cfg = tiny_config(tmp_path, **{**SP, "scaling.num_workers": 4, "train.micro_batch_size": 2, **sets})
    check_sequence_parallel(cfg, load_model_config(cfg.model, load_tokenizer(cfg.model, cfg.data.chat_template)))


def test_raysft_train_names_the_key_before_anything_starts(tmp_path):
    result = cli_in_process("train", "--set", "parallel.sequence_parallel=3", "--set", "scaling.num_workers=3",
                            "--set", "train.global_batch_size=12", "--set", "data.packing=true",
                            "--set", "model.attn_implementation=varlen", "--set", f"run.storage_path={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert "config key 'parallel.sequence_parallel'" in result.stderr and "4 attention heads" in result.stderr
    assert not (tmp_path / "raysft-demo").exists()
