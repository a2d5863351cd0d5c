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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from raysft.checkpoint.background import background, run_now
from raysft.checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, HashingWriter, read_manifest
from raysft.checkpoint.state import CheckpointError, TrainingObjects, read_safetensors
from raysft.checkpoint.trainable import check_adapter_names, state_dict_options
from raysft.collectives import from_rank0
from raysft.storage import Location, location

OPTIMIZER_META_FILE = "optimizer.json"
_GATHER = dict(full_state_dict=True, cpu_offload=True)  # StateDictOptions, made by state_dict_options(model)
_BROADCAST = dict(full_state_dict=True, broadcast_from_rank0=True)


def save(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    """Collective (the gather); rank 0 writes."""
    options = state_dict_options(objs.model, **_GATHER)  # LoRA: the adapters only
    model_sd = get_model_state_dict(objs.model, options=options)
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=options)
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

    def write() -> dict[str, str]:
        hashes = {MODEL_FILE: write_safetensors(out_dir / MODEL_FILE, model, metadata={"format": "pt"}),
                  OPTIMIZER_FILE: write_safetensors(out_dir / OPTIMIZER_FILE, tensors)}
        (out_dir / OPTIMIZER_META_FILE).write_text(optimizer_json)
        return hashes

    if not asynchronous:
        return run_now(write)
    # a gathered tensor shares memory with the live one where nothing was sharded (one rank, NO_SHARD on CPU):
    # copy those, and only those, before training goes on
    live = {t.untyped_storage().data_ptr() for t in _local_tensors(objs)}
    model = {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in model.items()}
    tensors = {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in tensors.items()}
    return background().submit(write)


def _local_tensors(objs: TrainingObjects) -> list[torch.Tensor]:
    """This rank's own storage of the parameters and the optimizer state."""
    found = [*objs.model.parameters(), *(v for s in objs.optimizer.state.values() for v in s.values())]
    return [getattr(t, "_local_tensor", t) for t in found if isinstance(t, torch.Tensor)]


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file straight from the tensors' memory, hashing it on the way; returns its sha256.
    safetensors' own save_file first copies every tensor into one bytes object: a second copy of the whole state
    on rank 0, and a second pass over it. The file is read back with safetensors (load_file) as ever."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the format asks
    with path.open("wb") as f:
        out = HashingWriter(f)
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for t in tensors.values():
            if t.numel():
                out.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
        return out.hexdigest()


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    """Collective: rank 0 reads, every rank receives its shards. A read that fails on rank 0 (a file that does not
    match its sha256, adapters of another model.lora) is raised on every rank: the others would otherwise wait in
    the broadcast below until the collective timeout."""
    model_sd: dict = {}
    optim_sd: dict = {}
    error = None
    if dist.get_rank() == 0:
        try:
            with local_copy(ckpt_dir, (MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_META_FILE)) as local:
                model_sd = read_safetensors(local / MODEL_FILE)
                for alias, canonical in objs.aliases.items():
                    if canonical in model_sd:  # LoRA: a frozen tied weight is in no checkpoint
                        model_sd[alias] = model_sd[canonical]
                if objs.lora:
                    check_adapter_names(objs.model, model_sd, str(ckpt_dir))
                optim_sd = _read_optimizer(local)
        except Exception as e:  # noqa: BLE001 - raised below, on rank 0 as itself
            error = e
    failure = from_rank0(lambda: None if error is None else str(error))
    if failure is not None:
        if error is not None:
            raise error
        raise CheckpointError(f"{ckpt_dir}: rank 0 could not read the full checkpoint: {failure}")
    options = state_dict_options(objs.model, **_BROADCAST)
    set_model_state_dict(objs.model, model_sd, options=options)
    set_optimizer_state_dict(objs.model, objs.optimizer, optim_sd, options=options)


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
