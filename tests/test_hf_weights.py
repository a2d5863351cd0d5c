"""Pretrained weights read per rank (raysft.hf.weights through model.load_initial_weights): every rank's shards hold
exactly from_pretrained's fp32 values, on 2 and 4 gloo processes and every sharding strategy, uneven shards and
LoRA's base included, without rank 0 ever holding the whole model; a tied-weights model (the LM head is the embedding)
likewise, its tie holding through a training step."""

from pathlib import Path

import pytest
import torch
from conftest import assert_close_but_for_rare_elements
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from raysft.config import LoraConfig, ModelConfig, ParallelConfig
from raysft.distributed.layout import ParallelDims
from raysft.hf.weights import local_part
from raysft.model.build import build_meta_model, load_initial_weights, materialize
from raysft.model.lora import add_adapters
from raysft.parallel.fsdp import parallelize

SEED = 7
# vocab and widths that no world size of 2 or 4 divides: uneven shards, and an empty one is possible
SHAPE = dict(vocab_size=32003, hidden_size=256, intermediate_size=702, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _write_model(path: Path, tied: bool) -> Path:
    """A random Llama in bf16, saved as transformers saves it, in two safetensors files with an index."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE, tie_word_embeddings=tied), dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="20MB")
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    path = _write_model(tmp_path_factory.mktemp("pretrained"), tied=False)
    assert (path / "model.safetensors.index.json").is_file()  # more than one file
    return path


def _vm_kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def _load(ctx, path: str, sharding: str, mixed_precision: str, lora_r: int) -> dict:
    """On every rank: the model built as the trainer builds it, then its initial weights; this rank's shards (with
    the slices of the full tensors they hold) and how much its resident memory rose above what it held before."""
    return _build_and_load(ctx, path, sharding, mixed_precision, lora_r)[1]


def _build_and_load(ctx, path: str, sharding: str, mixed_precision: str, lora_r: int) -> tuple:
    config = AutoConfig.from_pretrained(path)
    model_cfg = ModelConfig(path=path, lora=LoraConfig(r=lora_r, target_modules=["q_proj", "v_proj"]))
    parallel = ParallelConfig(sharding=sharding, mixed_precision=mixed_precision,
                              hsdp_shard_size=2 if sharding == "HYBRID_SHARD" else 0)
    model = add_adapters(build_meta_model(config, "sdpa"), model_cfg.lora)
    parallelize(model, ParallelDims.from_config(parallel, [0] * ctx.world_size).build_mesh("cpu"), parallel)
    materialize(model, torch.device("cpu"))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before = _vm_kib("VmRSS")
    fallback = load_initial_weights(model, model_cfg, config, SEED)
    rise = (_vm_kib("VmHWM") - before) * 1024
    shards = {}
    for name, param in model.named_parameters():
        local, index = local_part(param)
        shards[name] = ([(s.start, s.stop) for s in index], local.detach().clone())
    return model, {"fallback": fallback, "rise": rise, "shards": shards}


def _reference(path: Path, lora_r: int = 0) -> dict[str, torch.Tensor]:
    """Today's values: from_pretrained in fp32 (and LoRA's adapters seeded on it), by parameter name."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora_r:
        model = add_adapters(model, LoraConfig(r=lora_r, target_modules=["q_proj", "v_proj"]), SEED)
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_bit_identical(results: list[dict], reference: dict[str, torch.Tensor]) -> None:
    for rank, result in enumerate(results):
        assert set(result["shards"]) == set(reference)
        for name, (index, local) in result["shards"].items():
            full = reference[name]
            expected = full[tuple(slice(a, b) for a, b in index)]
            assert torch.equal(local, expected), f"rank {rank}: {name} differs from from_pretrained's fp32 values"


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_two_ranks_read_their_slices_bit_identical_to_from_pretrained(pretrained, gloo_pool, sharding):
    results = gloo_pool.run(_load, str(pretrained), sharding, "fp32", 0)
    assert [r["fallback"] for r in results] == [None, None]
    _check_bit_identical(results, _reference(pretrained))


@pytest.mark.slow  # starts four processes of torch and trains on them: make test-fast leaves it out
def test_four_ranks_hybrid_and_full_shard_bf16_and_lora_base_bit_identical(pretrained, gloo_pool4):
    reference = _reference(pretrained)
    for sharding, mp in [("HYBRID_SHARD", "fp32"), ("FULL_SHARD", "bf16")]:
        _check_bit_identical(gloo_pool4.run(_load, str(pretrained), sharding, mp, 0), reference)
    lora = gloo_pool4.run(_load, str(pretrained), "FULL_SHARD", "fp32", 4)
    assert all(r["fallback"] is None for r in lora)
    _check_bit_identical(lora, _reference(pretrained, lora_r=4))  # the base from the files, the adapters seeded


def test_no_rank_holds_the_whole_model_while_loading(pretrained, gloo_pool):
    """No rank's resident memory rises by the whole fp32 model while the weights arrive: at most its own half (first
    touched as the values land) and the pages of the slices it reads, under three quarters of the model (57% was
    seen; below half only when the pool's process had that memory resident from an earlier test). Rank 0's old
    way, a full fp32 copy beside its shards, rises by one and a half models."""
    full_bytes = sum(t.numel() * 4 for t in _reference(pretrained).values())
    results = gloo_pool.run(_load, str(pretrained), "FULL_SHARD", "fp32", 0)
    for rank, result in enumerate(results):
        assert result["rise"] < 0.75 * full_bytes, (f"rank {rank}: resident memory rose by {result['rise']} bytes "
                                                 f"loading a {full_bytes}-byte model")


