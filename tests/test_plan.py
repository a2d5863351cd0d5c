"""`raysft plan` (raysft.tools.plan): its parameter counts against the known Llama-3.1 sizes, and its per-worker peak
against the peaks bench/memory.py measured on CPU (docs/bench/cpu-memory*.json), for every strategy there."""

import json

import numpy as np
import pytest
from conftest import REPO, cli_in_process
from transformers import LlamaConfig

from raysft.config import load_config
from raysft.data import prepare_store
from raysft.data.dataloader import DataCursor, GlobalBatchSampler, TokenizedDataset, rank_micro_batches
from raysft.data.tokenizer import load_tokenizer
from raysft.tools.plan import Topology, model_shape, plan

MiB = 2**20
BENCHES = sorted((REPO / "docs" / "bench").glob("cpu-memory*.json"))


def _bench_model(args: dict, vocab: int) -> LlamaConfig:
    """bench/common.py's Setup model for these arguments."""
    hidden = args["hidden"]
    return LlamaConfig(hidden_size=hidden, intermediate_size=args["intermediate"] or hidden * 8 // 3 // 64 * 64,
                       num_hidden_layers=args["layers"], num_attention_heads=hidden // 64,
                       num_key_value_heads=max(1, hidden // 256), vocab_size=args["vocab"] or vocab,
                       tie_word_embeddings=False, max_position_embeddings=max(2048, args["seq_len"]))


def _largest_micro_batch(dataset: TokenizedDataset, args: dict) -> int:
    """The most tokens (padded rows) any rank's micro-batch held in the bench's steps: the demo's conversations
    are shorter than seq_len, so its rows pad to the longest in each micro-batch, not to seq_len."""
    workers, micro = args["workers"], args["micro_batch"]
    sampler = GlobalBatchSampler(len(dataset), micro * workers, DataCursor(seed=0))
    lengths = np.asarray(dataset.num_tokens)
    most = 0
    for _ in range(args["steps"]):
        batch = sampler.next_batch()
        for rank in range(workers):
            for part in rank_micro_batches(batch, rank, workers, micro):
                most = max(most, len(part) * int(lengths[part].max()))
    return most


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """The benches' data: the demo conversations at seq_len 256, tokenized once for the module."""
    base = load_config(None, ["data.max_seq_len=256", f"run.storage_path={tmp_path_factory.mktemp('plan')}"])
    tokenizer = load_tokenizer(base.model, base.data.chat_template)
    return len(tokenizer), TokenizedDataset(prepare_store(base.data, tokenizer, base.store_dir).path)


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_the_planned_peak_is_within_15_percent_of_bench_memory_on_every_strategy(demo_store, bench):
    measured = json.loads(bench.read_text())
    args = measured["args"]
    assert not args["gpu"] and args["data"] == "builtin:demo" and args["seq_len"] == 256
    vocab, dataset = demo_store
    tokens = _largest_micro_batch(dataset, args)
    for result in measured["results"]:
        strategy = result["strategy"]
        sharding, _, ac = strategy.removesuffix("+lora").partition("-ac")
        lora = args.get("lora_r", 16) if strategy.endswith("+lora") else 0
        shard_size = args["workers"] // 2 if sharding == "HYBRID_SHARD" else 0  # as bench/memory.py sets it
        cfg = load_config(None, [f"model.lora.r={lora}", f"parallel.sharding={sharding}",
                                 f"parallel.activation_checkpointing={ac or 'none'}",
                                 f"parallel.mixed_precision={args['mixed_precision']}", "train.loss_chunk_tokens=0",
                                 f"parallel.hsdp_shard_size={shard_size}", f"data.max_seq_len={args['seq_len']}",
                                 f"train.micro_batch_size={args['micro_batch']}",
                                 f"scaling.num_workers={args['workers']}"])
        shape = model_shape(cfg, _bench_model(args, vocab))
        planned = plan(cfg, shape, Topology(args["workers"], 1), tokens).peak / MiB
        assert abs(planned / result["peak_tensors_mib"] - 1) <= 0.15, \
            f"{bench.name} {strategy}: planned {planned:.0f} MiB, measured {result['peak_tensors_mib']:.0f} MiB"


@pytest.mark.parametrize(("size", "params", "gpu_gib", "fits"),
                         [("8b", "8,030,261,248", 80, "yes"), ("70b", "70,553,706,496", 80, "NO")])
def test_raysft_plan_counts_a_llama_on_the_meta_device_and_says_whether_it_fits(size, params, gpu_gib, fits):
    """Llama-3.1's published sizes; 70B does not fit 8 GPUs of 80 GB (16 bytes per parameter / 8 = 141 GB)."""
    out = cli_in_process("plan", str(REPO / "jobs/configs/llama3-70b-4x8.yaml"), "--set", "model.path=",
                         "--set", f"model.config={REPO}/jobs/configs/models/llama-3.1-{size}.json",
                         "--set", "model.tokenizer=builtin:demo", "--workers", "8", "--gpu-mem-gib", str(gpu_gib))
    assert out.returncode == 0, out.stderr
    assert f"({params})" in out.stdout
    assert f"fits {gpu_gib:.1f} GiB per GPU: {fits}" in out.stdout, out.stdout


def test_hybrid_shard_without_a_node_count_is_a_config_error_naming_the_key():
    hybrid = ("--set", "parallel.sharding=HYBRID_SHARD", "--set", "scaling.num_workers=4")
    out = cli_in_process("plan", *hybrid)
    assert out.returncode == 2 and "config key 'parallel.sharding': HYBRID_SHARD over 4 workers on 1 node" in out.stderr
    assert "shard group of 2" in cli_in_process("plan", *hybrid, "--nodes", "2").stdout



def test_host_memory_of_the_initial_weights_and_a_full_save_is_one_tensor_unless_async():
    """No rank holds the whole model: a pretrained model is read as each rank's slices (one tensor's slice at a
    time), a from-scratch one built a module at a time, a full checkpoint gathered a tensor at a time onto rank 0;
    only checkpoint.async gathers the whole state (12 bytes per parameter) first."""
    small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)
    for pretrained in (False, True):
        for asynchronous in (False, True):
            cfg = load_config(None, [f"model.path={'/models/llama' if pretrained else ''}",
                                     "model.tokenizer=builtin:demo", f"checkpoint.async={str(asynchronous).lower()}"])
            shape = model_shape(cfg, small)
            result = plan(cfg, shape, Topology(8, 1))
            largest = 4 * shape.largest_module
            assert result.init_host_bytes == (largest / 8 if pretrained else largest)
            assert result.save_host_bytes["full"] == (12 * shape.params if asynchronous else largest)
            assert result.save_host_bytes["sharded"] == 12 * shape.params / 8


