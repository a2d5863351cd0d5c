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



def test_dpo_plans_two_sequences_per_pair():
    """train.objective dpo: micro_batch_size pairs are twice the rows; a token budget holds at least one whole pair."""
    sft = cli_in_process("plan", "--set", "train.micro_batch_size=2")
    dpo = cli_in_process("plan", "--set", "train.micro_batch_size=2", "--set", "train.objective=dpo")
    assert sft.returncode == dpo.returncode == 0, dpo.stderr
    assert "micro-batch of 1,024 tokens" in sft.stdout and "micro-batch of 2,048 tokens" in dpo.stdout
    budget = ("--set", "data.packing=true", "--set", "train.micro_batch_tokens=600")
    assert "micro-batch of 1,024 tokens" in cli_in_process("plan", *budget, "--set", "train.objective=dpo").stdout


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



# --- off the cluster: the architecture without weights or a tokenizer (raysft.tools.architectures) ---------------

LLAMA_70B = REPO / "jobs/configs/llama3-70b-4x8.yaml"  # model.path /mnt/shared/...: on the cluster only


@pytest.mark.parametrize("model", ["llama3-70b", "jobs/configs/models/llama-3.1-70b.json", "jobs/configs/models/"],
                         ids=["name", "config.json", "directory"])
def test_a_job_config_is_planned_off_the_cluster_from_a_name_or_a_config_json_without_a_tokenizer(model, tmp_path):
    """The 70B job config names a model directory and tokenizer that only the cluster has: `--model` gives the
    architecture from a known name, a config.json or a directory holding one, and nothing reads a tokenizer."""
    if model.endswith("/"):  # a model directory: only its config.json is read
        (tmp_path / "config.json").write_text((REPO / "jobs/configs/models/llama-3.1-70b.json").read_text())
        model = str(tmp_path)
    out = cli_in_process("plan", str(LLAMA_70B), "--model", model, "--gpu-mem-gib", "74.5")
    assert out.returncode == 0, out.stderr
    assert "(70,553,706,496)" in out.stdout and "fits 74.5 GiB per GPU: yes" in out.stdout
    assert "each rank reads its slices of model.path" in out.stdout  # the config's model.path, counted as a launch


def test_without_the_model_directory_plan_says_to_give_the_architecture_and_an_unknown_name_lists_the_known():
    out = cli_in_process("plan", str(LLAMA_70B))
    assert out.returncode == 2
    assert ("config key 'model.path': /mnt/shared/models/Meta-Llama-3.1-70B-Instruct is not on this machine (no "
            "config.json there): give the architecture with --model NAME (one of llama3-8b, llama3-70b") in out.stderr
    assert "tokenizer" not in out.stderr
    unknown = cli_in_process("plan", str(LLAMA_70B), "--model", "llama-70b")
    assert unknown.returncode == 2
    assert "--model 'llama-70b' is neither a known architecture (llama3-8b, llama3-70b, " in unknown.stderr


@pytest.mark.parametrize(("name", "params"), [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3.2-1b", 1_235_814_400),
    ("llama3.2-3b", 3_212_749_824), ("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-3b", 3_085_938_688),
    ("qwen2.5-7b", 7_615_616_512)])
def test_each_known_architecture_has_its_models_parameter_count(name, params):
    """The counts of the released models (their model cards: Llama-3.1 8.03B and 70.6B, Llama-3.2 1.23B and 3.21B,
    Qwen2.5 1.54B, 3.09B and 7.61B), here exact: embeddings tied where the model ties them (Llama-3.2, Qwen2.5 up to
    3B), Qwen2's q/k/v biases. The Llama-3.1 shapes are those of the config.json files in jobs/configs/models."""
    from raysft.tools.architectures import known_architecture

    config = known_architecture(name)
    cfg = load_config(None, ["model.tokenizer=builtin:demo"])
    assert model_shape(cfg, config).params == params
    if name in ("llama3-8b", "llama3-70b"):
        hub = json.loads((REPO / f"jobs/configs/models/llama-3.1-{name.removeprefix('llama3-')}.json").read_text())
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
            assert getattr(config, key) == hub[key], key


# --- plan refuses what train refuses ----------------------------------------------------------------------------


def _usage_error(*args: str) -> tuple[int, str]:
    """`raysft plan ARGS` refused by argparse: its exit code and message."""
    import contextlib
    import io

    from raysft.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(["plan", *args])
    return exited.value.code, err.getvalue()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-8"])
def test_a_gpu_memory_that_is_not_a_finite_positive_number_is_refused_by_name(value):
    code, err = _usage_error(f"--gpu-mem-gib={value}")
    assert code == 2 and f"argument --gpu-mem-gib: must be a finite number above 0, got '{value}'" in err


HYBRID_8 = ("--set", "parallel.sharding=HYBRID_SHARD", "--set", "parallel.hsdp_shard_size=8",
            "--set", "scaling.num_workers=16", "--set", "train.global_batch_size=64")


