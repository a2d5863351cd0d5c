"""A damaged or crafted model or tokenizer directory is refused on the driver, naming the file and the fault, before
Ray starts and before the data is tokenized; no code of it runs and nobody is asked whether to run it (Ray-free)."""

import io
import json
import re
import shutil
import struct
import sys

import pytest
from conftest import cli_in_process, tiny_config

from raysft.config import ConfigError, ModelConfig
from raysft.errors import CheckpointError
from raysft.hf.files import ModelDirError, weight_files
from raysft.hf.shards import listed_files

MARKER = "ran.txt"  # what the directory's code writes when it is imported


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo model as a pretrained directory: config.json, model.safetensors and the tokenizer."""
    from raysft.data.tokenizer import load_tokenizer
    from raysft.model.build import build_full_model, load_model_config

    out = tmp_path_factory.mktemp("pretrained")
    tokenizer = load_tokenizer(ModelConfig())
    build_full_model(ModelConfig(), load_model_config(ModelConfig(), tokenizer), seed=1).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def edit_json(path, **values):
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def header_bomb(d):  # the length field claims a 1 TiB header
    weights = bytearray((d / "model.safetensors").read_bytes())
    weights[:8] = struct.pack("<Q", 1 << 40)
    (d / "model.safetensors").write_bytes(weights)


def cut_in_half(d):
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])


def cut_in_the_header(d):
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])


def dtype_that_does_not_fit(d):  # same header length, a tensor's dtype no longer fits its bytes
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights.replace(b'"F32"', b'"F16"', 1))


def config_not_json(d):
    (d / "config.json").write_text('{"model_type": "llama", ')


def index_outside(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))


def model_code(d):
    """A config whose model_type transformers does not know, and the code that would define it."""
    edit_json(d / "config.json", model_type="sneaky", auto_map={
        "AutoConfig": "configuration_sneaky.SneakyConfig", "AutoModelForCausalLM": "modeling_sneaky.SneakyForCausalLM"})
    for module, base in (("configuration_sneaky", "LlamaConfig"), ("modeling_sneaky", "LlamaForCausalLM")):
        sneaky = base.replace("Llama", "Sneaky")
        (d / f"{module}.py").write_text(f"open({str(d / MARKER)!r}, 'w').write('{module} ran')\n"
                                        f"from transformers import {base}\n"
                                        f"class {sneaky}({base}):\n    model_type = 'sneaky'\n")


def tokenizer_code(d):
    edit_json(d / "tokenizer_config.json", tokenizer_class="SneakyTokenizer",
              auto_map={"AutoTokenizer": ["tokenization_sneaky.SneakyTokenizer", None]})
    (d / "tokenization_sneaky.py").write_text(f"open({str(d / MARKER)!r}, 'w').write('tokenizer ran')\n"
                                              "from transformers import PreTrainedTokenizerFast\n"
                                              "class SneakyTokenizer(PreTrainedTokenizerFast):\n    pass\n")


FAULTS = {
    header_bomb: r"model\.safetensors: the safetensors header claims 1099511627776 bytes but the file has \d+: the "
                 "file is cut off or is no safetensors file",
    cut_in_half: r"model\.safetensors: tensor '[\w.]+' ends at byte \d+ of the data, but the file holds \d+ bytes of "
                 "data: the file is cut off",
    cut_in_the_header: r"model\.safetensors: the safetensors header claims \d+ bytes but the file has 100",
    dtype_that_does_not_fit: r"model\.safetensors: safetensors cannot read it: ",
    config_not_json: r"config\.json: not valid JSON \(.*\): a damaged or incomplete copy",
    index_outside: r"model\.safetensors\.index\.json: weight_map names '\.\./elsewhere\.safetensors', which is not a "
                   r"\.safetensors file of the directory",
    model_code: r"config\.json: auto_map asks for Python code shipped with the model \(AutoConfig: "
                r"configuration_sneaky\.SneakyConfig, .*\); raysft never runs code from a model directory",
    tokenizer_code: r"tokenizer_config\.json: auto_map asks for Python code shipped with the model \(AutoTokenizer: ",
}


def broken_copy(model_dir, tmp_path, fault):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    fault(d)
    return d


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_a_damaged_or_crafted_model_directory_is_a_config_error_naming_the_file_before_the_data_is_read(
        tmp_path, model_dir, fault):
    """prepare_launch is the driver's work before Ray starts: the header bomb was a worker's traceback after."""
    from raysft.launch.prelaunch import prepare_launch

    d = broken_copy(model_dir, tmp_path, fault)
    cfg = tiny_config(tmp_path, **{"model.path": str(d), "model.tokenizer": ""})
    with pytest.raises(ConfigError, match=f"config key 'model.path': {d}/{FAULTS[fault]}"):
        prepare_launch(cfg)
    assert not cfg.store_dir.exists() and not cfg.run_dir.exists()  # no data tokenized, no run claimed
    assert not (d / MARKER).exists()


def test_a_from_scratch_model_config_that_asks_for_code_is_refused(tmp_path, model_dir):
    from raysft.launch.prelaunch import prepare_launch

    d = broken_copy(model_dir, tmp_path, model_code)
    with pytest.raises(ConfigError, match=f"config key 'model.config': {d}/{FAULTS[model_code]}"):
        prepare_launch(tiny_config(tmp_path, **{"model.config": str(d)}))
    assert not (d / MARKER).exists()


@pytest.mark.parametrize("fault", [model_code, tokenizer_code], ids=lambda f: f.__name__)
def test_code_in_a_model_directory_never_runs_even_when_the_user_would_say_yes(tmp_path, model_dir, fault,
                                                                             monkeypatch):
    """transformers asks "Do you wish to run the custom code? [y/N]" on stdin for a model_type it does not know: a
    "y" there (or in a pipe) ran the directory's code. raysft refuses the directory without asking."""
    d = broken_copy(model_dir, tmp_path, fault)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    train = cli_in_process("train", "--set", f"model.path={d}", "--set", "model.tokenizer=",
                           "--set", f"run.storage_path={tmp_path / 'runs'}")
    chat = cli_in_process("chat", str(d), "--prompt", "hi")
    for result in (train, chat):
        assert "Do you wish" not in result.stdout + result.stderr
        assert f"{d}/{FAULTS[fault].split(':')[0].replace(chr(92), '')}: auto_map asks" in result.stderr
    assert train.returncode == 2 and train.stderr.startswith("raysft: config error: config key 'model.path': ")
    assert chat.returncode == 1 and "ModelDirError" in chat.stderr
    assert not (d / MARKER).exists()