def _train_step(model: torch.nn.Module) -> None:
    """One AdamW step on a fixed batch, the same on every rank (so FSDP's averaged gradient is the batch's)."""
    ids = torch.randint(SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _load_tied_and_step(ctx, path: str) -> dict:
    """_load's result for a tied model, then whether the head is still the embedding after one training step, and
    this rank's shards after it."""
    model, result = _build_and_load(ctx, path, "FULL_SHARD", "fp32", 0)
    _train_step(model)
    result["tied_after_step"] = model.lm_head.weight is model.model.embed_tokens.weight
    result["stepped"] = {name: local_part(p)[0].detach().clone() for name, p in model.named_parameters()}
    return result


def test_tied_weights_are_read_per_rank_stay_tied_through_a_step_and_no_rank_holds_the_model(tmp_path, gloo_pool):
    """Tied embeddings (Llama-3.2-1B/3B, Qwen2.5 up to 3B) take the per-rank read like every other model: the files
    hold the embedding once (transformers saves no lm_head.weight), each rank reads its slice of it once, and the
    head is that same parameter. After a step both ranks' shards equal from_pretrained's model stepped alike.
    Memory: the embedding is 85% of this model, so a rank's rise is its half of the model plus the slice of the
    embedding it reads (bf16, and the file's pages it maps): about 0.8 of the fp32 model was seen. Rank 0's old way
    held a whole fp32 copy beside its shards, one and a half models."""
    path = _write_model(tmp_path / "tied", tied=True)
    results = gloo_pool.run(_load_tied_and_step, str(path))
    reference = _reference(path)
    assert "lm_head.weight" not in reference and "model.embed_tokens.weight" in reference  # one parameter
    full_bytes = sum(t.numel() * 4 for t in reference.values())
    for rank, result in enumerate(results):
        assert result["fallback"] is None, f"rank {rank}: {result['fallback']}"
        assert result["rise"] < full_bytes, (f"rank {rank}: resident memory rose by {result['rise']} bytes "
                                              f"loading a {full_bytes}-byte model")
        assert result["tied_after_step"], f"rank {rank}: the head is no longer the embedding after a step"
    _check_bit_identical(results, reference)

    stepped = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _train_step(stepped)
    assert stepped.lm_head.weight is stepped.model.embed_tokens.weight
    for rank, result in enumerate(results):
        for name, (index, _) in result["shards"].items():
            expected = dict(stepped.named_parameters())[name].detach()[tuple(slice(a, b) for a, b in index)]
            assert not torch.equal(expected, reference[name][tuple(slice(a, b) for a, b in index)]), name
            # AdamW's first step moves each element by lr times its gradient's sign: one whose gradient is nearly
            # zero may round to the other sign in another layout (1.9e-6 seen); wrong gradients flip most
            assert_close_but_for_rare_elements(result["stepped"][name], expected, rtol=1e-5, atol=1e-6, bound=2e-3,
                                               what=f"rank {rank}: {name} after a step")


def _save_and_resume(ctx, path: str, out: Path) -> bool:
    """A full checkpoint of the loaded weights and AdamW state (moments from a seeded gradient, lr 0 so the weights
    stay from_pretrained's), saved and then loaded back over zeroed shards, with the whole-state ways refused: a
    gather of the full state dict on save, a read of a whole file on resume. Whether every local shard came back
    bit for bit."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from raysft.checkpoint import TrainingObjects, full

    config = AutoConfig.from_pretrained(path)
    model = build_meta_model(config, "sdpa")
    parallel = ParallelConfig()
    parallelize(model, ParallelDims.from_config(parallel, [0] * ctx.world_size).build_mesh("cpu"), parallel)
    materialize(model, torch.device("cpu"))
    load_initial_weights(model, ModelConfig(path=path), config, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    torch.manual_seed(ctx.rank)
    for p in model.parameters():
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())
    optimizer.step()
    objs = TrainingObjects(model, optimizer, None, None, config, None, {}, None)
    local = [*(p.to_local() for p in model.parameters()),
             *(t.to_local() if isinstance(t, DTensor) else t for s in optimizer.state.values() for t in s.values())]
    saved = [t.clone() for t in local]

    def no_whole_state(get):
        def refuse(*args, options=None, **kwargs):
            assert not (options and options.full_state_dict), "the whole state gathered at once"
            return get(*args, options=options, **kwargs)
        return refuse

    with mock.patch.object(full, "get_model_state_dict", no_whole_state(full.get_model_state_dict)), \
            mock.patch.object(full, "get_optimizer_state_dict", no_whole_state(full.get_optimizer_state_dict)):
        full.save(out, objs, asynchronous=False).result()
    with torch.no_grad():
        for t in local:
            t.zero_()
    torch.distributed.barrier()
    with mock.patch.object(full, "read_safetensors", side_effect=AssertionError("a whole file read")):
        full.load(out, objs)
    return all(torch.equal(a, b) for a, b in zip(local, saved, strict=True))


def test_full_checkpoint_streams_its_save_and_resumes_from_each_ranks_slices(pretrained, gloo_pool, tmp_path):
    """A full save gathers one tensor at a time, never the whole state dict, and a resume reads each rank's slices
    (no rank reads a whole file); the shards come back bit for bit, and the files are still plain safetensors
    holding from_pretrained's values and AdamW's state by parameter name."""
    from safetensors.torch import load_file

    assert gloo_pool.run(_save_and_resume, str(pretrained), tmp_path) == [True, True]
    reference = _reference(pretrained)
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == reference.keys() and all(torch.equal(written[k], reference[k]) for k in reference)
    moments = load_file(tmp_path / "optimizer.safetensors")
    assert {k.rsplit("/", 1)[0] for k in moments} == set(reference)
    assert {k.rsplit("/", 1)[1] for k in moments} == {"exp_avg", "exp_avg_sq", "step"}
