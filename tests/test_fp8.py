"""FP8 training's conversion and refusals (raysft.parallel.fp8), as far as a CPU can take them: which linear layers
become torchao's Float8Linear, that parallelize converts them before fully_shard and refuses a CPU by name, that the
converted, sharded model holds the plain model's weights under the plain model's names, and each refusal (a CPU, a
GPU without FP8, no torchao, LoRA) naming parallel.fp8 and what to do. No FP8 matmul runs here (a CPU has none):
tests/test_gpu.py and the device check's `fp8` leg train in FP8 on a GPU.

The suite's environment has no torchao (pyproject.toml says why): the tests that convert run on two gloo ranks that
import the device bundle's torchao from a folder of their own (`torchao_site`, installed from PyPI once)."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, gloo_processes
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import LlamaConfig

from raysft.config import ConfigError, ModelConfig, ParallelConfig, load_config
from raysft.distributed.layout import ParallelDims
from raysft.model.build import build_meta_model, load_initial_weights, materialize
from raysft.parallel import fp8, fsdp

# head_dim 16: q/o 64x64 and k/v 32x64 are FP8's; the MLP's width 72 is not a multiple of 16; the LM head (64 -> 256)
# would be, and is left out as the head
SHAPE = dict(hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=64)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
CONVERTED = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION]


def torchao_site() -> Path:
    """The torchao that the device bundle carries (bench/gpu/bundle.py's pin), installed once into .gpubundle-cache/
    (ignored by git): a folder for sys.path or PYTHONPATH."""
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import bundle

    requirement = next(r for r, _ in bundle.CARRIED if r.startswith("torchao=="))
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = REPO / ".gpubundle-cache" / f"{requirement.replace('==', '-')}-py{python}"
    if not (site / "torchao").is_dir():
        (wheel,) = bundle.download([requirement], python, REPO / ".gpubundle-cache")
        partial = site.with_name(site.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        str(partial), str(wheel)], check=True)
        partial.rename(site)
    return site


@pytest.fixture(scope="module")
def torchao_pool(tmp_path_factory):
    """Two gloo ranks whose sys.path starts with torchao_site() (spawned processes start with their parent's
    sys.path, which has it only while they start)."""
    site = str(torchao_site())
    sys.path.insert(0, site)
    try:
        pool = gloo_processes(2, tmp_path_factory.mktemp("fp8-gloo"))
        ranks = pool.__enter__()
    finally:
        sys.path.remove(site)
    yield ranks
    pool.__exit__(None, None, None)


def meta_model(**shape) -> nn.Module:
    return build_meta_model(LlamaConfig(**{**SHAPE, **shape}, tie_word_embeddings=False), "sdpa")


@pytest.fixture
def torchao_installed(monkeypatch):
    """find_spec finds torchao (the checks ask only whether it is installed)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))


@pytest.fixture
def torchao_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))


def test_fp8_takes_every_linear_layer_but_the_lm_head_whose_dimensions_are_multiples_of_16():
    assert fp8.fp8_linear_names(meta_model()) == CONVERTED
    # an MLP of width 96 is FP8's too; the head, of a vocabulary that 16 divides, still is not
    wide = fp8.fp8_linear_names(meta_model(intermediate_size=96))
    assert len(wide) == 14 and "model.layers.1.mlp.down_proj" in wide and "lm_head" not in wide


def test_fp8_is_refused_on_a_cpu_by_name():
    with pytest.raises(ConfigError, match="this worker trains on cpu") as e:
        fp8.require_fp8("cpu")
    assert "config key 'parallel.fp8'" in str(e.value) and "set parallel.fp8: false" in str(e.value)


@pytest.mark.parametrize("capability, name, refused", [
    ((8, 0), "NVIDIA A100-SXM4-80GB", True), ((7, 5), "Tesla T4", True),
    ((8, 9), "NVIDIA L4", False), ((9, 0), "NVIDIA H100 80GB HBM3", False), ((10, 0), "NVIDIA B200", False),
])
def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch, torchao_installed, capability, name, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    if not refused:
        fp8.require_fp8("cuda")
        return
    with pytest.raises(ConfigError, match=f"this worker's {name} has {capability[0]}.{capability[1]}") as e:
        fp8.require_fp8("cuda")
    assert "config key 'parallel.fp8'" in str(e.value) and "8.9 or higher" in str(e.value)


def test_fp8_without_torchao_is_refused_naming_the_extra_to_install(monkeypatch, torchao_missing):
    with pytest.raises(ConfigError, match=r"pip install 'raysft\[fp8\]'") as e:
        load_config(None, ["parallel.fp8=true"])  # on the driver, before any worker starts
    assert "config key 'parallel.fp8'" in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    with pytest.raises(ConfigError, match=r"not installed on this worker: pip install 'raysft\[fp8\]'"):
        fp8.require_fp8("cuda")  # a worker whose node lacks it
    assert load_config(None, []).parallel.fp8 is False  # FP8 off: torchao is not needed