@pytest.mark.parametrize(("args", "refusal"), [
    (("--set", "parallel.sequence_parallel=2"),
     "config key 'parallel.sequence_parallel': needs data.packing: true and model.attn_implementation: varlen"),
    ((*HYBRID_8, "--workers", "4"),
     "config key 'parallel.hsdp_shard_size': shard-group size 8 does not divide scaling.num_workers=4"),
    ((*HYBRID_8, "--nodes", "4"),
     "config key 'parallel.hsdp_shard_size': a shard group of 8 workers is larger than any node"),
    (("--workers", "2", "--nodes", "3"), "--nodes 3: more nodes than the 2 workers"),
], ids=["sequence parallel without packing", "shard group over the workers", "shard group over a node",
        "more nodes than workers"])
def test_plan_refuses_what_a_launch_refuses_naming_the_key(args, refusal):
    """`raysft plan` runs the checks a launch runs on the driver (load_config's for the worker count it plans,
    and those against the architecture: raysft.launch.prelaunch.check_architecture), so it plans nothing that
    `raysft train` would refuse; each refusal is exit 2 naming the key or the option."""
    out = cli_in_process("plan", *args)
    assert out.returncode == 2 and refusal in out.stderr, out.stderr
    assert not out.stdout


def test_plan_names_an_unreachable_cluster_within_the_connect_timeout(monkeypatch):
    """RAY_ADDRESS naming a port nobody listens on (127.0.0.1): the probe `raysft train` makes names it after the
    connect timeout (2 s here, 30 by default), where ray.init alone retried it for minutes and ignored SIGTERM."""
    import socket

    from raysft.distributed import local_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nobody listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setattr(local_ray, "CONNECT_TIMEOUT_S", 2.0)
    out = cli_in_process("plan")
    assert out.returncode == 1 and f"RAY_ADDRESS=127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}" in out.stderr


# --- the initial weights: rank 0's whole-model load counted where a launch would take it --------------------------


def _small_model_dir(path, tied: bool, renamed: bool = False):
    """A small Llama as transformers saves it; `renamed`: its tensors under other names (`transformer.` for
    `model.`), as a checkpoint of another naming holds them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    if renamed:
        tensors = load_file(path / "model.safetensors")
        save_file({k.replace("model.", "transformer.", 1): v for k, v in tensors.items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("case", ["tied", "renamed"])
def test_plan_counts_rank_0s_whole_model_load_only_where_a_launch_takes_it(tmp_path, case):
    """Tied embeddings are read per rank like every other model (tests/test_hf_weights.py); only files that name
    the model's tensors otherwise make rank 0 load the whole fp32 model (4 P) and broadcast it, and plan says so."""
    model_dir = _small_model_dir(tmp_path / case, tied=case == "tied", renamed=case == "renamed")
    out = cli_in_process("plan", "--set", f"model.path={model_dir}", "--workers", "2")
    assert out.returncode == 0, out.stderr
    cfg = load_config(None, [f"model.path={model_dir}", "scaling.num_workers=2"])
    from raysft.tools.architectures import initial_weights_fallback, plan_architecture

    hf_config, _ = plan_architecture(cfg)
    shape = model_shape(cfg, hf_config)
    result = plan(cfg, shape, Topology(2, 1), rank0_init=initial_weights_fallback(cfg, hf_config))
    if case == "tied":
        assert "each rank reads its slices of model.path" in out.stdout
        assert result.init_host_bytes == 4 * shape.largest_module / 2
    else:
        assert ("rank 0 loads model.path whole and broadcasts it: 20 of the model's tensors are not in the files "
                "under their names") in out.stdout
        assert result.init_host_bytes == 4 * shape.params


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


def test_the_memory_tier_counts_the_node_that_receives_most_on_uneven_nodes():
    """4 workers on 3 nodes (2, 1, 1): the node of 2 receives the copies of the last node's 1 worker and keeps its own
    2; the node of 1 after it receives 2 (raysft.checkpoint.memory.transport.partners). The first needs most: 2
    staged, 2 x 2 own, 2 x 1 received."""
    from raysft.tools.plan import memory_tier_host

    small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)
    cfg = load_config(None, ["model.tokenizer=builtin:demo", "scaling.num_workers=4",
                             "checkpoint.memory_every_n_steps=1"])
    result = plan(cfg, model_shape(cfg, small), Topology(4, 3))
    part = result.save_host_bytes["sharded"]
    tier = memory_tier_host(cfg, result)
    assert tier.workers == 2
    assert tier.terms == {"staging buffers": 2 * part, "own snapshots": 4 * part, "partner copies": 2 * part}


def test_the_memory_tier_of_a_lora_run_counts_the_adapters_only():
    """A LoRA snapshot holds what trains (raysft.checkpoint.trainable): the adapters and their AdamW state."""
    from raysft.tools.plan import memory_tier_host

    small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000)
    cfg = load_config(None, ["model.tokenizer=builtin:demo", "model.lora.r=8", "scaling.num_workers=2"])
    shape = model_shape(cfg, small)
    tier = memory_tier_host(cfg, plan(cfg, shape, Topology(2, 2)))
    assert tier.terms["staging buffers"] == 12 * shape.trainable / 2