def test_raysft_train_on_a_header_bomb_exits_2_naming_the_file_before_ray_starts(tmp_path, model_dir):
    """cli_in_process fails the test if the command started Ray: the bomb was a worker's traceback after."""
    d = broken_copy(model_dir, tmp_path, header_bomb)
    train = cli_in_process("train", "--set", f"model.path={d}", "--set", "model.tokenizer=",
                           "--set", f"run.storage_path={tmp_path / 'runs'}")
    assert train.returncode == 2 and "Traceback" not in train.stderr
    assert train.stderr.startswith(f"raysft: config error: config key 'model.path': {d}/model.safetensors: the "
                                   "safetensors header claims 1099511627776 bytes")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("fault", [header_bomb, cut_in_half], ids=lambda f: f.__name__)
def test_chat_and_a_merged_lora_export_name_the_damaged_weights_file(tmp_path, model_dir, fault):
    from raysft.products.adapters import _SafetensorsDir

    d = broken_copy(model_dir, tmp_path, fault)
    chat = cli_in_process("chat", str(d), "--prompt", "hi")
    assert chat.returncode == 1
    assert chat.stderr.startswith(f"raysft: error: ModelDirError: {d}/model.safetensors: ")
    with pytest.raises(ModelDirError, match=f"{d}/{FAULTS[fault]}"):
        _SafetensorsDir(d)  # the base weights of a LoRA run on model.path, read by export --merge


@pytest.mark.parametrize("base", ["pretrained", "from_scratch"])
def test_an_adapter_directory_whose_base_asks_for_code_is_refused_by_chat(tmp_path, model_dir, monkeypatch, base):
    """The base is model.path's directory, or (from scratch) the adapter directory's own config.json."""
    d = broken_copy(model_dir, tmp_path, model_code)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    if base == "pretrained":
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(d)}))
        named = d
    else:
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": ""}))
        (adapter / "raysft_export.json").write_text(json.dumps({"lora": {"base": {"seed": 1}}}))
        for file in ["config.json", *(p.name for p in d.glob("*.py"))]:
            shutil.copy(d / file, adapter)
        named = adapter
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    chat = cli_in_process("chat", str(adapter), "--prompt", "hi")
    assert chat.returncode == 1 and f"ModelDirError: {named}/config.json: auto_map asks" in chat.stderr
    assert "Do you wish" not in chat.stdout and not (d / MARKER).exists()


@pytest.mark.parametrize("index, model_dir_message, checkpoint_message", [
    ("[1, 2]", "holds a JSON list, not the object", "unreadable index: a JSON list, not an object"),
    ('{"weight_map": {}}', "has no weight_map of tensor names to files", "has no weight_map of tensor names to files"),
    ('{"weight_map": ', "not valid JSON", "unreadable index"),
])
def test_both_readers_of_an_index_refuse_a_broken_one_each_with_its_own_error(tmp_path, index, model_dir_message,
                                                                              checkpoint_message):
    """A model directory's index (raysft.hf.files) and a checkpoint's (raysft.hf.shards) are read by one parser,
    each reader keeping its own error class: a model directory is the user's input, a checkpoint raysft's own."""
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelDirError, match=model_dir_message):
        weight_files(tmp_path)
    with pytest.raises(CheckpointError, match=checkpoint_message):
        listed_files(tmp_path, "model")


