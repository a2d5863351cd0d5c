"""Building LLaMA-style causal LMs with transformers: on the meta device for sharding, then each rank's shards.

Every rank builds the model with parameters on the meta device (no memory), shards it and then materializes only
its own shards. Pretrained weights are read by every rank from the safetensors files, each its own slices
(raysft.hf.weights); a from-scratch model is initialized on every rank module by module, each rank keeping its
slices (raysft.model.seeded_init): no rank holds the whole model. Tied weights (`tie_word_embeddings`: the LM head
is the embedding) are one parameter under two names, on the meta device, after sharding (FSDP2's root keeps both
modules) and after materializing, so each rank reads that parameter's slices once, under whichever of its names
the files hold, and the tie holds by construction. Only pretrained weights whose parameter names are not the
files' (a conversion mapping, a checkpoint with other names) take the other way: rank 0 builds a real copy whose
full state dict is broadcast shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerBase
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

import raysft.model.attention  # noqa: F401  (registers the "varlen" attention implementation with transformers)
from raysft.config import ConfigError, ModelConfig
from raysft.distributed.collectives import all_ranks, from_rank0
from raysft.errors import WeightsFileError
from raysft.hf.files import ModelDirError, check_config_file, check_model_dir, weight_files
from raysft.hf.shards import MODEL_INDEX
from raysft.hf.tensors import check_dtypes, check_tensors, safetensors_tensors, split_aliases
from raysft.hf.weights import read_local_slices, tensor_files
from raysft.model.lora import add_adapters, init_adapter, init_adapters, is_adapter
from raysft.model.seeded_init import clean_name, init_parameters

PRESETS: dict[str, dict] = {
    # small enough to learn the demo conversations in a few hundred CPU steps.
    "demo-tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024),
    # Architecture of Llama-3.2-1B, for throughput benchmarks.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
}


def load_model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The architecture to train: the pretrained directory's, a preset's, or a config file's. A ConfigError naming
    the key when it cannot be used: the same error would meet every worker on every restart. The directory's
    files are checked first (raysft.hf.files): a damaged or crafted one is refused here, on the driver."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"config key 'model.path': {cfg.path!r} is not a Hugging Face model directory (it "
                              "needs config.json and the weights; nothing is downloaded)")
        _check("model.path", check_model_dir, path)
        config = read_config_file("model.path", path)
    elif cfg.config in PRESETS:
        config = preset_config(cfg.config, tokenizer)
    else:
        config = read_config_file("model.config", Path(cfg.config).expanduser())
    if config.vocab_size < len(tokenizer):
        raise ConfigError(f"config key 'model.tokenizer': the tokenizer has {len(tokenizer)} tokens but the model's "
                          f"vocab_size is {config.vocab_size}: token ids would index past the embedding (a tokenizer "
                          "of another model?)")
    return config


def preset_config(name: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A preset's architecture, with the tokenizer's vocabulary and special tokens."""
    return LlamaConfig(**PRESETS[name], vocab_size=len(tokenizer), tie_word_embeddings=False,
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id)


def read_config_file(key: str, path: Path) -> PretrainedConfig:
    """The architecture in a config.json, or in a model directory's (only that file is read), checked to ask for
    no code and read without running any. A ConfigError naming `key` when it is neither."""
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        presets = f"a preset ({', '.join(PRESETS)}) nor " if key == "model.config" else ""
        raise ConfigError(f"{_named(key)}: {str(path)!r} is neither {presets}a config.json nor a directory holding one")
    _check(key, check_config_file, file)
    return AutoConfig.from_pretrained(file if path.is_file() else path, local_files_only=True,
                                      trust_remote_code=False)


def _named(key: str) -> str:
    """How an error names where a value came from: a config key, or a command-line option (`--model`)."""
    return key if key.startswith("--") else f"config key '{key}'"