def test_sequence_parallel_divides_a_workers_activations_as_bench_sequence_parallel_measured():
    """With parallel.sequence_parallel N, a worker holds 1/N of each row: its planned activations against N = 1's
    are within 15% of the ratio bench/sequence_parallel.py measured at its longest row (where activations are
    nearly all of what it counts), and NO_SHARD's shard group becomes the sequence group FSDP shards over."""
    measured = json.loads((REPO / "docs" / "bench" / "cpu-sequence-parallel.json").read_text())
    args, longest = measured["args"], max(measured["args"]["lengths"])
    hidden = args["hidden"]
    model = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                        num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
                        num_key_value_heads=args["kv_heads"], vocab_size=args["vocab"])
    planned = {}
    for n in (1, 2, 4):
        cfg = load_config(None, ["model.tokenizer=builtin:demo", f"parallel.sequence_parallel={n}",
                                 "scaling.num_workers=4", "data.packing=true", f"train.micro_batch_tokens={longest}"])
        result = plan(cfg, model_shape(cfg, model), Topology(4, 1))
        planned[n] = result.terms["activations"]
        assert result.shard_group == 4  # FULL_SHARD: the sequence groups are carved out of it and folded back
    rows = {r["n"]: r for r in measured["rows"] if r["length"] == longest}
    for n in (2, 4):
        ratio = planned[n] / planned[1]
        assert abs(ratio / rows[n]["memory_vs_n1"] - 1) <= 0.15, (n, ratio, rows[n]["memory_vs_n1"])
    no_shard = load_config(None, ["model.tokenizer=builtin:demo", "parallel.sharding=NO_SHARD",
                                  "parallel.sequence_parallel=2", "scaling.num_workers=4"])
    assert plan(no_shard, model_shape(no_shard, model), Topology(4, 1)).shard_group == 2



@pytest.mark.parametrize(("sharding", "nodes", "copies"),
                         [("FULL_SHARD", 2, True), ("SHARD_GRAD_OP", 2, True), ("FULL_SHARD", 1, False),
                          ("HYBRID_SHARD", 2, False), ("NO_SHARD", 2, False)])
def test_the_memory_tier_counts_staging_two_snapshots_and_a_partners_two_only_without_a_replica(sharding, nodes,
                                                                                                  copies):
    """Per node of 2 workers, b a worker's part of the state (its shards of the weights and AdamW state): b each
    staged, 2 own snapshots and, when no replica on another node holds the same shards, 2 of the partner's
    (raysft.checkpoint.memory keeps 2 steps, tests/test_memory_tier.py holds it to that); and the verdicts against
    the host memory and /dev/shm's default half of it."""
    from raysft.tools.plan import memory_tier_host, render

    small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)
    cfg = load_config(None, ["model.tokenizer=builtin:demo", f"parallel.sharding={sharding}",
                             "scaling.num_workers=4", "checkpoint.memory_every_n_steps=1"])
    shape = model_shape(cfg, small)
    result = plan(cfg, shape, Topology(4, nodes))
    part = 12 * shape.params / result.shard_group  # fp32 weights and AdamW's two moments, this worker's shards
    tier = memory_tier_host(cfg, result)
    assert tier.workers == 4 // nodes
    assert tier.terms == {"staging buffers": tier.workers * part, "own snapshots": 2 * tier.workers * part,
                          "partner copies": 2 * tier.workers * part if copies else 0.0}
    assert "fits: unknown (give --host-mem-gib)" in render(cfg, result)

    def verdicts(host: float) -> list[str]:
        lines = render(cfg, plan(cfg, shape, Topology(4, nodes, host_mem_bytes=host))).splitlines()
        return [line.split(": ")[-1].split(" ")[0] for line in lines if line.startswith("  fits ") and "host" in line]

    total, shm = tier.total, tier.in_memory_dir
    assert verdicts(2 * shm) == ["yes", "yes"]
    assert verdicts(total * 0.99) == ["NO", "NO"]
    assert verdicts(total * 1.01) == ["yes", "NO"]  # in host memory, but /dev/shm is half of it


def test_the_memory_tier_of_a_lora_run_counts_the_adapters_only():
    """A LoRA snapshot holds what trains (raysft.checkpoint.trainable): the adapters and their AdamW state."""
    from raysft.tools.plan import memory_tier_host

    small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)
    cfg = load_config(None, ["model.tokenizer=builtin:demo", "model.lora.r=8", "scaling.num_workers=2"])
    shape = model_shape(cfg, small)
    tier = memory_tier_host(cfg, plan(cfg, shape, Topology(2, 2)))
    assert tier.terms["staging buffers"] == 12 * shape.trainable / 2