def edit_weights(d, edit):
    from safetensors.torch import load_file, save_file

    save_file(edit(load_file(d / "model.safetensors")), d / "model.safetensors", metadata={"format": "pt"})


def without_the_norm(d):
    edit_weights(d, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})


def norm_of_129(d):
    import torch

    edit_weights(d, lambda t: {**t, "model.norm.weight": torch.ones(129)})


def int8_with_scales(d):
    """Each linear weight as int8 codes and a per-row scale, as int8 quantizers store them."""
    import torch

    def quantize(tensors):
        out = {}
        for name, t in tensors.items():
            if name.endswith("proj.weight"):
                scale = t.abs().amax(dim=1, keepdim=True) / 127
                out[name], out[name.replace(".weight", ".weight_scale")] = (t / scale).round().to(torch.int8), scale
            else:
                out[name] = t
        return out
    edit_weights(d, quantize)


def int8_with_scales_and_quantization_config(d):
    int8_with_scales(d)
    edit_json(d / "config.json", quantization_config={"quant_method": "compressed-tensors", "format": "int-quantized"})


def fp8_weight(d):
    import torch

    edit_weights(d, lambda t: {**t, "lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)})


WRONG_WEIGHTS = {  # what a reader of model.path must refuse, after the file it names
    without_the_norm: r"model\.safetensors: tensor 'model\.norm\.weight' of the model is in none of the files",
    norm_of_129: r"model\.safetensors: tensor 'model\.norm\.weight' has shape \[129\], the model's is \[128\]",
    int8_with_scales: r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' is I8, which raysft "
                      "does not convert into the model's F32 parameters",
    int8_with_scales_and_quantization_config: r"config\.json: quantization_config says the weights are quantized "
                                              r"\(compressed-tensors\)",
    fp8_weight: r"model\.safetensors: tensor 'lm_head\.weight' is F8_E4M3, which raysft does not convert",
}


@pytest.mark.parametrize("fault", WRONG_WEIGHTS, ids=lambda f: f.__name__)
def test_weights_that_lack_a_tensor_or_hold_another_shape_or_quantized_values_are_refused_before_the_data_is_read(
        tmp_path, model_dir, fault):
    """Trained and exported with exit 0 before (a missing tensor random, int8 codes read as weights): refused on the
    driver, from the headers, naming the file and the tensor; by chat, and as the base of a merged LoRA export."""
    from raysft.errors import WeightsFileError
    from raysft.launch.prelaunch import prepare_launch
    from raysft.products.adapters import _base_weights

    d = broken_copy(model_dir, tmp_path, fault)
    cfg = tiny_config(tmp_path, **{"model.path": str(d), "model.tokenizer": ""})
    with pytest.raises(ConfigError, match=f"config key 'model.path': {d}/{WRONG_WEIGHTS[fault]}"):
        prepare_launch(cfg)
    assert not cfg.store_dir.exists() and not cfg.run_dir.exists()
    chat = cli_in_process("chat", str(d), "--prompt", "hi")
    assert chat.returncode == 1 and "Traceback" not in chat.stderr
    assert re.match(f"raysft: error: (WeightsFileError|ModelDirError): {d}/{WRONG_WEIGHTS[fault]}", chat.stderr)
    with pytest.raises((WeightsFileError, ModelDirError), match=f"{d}/{WRONG_WEIGHTS[fault]}"):
        _base_weights({"path": str(d), "seed": 1}, d)  # a LoRA run's base, as export --merge reads it


def initial_weights(ctx, path: str) -> str:
    """On every rank: the model built as the trainer builds it (unsharded here) and its initial weights from path."""
    import torch
    from transformers import AutoConfig

    from raysft.errors import WeightsFileError
    from raysft.model.build import build_meta_model, load_initial_weights, materialize

    model = build_meta_model(AutoConfig.from_pretrained(path), "sdpa")
    materialize(model, torch.device("cpu"))
    try:
        load_initial_weights(model, ModelConfig(path=path), model.config, seed=1)
    except WeightsFileError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("fault", [without_the_norm, int8_with_scales, fp8_weight], ids=lambda f: f.__name__)
def test_the_per_rank_read_refuses_such_weights_on_every_rank(tmp_path, model_dir, fault, gloo_pool):
    """The files may change after the driver checked them: the workers' read checks them again (rank 0 reads the
    headers, every rank raises), instead of rank 0's from_pretrained filling a missing tensor with random values or
    a copy turning int8 codes into floats."""
    d = broken_copy(model_dir, tmp_path, fault)
    outcomes = gloo_pool.run(initial_weights, str(d))
    assert all(re.match(f"{d}/{WRONG_WEIGHTS[fault]}", o) for o in outcomes), outcomes
    assert gloo_pool.run(initial_weights, str(model_dir)) == ["loaded", "loaded"]