def _check(key: str, check: Callable[[Path], None], path: Path) -> None:
    try:
        check(path)
    except ModelDirError as e:
        raise ConfigError(f"{_named(key)}: {e}") from None


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device but buffers for real (like accelerate's init_empty_weights with
    include_buffers=False): RoPE tables are non-persistent buffers that no state dict restores."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # one already on meta is kept: tying shares it
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_meta_model(config: PretrainedConfig, attn_implementation: str) -> nn.Module:
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                dtype=torch.float32)


def build_full_model(cfg: ModelConfig, config: PretrainedConfig, seed: int) -> nn.Module:
    """A real fp32 copy on CPU, without adapters: the pretrained weights, or the seeded initialization, which is
    that of the sharded model on any topology (`init_from_seed` with one rank)."""
    if cfg.path:
        return AutoModelForCausalLM.from_pretrained(cfg.path, config=config, local_files_only=True,
                                                    trust_remote_code=False, dtype=torch.float32,
                                                    attn_implementation=cfg.attn_implementation)
    model = build_meta_model(config, cfg.attn_implementation)
    materialize(model, torch.device("cpu"))
    model.tie_weights()  # to_empty gave each alias of a tied weight its own tensor
    init_from_seed(model, seed)
    return model


def init_from_seed(model: nn.Module, seed: int) -> None:
    """Not collective: the seeded initialization of every parameter (full, or this rank's shards), module by
    module (raysft.model.seeded_init). The model's own `_init_weights` initializes its modules, peft's rule the LoRA
    adapters (raysft.model.lora.init_adapter). Modules are named without wrappers, and an adapted layer's base weight as
    the layer itself, so a base weight has the same value with LoRA or without it."""
    def init_module(name: str, module: nn.Module) -> None:
        if is_adapter(f"{name}."):
            init_adapter(name, module)
        else:
            model._init_weights(module)

    init_parameters(model, seed, init_module, name_of=lambda path: clean_name(path).replace(".base_layer", ""))


def tied_parameter_aliases(model: nn.Module) -> dict[str, str]:
    """{alias: canonical name} for parameters shared under two names (e.g. lm_head tied to the embedding).
    safetensors refuses to store shared tensors twice, so aliases are dropped on save and restored on load."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) meta parameters on `device`, keeping the buffers computed at construction."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def decoder_layer_classes(model: nn.Module) -> tuple[type, ...]:
    """The repeated block class(es) to shard one by one, as the model itself declares them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not classes:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder layers")
    return classes


def load_initial_weights(model: nn.Module, cfg: ModelConfig, config: PretrainedConfig, seed: int) -> str | None:
    """Fill this rank's shards with the initial weights. From scratch: each rank initializes its own shards
    (`init_from_seed`), no collective. Pretrained (collective): read per rank from the safetensors files, or, when
    they cannot be read that way, built by rank 0 and broadcast. Returns why pretrained weights took rank 0's way
    (None when they did not)."""
    if not cfg.path:
        init_from_seed(model, seed)
        return None
    refused = from_rank0(lambda: _refusal(check_pretrained, model, Path(cfg.path).expanduser()))
    if refused:  # the same error on every rank, not a rank waiting in a collective for one that failed
        raise WeightsFileError(refused)
    problem = slice_read_problem(model, Path(cfg.path).expanduser())
    if all_ranks(problem is None):
        read_pretrained_slices(model, cfg, seed)
        return None
    broadcast_from_rank0(model, cfg, config, seed)
    return problem or "another worker cannot read model.path's files"


def broadcast_from_rank0(model: nn.Module, cfg: ModelConfig, config: PretrainedConfig, seed: int) -> None:
    """Collective: rank 0 builds the full model on CPU (LoRA's adapters seeded with it) and broadcasts it; every
    rank keeps only its shards."""
    full_sd = add_adapters(build_full_model(cfg, config, seed), cfg.lora, seed).state_dict() \
        if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def file_name(name: str) -> str:
    """The name a parameter of the (sharded, LoRA-adapted) model has in a Hugging Face model directory."""
    return clean_name(name).replace(".base_layer.", ".")


