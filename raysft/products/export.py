"""Turning a checkpoint (full or sharded) into a Hugging Face model directory for AutoModelForCausalLM.

Weights are streamed: tensors are read one safetensors shard at a time (at most `max_shard_bytes` in memory), from
the full checkpoint's model files or from the DCP shards of a sharded one, so exporting never needs the
whole model in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Literal

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raysft.checkpoint import (
    TRAINING_FILES,
    CheckpointError,
    incomplete_reason,
    local_copy,
    read_index,
    read_trainer_state,
)
from raysft.checkpoint.dcp_read import SafeLoadPlanner, dcp_reader
from raysft.checkpoint.sharded import model_tensors
from raysft.checkpoint.trainable import check_saved_tensors
from raysft.config import Precision
from raysft.data.labels import stop_token_ids
from raysft.hf import shards as hf_shards
from raysft.hf.dtypes import CONVERTED, DTYPES, stored_bytes
from raysft.hf.tensors import Stored, safetensors_tensors
from raysft.model.build import build_meta_model
from raysft.model.lora import add_adapters
from raysft.products.adapters import lora_config, merged_weights, write_adapter
from raysft.products.directories import EXPORT_FILE, is_export, run_or_checkpoint_in
from raysft.storage import Location, built_then_renamed, location, native

DEFAULT_SHARD_BYTES = hf_shards.SHARD_BYTES  # transformers' own default for save_pretrained


def export(checkpoint_dir: str | os.PathLike | Location, out_dir: str | os.PathLike,
           overwrite: bool | Literal["export"] = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           dtype: Precision = "fp32", merge: bool = False) -> Path:
    """Write config, tokenizer, generation config and weights (safetensors, sharded with an index above
    max_shard_bytes), the weights in `dtype` (training keeps fp32 parameters; bf16 halves the export).

    generation_config.json stops generation at the end-of-turn token(s) of the training chat template
    (`<|im_end|>`, `<|eot_id|>`, ...) as well as at EOS, so `generate` ends where an answer ends.

    checkpoint_dir may be on remote storage (s3://..., gs://...): a sharded checkpoint's weights are read from
    there piece by piece (not its optimizer state), a full one's model files are downloaded to a temporary
    directory first.
    A LoRA checkpoint (raysft.products.adapters) exports as a peft adapter directory, or with `merge` as a full model
    with the adapters merged into the base.
    The directory appears complete or not at all (written beside it, then renamed). An existing non-empty
    directory is replaced only with overwrite=True (`--force`), or with overwrite="export" when it is an earlier
    raysft export (it holds raysft_export.json); never when it holds a run or a checkpoint, or this checkpoint.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"the largest shard must be at least 1 MB, got {max_shard_bytes} bytes")
    ckpt, out = location(checkpoint_dir), Path(out_dir).expanduser().resolve()
    state = read_trainer_state(ckpt)  # a raysft checkpoint of a format we know, or a clear error
    mode, lora = state["mode"], state.get("lora")
    if merge and not lora:
        raise ValueError(f"{native(ckpt)}: --merge applies to LoRA checkpoints; this one holds the whole model")
    reason = incomplete_reason(ckpt)
    if reason:
        raise CheckpointError(f"{native(ckpt)}: incomplete checkpoint: {reason}")
    check_export_target(out, overwrite, ckpt)
    with built_then_renamed(out) as tmp:  # an existing `out` was checked above: an earlier export
        for name in ckpt.files():  # config, generation config, tokenizer: whatever is not weights or training state
            if ("/" not in name and name not in TRAINING_FILES and not hf_shards.is_tensor_or_index_file(name)
                    and not hf_shards.is_dcp_file(name)):
                (ckpt / name).download(tmp / name)
        with local_copy(ckpt, _is_model_file) if mode == "full" else contextlib.nullcontext() as local:
            weights = _FullWeights(local) if mode == "full" else _ShardedWeights(ckpt)
            check_checkpoint_tensors(weights.stored, tmp, lora, weights.where)
            if lora and not merge:
                write_adapter(weights, lora, tmp, DTYPES[dtype])
            else:
                weights = merged_weights(weights, lora, tmp) if lora else weights
                _write_shards(weights, tmp, max_shard_bytes, DTYPES[dtype])
        _set_config_dtype(tmp, DTYPES[dtype])
        write_generation_config(tmp)
        lora_note = {"lora": {**lora, "export": "merged" if merge else "adapter"}} if lora else {}
        (tmp / EXPORT_FILE).write_text(json.dumps({"checkpoint": str(ckpt), "step": state["step"], "mode": mode,
                                                   **lora_note}, indent=1))
    return out


