"""Exporting a LoRA checkpoint, and loading what that writes.

A LoRA checkpoint holds only the adapters; its trainer_state.json says where the frozen base comes from
(raysft.model.lora.record). Two exports:

adapter  a peft adapter directory: adapter_config.json + adapter_model.safetensors (peft's names), which
         `PeftModel.from_pretrained(base, dir)` loads on top of the base; config, tokenizer and
         raysft_export.json (the base's seed, for a base trained from scratch) come along, so `raysft chat` loads it.
merged   a full Hugging Face model: each base weight W of an adapted layer becomes W + (alpha / r) · B·A. Streamed
         like any export, one output shard at a time, reading the base from `model.path`'s safetensors; a base
         trained from scratch is rebuilt from its seed in memory (those are the small models).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from raysft.checkpoint import CheckpointError
from raysft.config import LoraConfig, ModelConfig
from raysft.hf.dtypes import CONVERTED, stored_bytes
from raysft.hf.files import check_config_file, check_model_dir, weight_files
from raysft.hf.fingerprint import changed_files, weights_fingerprint
from raysft.hf.shards import MODEL_FILE
from raysft.hf.weights import tensor_files
from raysft.model.build import build_full_model, check_pretrained_dir, tied_parameter_aliases
from raysft.model.lora import ADAPTER, peft_config
from raysft.model.seeded_init import INIT_SCHEME
from raysft.products.directories import ADAPTER_CONFIG, CONFIG_FILE, EXPORT_FILE, is_export

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's names: the PeftModel's, of which the causal LM is base_model.model


def lora_config(lora: dict) -> LoraConfig:
    return LoraConfig(r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"],
                      target_modules=list(lora["target_modules"]))


def write_adapter(adapters, lora: dict, out: Path, dtype: torch.dtype) -> None:
    """`adapters`: a checkpoint's weight source (raysft.products.export) holding the adapters only."""
    tensors = adapters.load(list(adapters.sizes))
    peft_names = {PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): t.to(dtype).contiguous()
                  for name, t in tensors.items()}
    save_file(peft_names, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    peft_config(lora_config(lora), lora["base"]["path"] or None).save_pretrained(str(out))


def merged_weights(adapters, lora: dict, out: Path):
    """A weight source of the merged model: the base's tensors, the adapted ones with B·A added as they are read.
    `out` holds the checkpoint's config.json (a from-scratch base is rebuilt from it)."""
    base = _base_weights(lora["base"], out)
    tensors = adapters.load(list(adapters.sizes))
    return _Merged(base, tensors, lora["alpha"] / lora["r"])


class _Merged:
    def __init__(self, base, adapters: dict[str, torch.Tensor], scale: float):
        self.base, self.scale = base, scale
        self.sizes, self.floating = base.sizes, base.floating
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # base weight name: (A, B)
        for name, a in adapters.items():
            if f".lora_A.{ADAPTER}." in name:
                layer = name.split(f".lora_A.{ADAPTER}.")[0]
                self.pairs[f"{layer}.weight"] = (a, adapters[f"{layer}.lora_B.{ADAPTER}.weight"])
        unknown = sorted(set(self.pairs) - set(self.sizes))
        if unknown:
            raise CheckpointError(f"the base has no weight {unknown[0]} to merge the adapters into (another base?)")

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        tensors = self.base.load(names)
        for name in names:
            if name in self.pairs:
                a, b = self.pairs[name]
                tensors[name] = tensors[name].float() + (b.float() @ a.float()) * self.scale  # peft's merge
        return tensors


class _SafetensorsDir:
    """The weights of a Hugging Face model directory, one file or sharded with an index, read lazily: the files
    training read the base from (raysft.hf.files.weight_files), each tensor where their headers put it."""

    def __init__(self, path: Path):
        check_model_dir(path)  # the base may have changed since training checked it
        files = tensor_files(weight_files(path))
        if not files:
            raise FileNotFoundError(f"{path}: no {MODEL_FILE} (or index) to merge the adapters into")
        self.files, self.sizes, self.floating = files, {}, {}
        for file in set(files.values()):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    piece = f.get_slice(name)
                    self.floating[name] = piece.get_dtype() in CONVERTED
                    # what the export counts in: fp32 (a bf16 base is upcast)
                    self.sizes[name] = stored_bytes("F32", piece.get_shape())

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for file in {self.files[n] for n in names}:
            with safe_open(file, framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in names if self.files[n] == file})
        return {n: out[n].float() if out[n].is_floating_point() else out[n] for n in names}