def _base_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's pretrained tensors (all but LoRA's adapters) by their names in the files, persistent buffers
    included: what from_pretrained fills. A tied parameter appears under each of its names."""
    return {file_name(n): t for n, t in model.state_dict(keep_vars=True).items() if not is_adapter(n)}


def pretrained_targets(model: nn.Module, in_files: Collection[str]) -> dict[str, torch.Tensor]:
    """The tensors to read from the files, each once: a tied parameter under its first name (the embedding, which
    from_pretrained ties the head to) or, if the files lack that name, under another of its names they hold."""
    names_of: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in _base_tensors(model).items():
        names_of.setdefault(id(tensor), (tensor, []))[1].append(name)
    return {next((n for n in names if n in in_files), names[0]): tensor for tensor, names in names_of.values()}


def model_read_problem(model: nn.Module) -> str | None:
    """Why no files could give the model its pretrained weights name by name (None if files with its names can):
    known from the model alone, without its files."""
    if renames_on_load(model):
        return f"{type(model).__name__} renames the files' tensors on load (a checkpoint conversion mapping)"
    return None


def check_pretrained(model: nn.Module, path: Path) -> None:
    """WeightsFileError (or ModelDirError), naming the file and the tensor, unless `path`'s safetensors files hold
    every pretrained tensor of `model` (sharded, on the meta device or real: only names, shapes and dtypes count)
    with its shape and a dtype the read converts correctly (raysft.hf.tensors). Headers only. Of a model whose
    files transformers renames on load (a conversion mapping: not the LLaMA family's) only the dtypes are checked:
    its names in the files are not its parameters' names."""
    files = weight_files(path)
    stored = safetensors_tensors(files)
    if renames_on_load(model):
        check_dtypes(stored, WeightsFileError)
        return
    expected, aliases = split_aliases(_base_tensors(model))
    index = path / MODEL_INDEX
    where = index if index.is_file() else ", ".join(str(f) for f in files) or f"{path} (no safetensors files)"
    check_tensors(expected, stored, str(where), WeightsFileError, aliases)


def check_pretrained_dir(path: Path, config_dir: Path | None = None) -> None:
    """check_pretrained for a model directory read on its own (chat, a LoRA export's base): against the model that
    its config.json (or config_dir's) describes, built on the meta device."""
    config = AutoConfig.from_pretrained(config_dir or path, local_files_only=True, trust_remote_code=False)
    check_pretrained(build_meta_model(config, "eager"), path)


def renames_on_load(model: nn.Module) -> bool:
    """Whether transformers maps the files' tensor names to other ones when it loads this model."""

    return bool(getattr(model, "_checkpoint_conversion_mapping", None)
                or get_checkpoint_conversion_mapping(getattr(model.config, "model_type", "")))


def _refusal(check: Callable[..., None], *args) -> str | None:
    """The message of check(*args)'s refusal (None if it passes): for from_rank0, which must not raise."""
    try:
        check(*args)
    except (WeightsFileError, ModelDirError, OSError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors for a file that changed since the driver's check
        return f"{type(e).__name__}: {e}"
    return None


def slice_read_problem(model: nn.Module, path: Path) -> str | None:
    """Why the model's pretrained weights cannot be read from `path`'s files name by name (None if they can)."""
    problem = model_read_problem(model)
    if problem:
        return problem
    try:
        files = tensor_files(weight_files(path))
    except (OSError, ModelDirError) as e:
        return f"cannot read the safetensors files of {path}: {e}"
    if not files:
        return f"{path} has no safetensors files"
    missing = sorted(set(pretrained_targets(model, files)) - set(files))
    if missing:
        return (f"{len(missing)} of the model's tensors are not in the files under their names (e.g. {missing[0]!r}): "
                "the checkpoint uses other names")
    return None


def read_pretrained_slices(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Every rank: its slices of the pretrained weights from the files; LoRA's adapters their seeded slices
    (raysft.model.seeded_init: the values add_adapters gives a full model from the same seed)."""
    files = tensor_files(weight_files(Path(cfg.path).expanduser()))
    read_local_slices(pretrained_targets(model, files), files)
    if cfg.lora.r:
        init_adapters(model, seed)