def check_export_target(out_dir: str | os.PathLike, overwrite: bool | Literal["export"] = False,
                        ckpt: Location | None = None) -> None:
    """Refuse, before anything is written, to replace a directory that is not ours to delete.

    Empty or absent: fine. Otherwise only with overwrite=True, or overwrite="export" when it holds an earlier
    export; and never, whatever overwrite says, the checkpoint being exported (or, before training, the run
    directory), a directory holding it, or one holding a run or a checkpoint (a mistyped `--force` must not
    delete a run's checkpoints).
    """
    out = Path(out_dir).expanduser().resolve()
    if ckpt is not None and ckpt.local is not None and (out == ckpt.local or out in ckpt.local.parents):
        raise FileExistsError(f"{out} holds the checkpoint being exported ({ckpt.local}): export somewhere else")
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    held = run_or_checkpoint_in(out)
    if held is not None:
        what, where = held
        raise FileExistsError(f"{out} holds a raysft {what} ({where}): raysft never replaces it, even with --force")
    if overwrite is True or (overwrite == "export" and is_export(out)):
        return
    raise FileExistsError(f"{out} exists and is not empty{'' if is_export(out) else ' and is no raysft export'} "
                          "(pass overwrite=True / --force to replace it)")


def _is_model_file(name: str) -> bool:
    return hf_shards.is_tensor_or_index_file(name) and name.startswith("model")


def check_checkpoint_tensors(stored: dict[str, Stored], config_dir: Path, lora: dict | None, where: str) -> None:
    """CheckpointError, naming the file and the tensor, unless the checkpoint's model tensors are exactly those of
    the model its config.json describes (built on the meta device), each of its shape and a dtype read correctly
    (raysft.hf.tensors); a LoRA checkpoint's, those of its adapters. `where` names the checkpoint's model files."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir, local_files_only=True, trust_remote_code=False)
    model = build_meta_model(config, "eager")
    check_saved_tensors(add_adapters(model, lora_config(lora)) if lora else model, stored, where)


def full_checkpoint_tensors(ckpt: Path) -> tuple[dict[str, Stored], str]:
    """The model tensors of a full checkpoint's files as their headers describe them, and the file that names them
    all (the index, or the one file)."""
    files = hf_shards.tensor_map(ckpt, "model")
    return safetensors_tensors(dict.fromkeys(files.values())), str(hf_shards.naming_file(ckpt, "model"))


class _FullWeights:
    """Tensors of a full checkpoint's model files (one, or several and their index), read lazily."""

    def __init__(self, ckpt: Path):
        self.stored, self.where = full_checkpoint_tensors(ckpt)
        self.files = hf_shards.tensor_map(ckpt, "model")
        self.sizes, self.floating = {}, {}
        for path in dict.fromkeys(self.files.values()):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    piece = f.get_slice(name)
                    self.sizes[name] = stored_bytes(piece.get_dtype(), piece.get_shape())
                    self.floating[name] = piece.get_dtype() in CONVERTED

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        tensors = {}
        for name in names:
            with safe_open(self.files[name], framework="pt") as f:
                tensors[name] = f.get_tensor(name)
        return tensors


class _ShardedWeights:
    """Model tensors of a DCP checkpoint, each assembled from the shards of every rank that wrote a piece."""

    def __init__(self, ckpt: Location):
        self.ckpt = ckpt
        metadata = read_index(native(ckpt))
        self.meta = {key.removeprefix("model."): m for key, m in metadata.state_dict_metadata.items()
                     if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        self.sizes = {name: m.size.numel() * m.properties.dtype.itemsize for name, m in self.meta.items()}
        self.floating = {name: m.properties.dtype.is_floating_point for name, m in self.meta.items()}
        self.where = f"{ckpt}/{hf_shards.DCP_INDEX}"
        self.stored = model_tensors(metadata, ckpt)

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        tensors = {n: torch.empty(self.meta[n].size, dtype=self.meta[n].properties.dtype) for n in names}
        dcp.load({"model": tensors}, storage_reader=dcp_reader(self.ckpt), planner=SafeLoadPlanner(), no_dist=True)
        return tensors


def _write_shards(weights: _FullWeights | _ShardedWeights, out: Path, max_shard_bytes: int,
                  dtype: torch.dtype = torch.float32) -> None:
    """Group tensors into shards of at most max_shard_bytes (a bigger tensor gets its own), read and write one shard
    at a time (floating-point tensors cast to dtype), and name and index them the way save_pretrained does."""
    sizes = {name: nbytes * dtype.itemsize // 4 if weights.floating[name] else nbytes
             for name, nbytes in weights.sizes.items()}  # training's floating-point tensors are fp32
    groups = hf_shards.group(sizes, max_shard_bytes)
    if not groups[0]:
        raise CheckpointError("the checkpoint holds no model weights")
    names = hf_shards.file_names("model", len(groups))
    for group, file_name in zip(groups, names, strict=True):
        tensors = weights.load(group)
        save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
                  out / file_name, metadata={"format": "pt"})
        del tensors
    hf_shards.write_index(out, "model", groups, names, sum(sizes.values()))


def _set_config_dtype(out: Path, dtype: torch.dtype) -> None:
    """config.json says what the weights are, so from_pretrained loads them as they are by default."""
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def write_generation_config(out: Path) -> None:
    """generation_config.json with the chat template's stop tokens as eos_token_id (kept from an existing one)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True, trust_remote_code=False)
    existing = GenerationConfig.from_pretrained(out) if (out / "generation_config.json").is_file() else None
    config = existing or GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    before = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = list(dict.fromkeys([*(i for i in before if i is not None), *stop_token_ids(tokenizer)]))
    config.eos_token_id = stops[0] if len(stops) == 1 else stops
    config.save_pretrained(out)