class _InMemory:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.sizes = {n: stored_bytes("F32", t.shape) for n, t in tensors.items()}  # in fp32, as the export counts
        self.floating = {n: t.is_floating_point() for n, t in tensors.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n] for n in names}


def _base_weights(base: dict, config_dir: Path):
    if base["path"]:
        check_base_weights(base)
        weights = _SafetensorsDir(Path(base["path"]).expanduser())
        check_pretrained_dir(Path(base["path"]).expanduser(), config_dir)  # every tensor, as the adapters' model's
        return weights
    model = scratch_base(config_dir, base)
    aliases = tied_parameter_aliases(model)
    return _InMemory({k: v for k, v in model.state_dict().items() if k not in aliases})


def check_base_weights(base: dict) -> None:
    """CheckpointError, naming the files that changed, unless the weights at the base's path are those the adapters
    were trained on (the fingerprint its record holds; a checkpoint of a raysft that recorded none is not checked):
    adapters merged into, or loaded on, another base of the same shapes would be silently wrong."""
    recorded = base.get("weights")
    if not recorded:
        return
    now = weights_fingerprint(Path(base["path"]).expanduser())
    if now != recorded:
        raise CheckpointError(f"{base['path']}: the base weights are not those the adapters were trained on: "
                              f"{', '.join(changed_files(recorded, now))} (by size, header and sampled bytes); put "
                              "the run's base back at that path to export or chat with these adapters")


def scratch_base(config_dir: Path, base: dict) -> nn.Module:
    """The base of a run trained from scratch: the seeded initialization of the config in config_dir, the same
    as every launch of the run built (raysft.model.build.build_full_model). `base` is the checkpoint's record of it
    (raysft.model.lora.record): one initialized under another scheme (or before schemes were recorded) would be other
    weights than those the adapters were trained on, so it is refused."""
    from transformers import AutoConfig

    check_config_file(config_dir / CONFIG_FILE)
    if base.get("init") != INIT_SCHEME:
        raise CheckpointError(f"{config_dir}: its from-scratch base was initialized by scheme {base.get('init')!r}, "
                              f"this raysft initializes by {INIT_SCHEME!r}: the base would not be the one the "
                              "adapters were trained on; export it with the raysft version that trained it")
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True, trust_remote_code=False)
    return build_full_model(ModelConfig(path=""), config, base["seed"])


def load_adapter_dir(path: Path) -> nn.Module:
    """An adapter export on top of its base: `model.path`'s model, or the seeded from-scratch one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if base_path:
        check_model_dir(Path(base_path))
        if is_export(path):  # an adapter export of raysft: its base recorded
            check_base_weights(json.loads((path / EXPORT_FILE).read_text())["lora"]["base"])
        check_pretrained_dir(Path(base_path))
        base = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True, trust_remote_code=False,
                                                    dtype=torch.float32)
    else:
        if not is_export(path):
            raise FileNotFoundError(f"{path}: an adapter directory without base_model_name_or_path in "
                                    f"{ADAPTER_CONFIG} and without {EXPORT_FILE}: its base is unknown")
        base = scratch_base(path, json.loads((path / EXPORT_FILE).read_text())["lora"]["base"])
    return PeftModel.from_pretrained(base, str(path))