def test_fp8_is_refused_with_lora(torchao_installed):
    with pytest.raises(ConfigError, match="model.lora.r=8 the base is frozen") as e:
        load_config(None, ["parallel.fp8=true", "model.lora.r=8"])
    assert "config key 'parallel.fp8'" in str(e.value)
    assert load_config(None, ["parallel.fp8=true"]).parallel.fp8 is True


def _parallelized(ctx, fp8_on: bool, device_check: bool) -> dict:
    """On every rank: the model built and sharded as the Trainer does (FULL_SHARD), with parallel.fp8 or without;
    with `device_check` False the FP8 device check stands aside (a CPU cannot run FP8's matmuls, but it can convert
    and shard). The refusal, or the module types, the local shards' types and, on rank 0, the full state dict."""
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False)
    cfg = ParallelConfig(fp8=fp8_on)
    model = build_meta_model(config, "sdpa")
    real = fsdp.require_fp8
    if not device_check:
        fsdp.require_fp8 = lambda device_type: None
    try:
        fsdp.parallelize(model, ParallelDims.from_config(cfg, [0] * ctx.world_size).build_mesh("cpu"), cfg)
    except ConfigError as e:
        return {"refused": str(e), "types": sorted({type(m).__name__ for m in model.modules()})}
    finally:
        fsdp.require_fp8 = real
    materialize(model, torch.device("cpu"))
    load_initial_weights(model, ModelConfig(path=""), config, seed=3)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"types": {name: type(m).__name__ for name, m in model.named_modules()},
            "local": {name: type(p.to_local()).__name__ for name, p in model.named_parameters()},
            "weights": {k: (type(v).__name__, v.dtype, v.detach().clone()) for k, v in weights.items()}
            if ctx.rank == 0 else None}


def _converted(ctx) -> dict:
    """The conversion alone, on the meta device: the modules' and weights' types, the state dict's shapes, the
    torchao config of each Float8Linear."""
    model = meta_model()
    names = fp8.convert_to_fp8(model)
    return {"names": names, "types": {name: type(m).__name__ for name, m in model.named_modules()},
            "weights": {name: type(m.weight.data).__name__ for name, m in model.named_modules() if name in names},
            "configs": {(m.config.enable_fsdp_float8_all_gather, m.config.cast_config_weight.scaling_granularity.value,
                         m.config.cast_config_input.scaling_granularity.value)
                        for name, m in model.named_modules() if name in names},
            "state": {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}}


def test_parallelize_refuses_fp8_on_a_cpu_mesh_before_converting_anything(gloo_pool):
    for result in gloo_pool.run(_parallelized, True, True):
        assert "config key 'parallel.fp8'" in result["refused"] and "trains on cpu" in result["refused"]
        assert "Float8Linear" not in result["types"]


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_the_conversion_swaps_those_modules_for_float8_linear_keeping_names_shapes_and_dtypes(torchao_pool):
    result = torchao_pool.run(_converted)[0]
    assert result["names"] == CONVERTED
    assert {n for n, t in result["types"].items() if t == "Float8Linear"} == set(CONVERTED)
    assert result["types"]["lm_head"] == result["types"]["model.layers.0.mlp.up_proj"] == "Linear"
    assert set(result["weights"].values()) == {"WeightWithDynamicFloat8CastTensor"}  # cast before the all-gather
    assert result["configs"] == {(True, "tensorwise", "tensorwise")}  # float8 all-gather, tensorwise scaling
    # checkpoints, the seeded init and export see the same state: names, shapes, dtypes
    plain = {k: (tuple(v.shape), v.dtype) for k, v in meta_model().state_dict().items()}
    assert result["state"] == plain


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_the_converted_sharded_model_holds_the_plain_models_weights_under_its_names(gloo_pool, torchao_pool):
    plain, converted = gloo_pool.run(_parallelized, False, True)[0], torchao_pool.run(_parallelized, True, False)
    for rank in converted:  # converted before fully_shard: FSDP shards torchao's weight subclass
        assert {n for n, t in rank["types"].items() if t == "Float8Linear"} == set(CONVERTED)
        assert {n.rsplit(".", 1)[0] for n, t in rank["local"].items()
                if t == "WeightWithDynamicFloat8CastTensor"} == set(CONVERTED)
    weights = converted[0]["weights"]
    assert weights.keys() == plain["weights"].keys()
    for name, (kind, dtype, value) in weights.items():  # what a checkpoint writes: plain tensors, the same values
        assert (kind, dtype) == ("Tensor", torch.float32), name
        assert torch.equal(value, plain["weights"][name][2]), name
