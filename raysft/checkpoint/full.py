"""The full layout: rank 0 gathers everything to its CPU and writes plain files, so the checkpoint directory is a
Hugging Face model directory that transformers loads as it is:

    config.json, model.safetensors, tokenizer files      the model
    optimizer.safetensors, optimizer.json                AdamW state by parameter name, and the param groups

Loading: rank 0 reads the files (downloaded first from remote storage, each checked against the manifest on the
way) and broadcasts; the other ranks receive only their shards. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from raysft.checkpoint.background import background, run_now
from raysft.checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, read_manifest
from raysft.checkpoint.state import CheckpointError, TrainingObjects, read_safetensors
from raysft.storage import Location, location

OPTIMIZER_META_FILE = "optimizer.json"
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def save(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    """Collective (the gather); rank 0 writes."""
    model_sd = get_model_state_dict(objs.model, options=_GATHER)
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=_GATHER)
    if dist.get_rank() != 0:
        return run_now(lambda: None)
    for alias in objs.aliases:
        model_sd.pop(alias, None)
    model = {k: v.contiguous() for k, v in model_sd.items()}
    tensors, scalars = {}, {}
    for fqn, param_state in optim_sd["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}/{key}"] = value.contiguous()
            else:
                scalars[f"{fqn}/{key}"] = value
    optimizer_json = json.dumps({"param_groups": optim_sd["param_groups"], "scalars": scalars})

    def write() -> None:
        save_file(model, out_dir / MODEL_FILE, metadata={"format": "pt"})
        save_file(tensors, out_dir / OPTIMIZER_FILE)
        (out_dir / OPTIMIZER_META_FILE).write_text(optimizer_json)

    if not asynchronous:
        return run_now(write)
    # a gathered tensor may share memory with a live one (a mesh of one shard): copy before training goes on
    model = {k: v.clone() for k, v in model.items()}
    tensors = {k: v.clone() for k, v in tensors.items()}
    return background().submit(write)


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    """Collective: rank 0 reads, every rank receives its shards."""
    model_sd: dict = {}
    optim_sd: dict = {}
    if dist.get_rank() == 0:
        with local_copy(ckpt_dir, (MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_META_FILE)) as local:
            model_sd = read_safetensors(local / MODEL_FILE)
            for alias, canonical in objs.aliases.items():
                model_sd[alias] = model_sd[canonical]
            optim_sd = _read_optimizer(local)
    set_model_state_dict(objs.model, model_sd, options=_BROADCAST)
    set_optimizer_state_dict(objs.model, objs.optimizer, optim_sd, options=_BROADCAST)


@contextlib.contextmanager
def local_copy(ckpt_dir: Path | Location, names: tuple[str, ...]) -> Iterator[Path]:
    """The checkpoint's directory if it is local; else a temporary download of `names`, each checked against its
    sha256 in the manifest as it arrives, removed afterwards."""
    ckpt = location(ckpt_dir)
    if ckpt.local is not None:
        yield ckpt.local
        return
    files = read_manifest(ckpt)
    with tempfile.TemporaryDirectory(prefix="raysft-full-ckpt-") as tmp:
        for name in names:
            if (ckpt / name).download(Path(tmp) / name) != files[name]["sha256"]:
                raise CheckpointError(f"{ckpt / name} does not match its sha256 in the manifest")
        yield Path(tmp)


def _read_optimizer(ckpt_dir: Path) -> dict:
    meta = json.loads((ckpt_dir / OPTIMIZER_META_FILE).read_text())
    state: dict[str, dict] = {}
    for key, value in [*read_safetensors(ckpt_dir / OPTIMIZER_FILE).items(), *meta["scalars"].items()]:
        fqn, _, name = key.rpartition("/")
        state.setdefault(fqn, {})[name] = value
    for group in meta["param_groups"]:
        group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": meta["param_groups"]}
