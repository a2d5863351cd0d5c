"""The full layout: whole tensors in plain files, so the checkpoint directory is a Hugging Face model directory
that transformers (and any safetensors reader) loads as it is:

    config.json, model*.safetensors, tokenizer files     the model
    optimizer*.safetensors, optimizer.json               AdamW state by parameter name, and the param groups

each in files of at most hf.shards.SHARD_BYTES with an index, as HF writes large models (raysft.hf.shards).

Saving streams: each tensor is gathered whole, one at a time, and rank 0 writes it into its place in its file
before the next is gathered, so no rank holds more than its shards and one tensor (the safetensors header, all
shapes and dtypes, is known before any gather). With checkpoint.async the whole state is gathered onto rank 0
first, the snapshot that lets training go on while it is written.

Loading: where every rank sees the checkpoint's files (local or shared storage), each reads only its own slices
of every tensor from them (raysft.hf.weights); otherwise (remote storage) rank 0 reads the files (downloaded
first, each checked against the manifest on the way) and broadcasts. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
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
from torch.distributed.tensor import DTensor, Shard

from raysft.checkpoint.background import background, run_now
from raysft.checkpoint.manifest import HashingWriter, read_manifest
from raysft.checkpoint.state import CheckpointError, TrainingObjects, read_safetensors
from raysft.checkpoint.trainable import check_adapter_names, check_saved_tensors, state_dict_options
from raysft.distributed.collectives import all_ranks, from_rank0
from raysft.errors import ends_the_run
from raysft.hf import shards as hf_shards
from raysft.hf.dtypes import DTYPE_NAMES
from raysft.hf.tensors import safetensors_tensors
from raysft.hf.weights import WeightsFileError, read_local_slices
from raysft.storage import Location, location

OPTIMIZER_META_FILE = "optimizer.json"
GATHER_BYTES = 64 * 2**20  # a full save gathers a sharded tensor onto rank 0 in blocks of rows of about this size
_GATHER = dict(full_state_dict=True, cpu_offload=True)  # StateDictOptions, made by state_dict_options(model)
_BROADCAST = dict(full_state_dict=True, broadcast_from_rank0=True)


def save(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    """Collective (the gathers); rank 0 writes."""
    if not asynchronous:
        return _save_streamed(out_dir, objs)
    options = state_dict_options(objs.model, **_GATHER)  # LoRA: the adapters only
    model_sd = get_model_state_dict(objs.model, options=options)
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=options)
    if dist.get_rank() != 0:
        return run_now(lambda: None)
    model = {k: v.contiguous() for k, v in _without_aliases(model_sd, objs.aliases).items()}
    tensors, scalars = _split_optimizer_state(optim_sd)
    optimizer_json = json.dumps({"param_groups": optim_sd["param_groups"], "scalars": scalars})

    def write() -> dict[str, str]:
        hashes = {**write_files(out_dir, "model", model, metadata={"format": "pt"}),
                  **write_files(out_dir, "optimizer", tensors)}
        (out_dir / OPTIMIZER_META_FILE).write_text(optimizer_json)
        return hashes

    # a gathered tensor shares memory with the live one where nothing was sharded (one rank, NO_SHARD on CPU):
    # copy those, and only those, before training goes on
    live = {t.untyped_storage().data_ptr() for t in _local_tensors(objs)}
    model = {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in model.items()}
    tensors = {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in tensors.items()}
    return background().submit(write)


def _split_optimizer_state(optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The optimizer state as the files hold it: tensors by "fqn/key" (optimizer.safetensors), the rest by the
    same names (optimizer.json); `_nest_optimizer_state` reads the names back."""
    tensors, scalars = {}, {}
    for fqn, param_state in optim_sd["state"].items():
        for key, value in param_state.items():
            (tensors if isinstance(value, torch.Tensor) else scalars)[f"{fqn}/{key}"] = value
    return tensors, scalars


def _nest_optimizer_state(flat: dict[str, object], state: dict[str, dict]) -> dict[str, dict]:
    """The inverse of `_split_optimizer_state`: each "fqn/key" value into state[fqn][key]."""
    for name, value in flat.items():
        fqn, _, key = name.rpartition("/")
        state.setdefault(fqn, {})[key] = value
    return state


def _without_aliases(model_sd: dict, aliases: dict[str, str]) -> dict:
    """The state dict as the files hold it: a tied weight once, under its canonical name (safetensors stores no
    shared tensor twice)."""
    return {k: v for k, v in model_sd.items() if k not in aliases}


def _restore_aliases(model_sd: dict, aliases: dict[str, str]) -> None:
    """The tied weights' other names back, each the canonical tensor; a weight in no checkpoint (LoRA's frozen
    tied weights) gets no alias either."""
    for alias, canonical in aliases.items():
        if canonical in model_sd:
            model_sd[alias] = model_sd[canonical]


class _Gathering(dict):
    """Sharded tensors by name, each gathered whole when `whole` reaches it. Collective: every rank gathers the
    same tensors in the same order; rank 0 writes each one (write_safetensors) and lets it go, the other ranks
    only take part (`finish`), as rank 0 does for what is left after a failed write."""

    gathered = 0

    def whole(self, t: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor on rank 0 (None on the others)."""
        self.gathered += 1
        if not isinstance(t, DTensor):
            return t.detach().cpu()
        if t.to_local().device.type != t.device_mesh.device_type:  # offloaded shards: gathered on the device
            t = t.to(t.device_mesh.device_type)
        if t.placements != (Shard(0),) or t.device_mesh.device_type != "cpu":
            return t.full_tensor().cpu()  # every rank gets it whole (HSDP, NO_SHARD; NCCL has no gather)
        return _gather_to_rank0(t)

    def finish(self) -> None:
        for t in list(self.values())[self.gathered:]:
            self.whole(t)


def _gather_to_rank0(t: DTensor) -> torch.Tensor | None:
    """FSDP2's layout (dim 0 split in equal padded pieces, the last ones short or empty) gathered straight into one
    padded tensor on rank 0: no other rank allocates anything, rank 0 the tensor once. Gathered in blocks of rows
    of about GATHER_BYTES: gloo receives a gather into a flat buffer of its own before copying it out, which for
    the whole tensor at once would hold two copies of the largest tensor (the embedding) on rank 0."""
    world = dist.get_world_size(t.device_mesh.get_group())
    piece = -(-t.shape[0] // world)  # FSDP2 pads dim 0 to a multiple of the world size
    local = t.to_local()
    padded = local
    if local.shape[0] != piece or not local.is_contiguous():
        padded = local.new_zeros((piece, *t.shape[1:]))
        padded[:local.shape[0]] = local
    whole = local.new_empty((piece * world, *t.shape[1:])) if dist.get_rank() == 0 else None
    row_bytes = max(1, padded[0].numel() * padded.element_size()) if piece else 1
    rows = max(1, GATHER_BYTES // row_bytes)
    for a in range(0, piece, rows):
        b = min(piece, a + rows)
        blocks = [whole[r * piece + a:r * piece + b] for r in range(world)] if whole is not None else None
        dist.gather(padded[a:b], blocks, dst=0, group=t.device_mesh.get_group())
    return whole[:t.shape[0]] if whole is not None else None


def _save_streamed(out_dir: Path, objs: TrainingObjects) -> Future:
    options = state_dict_options(objs.model)  # sharded; LoRA: the adapters only
    model = _Gathering(_without_aliases(get_model_state_dict(objs.model, options=options), objs.aliases))
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=options)
    tensors, scalars = _split_optimizer_state(optim_sd)
    optimizer = _Gathering(tensors)
    if dist.get_rank() != 0:
        model.finish()
        optimizer.finish()
        return run_now(lambda: None)

    def write() -> dict[str, str]:
        try:
            hashes = {**write_files(out_dir, "model", model, metadata={"format": "pt"}),
                      **write_files(out_dir, "optimizer", optimizer)}
        finally:  # the other ranks gather on: a write that failed must not leave them waiting
            model.finish()
            optimizer.finish()
        (out_dir / OPTIMIZER_META_FILE).write_text(json.dumps({"param_groups": optim_sd["param_groups"],
                                                               "scalars": scalars}))
        return hashes

    return run_now(write)


def _local_tensors(objs: TrainingObjects) -> list[torch.Tensor]:
    """This rank's own storage of the parameters and the optimizer state."""
    found = [*objs.model.parameters(), *(v for s in objs.optimizer.state.values() for v in s.values())]
    return [getattr(t, "_local_tensor", t) for t in found if isinstance(t, torch.Tensor)]


def write_files(out_dir: Path, stem: str, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> dict[str, str]:
    """The tensors in files of about hf_shards.SHARD_BYTES, one after the other, and their index; returns
    {file: sha256}."""
    sizes = {name: t.numel() * t.dtype.itemsize for name, t in tensors.items()}
    groups = hf_shards.group(sizes, hf_shards.SHARD_BYTES)
    names = hf_shards.file_names(stem, len(groups))
    hashes = {name: write_safetensors(out_dir / name, tensors, metadata, only=names_in)
              for names_in, name in zip(groups, names, strict=True)}
    hf_shards.write_index(out_dir, stem, groups, names, sum(sizes.values()))
    return hashes


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      only: list[str] | None = None) -> str:
    """Write a safetensors file straight from the tensors' memory (those named in `only`, in its order, or all),
    hashing it on the way; returns its sha256. safetensors' own save_file first copies every tensor into one
    bytes object: a second copy of the whole state on rank 0, and a second pass over it. The file is read back
    with safetensors (load_file) as ever. Tensors being gathered (_Gathering) are written one at a time, each as
    it arrives: the header needs only the shapes."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    names = list(tensors) if only is None else only
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the format asks
    with path.open("wb") as f:
        out = HashingWriter(f)
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name in names:
            t = tensors.whole(tensors[name]) if isinstance(tensors, _Gathering) else tensors[name]
            if t.numel():
                out.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
            del t  # before the next gather
        return out.hexdigest()


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    """Collective: every rank reads its own slices where every rank sees the files, else rank 0 reads and every
    rank receives its shards. A read that fails on rank 0 (a file cut off or that does not match its sha256,
    adapters of another model.lora) is raised on every rank: the others would otherwise wait in the broadcast
    below until the collective timeout."""
    ckpt = location(ckpt_dir)
    per_rank = all_ranks(ckpt.local is not None and _all_present(ckpt.local))
    model_sd: dict = {}
    optim_sd: dict = {}
    error = None
    if dist.get_rank() == 0:
        try:
            if per_rank:  # the headers only: what each rank will read is there
                _check_headers(ckpt.local, objs)
            else:
                model_sd, optim_sd = _read_whole(ckpt_dir, objs)
        except Exception as e:  # noqa: BLE001 - raised below, on rank 0 as itself
            error = e
    failure = from_rank0(lambda: None if error is None else (str(error), ends_the_run(error)))
    if failure is not None:
        if error is not None:
            raise error
        message, ends = failure  # a read that a retry may get through on rank 0 may on this rank too
        raise CheckpointError(f"{ckpt_dir}: rank 0 could not read the full checkpoint: {message}") \
            from (None if ends else OSError(message))
    if per_rank:
        _read_slices(ckpt.local, objs)
        return
    launch = get_optimizer_state_dict(objs.model, objs.optimizer, options=state_dict_options(objs.model))
    if dist.get_rank() == 0:  # this launch's optimizer settings, not the checkpoint's (restore_trainer_state)
        optim_sd["param_groups"] = launch["param_groups"]
    options = state_dict_options(objs.model, **_BROADCAST)
    set_model_state_dict(objs.model, model_sd, options=options)
    set_optimizer_state_dict(objs.model, objs.optimizer, optim_sd, options=options)


def _all_present(ckpt_dir: Path) -> bool:
    """Whether every file of the checkpoint's tensors is there to read (a bad index: no, rank 0 then names it)."""
    try:
        names = [n for stem in hf_shards.STEMS for n in hf_shards.listed_files(ckpt_dir, stem)]
    except CheckpointError:
        return False
    return all((ckpt_dir / n).is_file() for n in [*names, OPTIMIZER_META_FILE])


def _check_headers(ckpt_dir: Path, objs: TrainingObjects) -> None:
    model = hf_shards.tensor_map(ckpt_dir, "model")
    hf_shards.tensor_map(ckpt_dir, "optimizer")
    if objs.lora:
        check_adapter_names(objs.model, list(model), str(ckpt_dir))
    check_model_tensors(ckpt_dir, model, objs)


def check_model_tensors(ckpt_dir: Path, files: dict[str, Path], objs: TrainingObjects) -> None:
    """Every tensor of the model in the model files, of its shape and a dtype read correctly (headers only)."""
    where = hf_shards.naming_file(ckpt_dir, "model")
    check_saved_tensors(objs.model, safetensors_tensors(dict.fromkeys(files.values())), str(where))


def _read_slices(ckpt_dir: Path, objs: TrainingObjects) -> None:
    """Every rank: its slices of the weights and of the optimizer state, from the files into the sharded state
    dicts, which are then set (a local copy)."""
    options = state_dict_options(objs.model)
    model_sd = get_model_state_dict(objs.model, options=options)
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=options)
    tensors, _ = _split_optimizer_state(optim_sd)
    try:
        read_local_slices(_without_aliases(model_sd, objs.aliases), hf_shards.tensor_map(ckpt_dir, "model"))
        read_local_slices(tensors, hf_shards.tensor_map(ckpt_dir, "optimizer"))
    except (WeightsFileError, OSError) as e:
        raise CheckpointError(f"{ckpt_dir}: {e}") from e
    _restore_aliases(model_sd, objs.aliases)
    meta = _read_optimizer_meta(ckpt_dir)
    _nest_optimizer_state(meta["scalars"], optim_sd["state"])
    # optim_sd's parameter groups are this launch's, not the checkpoint's (restore_trainer_state)
    set_model_state_dict(objs.model, model_sd, options=options)
    set_optimizer_state_dict(objs.model, objs.optimizer, optim_sd, options=options)


def _read_whole(ckpt_dir: Path | Location, objs: TrainingObjects) -> tuple[dict, dict]:
    """Rank 0: the whole model and optimizer state, to broadcast."""
    with local_copy(ckpt_dir, _is_state_file) as local:
        model_sd = _read_all(local, "model")
        _restore_aliases(model_sd, objs.aliases)
        if objs.lora:
            check_adapter_names(objs.model, model_sd, str(ckpt_dir))
        check_model_tensors(local, hf_shards.tensor_map(local, "model"), objs)
        return model_sd, _read_optimizer(local)


def _is_state_file(name: str) -> bool:
    return hf_shards.is_tensor_or_index_file(name) or name == OPTIMIZER_META_FILE


def _read_all(ckpt_dir: Path, stem: str) -> dict[str, torch.Tensor]:
    """Every tensor of a stem's files, whole."""
    tensors = {}
    for path in dict.fromkeys(hf_shards.tensor_map(ckpt_dir, stem).values()):
        tensors.update(read_safetensors(path))
    return tensors


@contextlib.contextmanager
def local_copy(ckpt_dir: Path | Location, wanted: Callable[[str], bool]) -> Iterator[Path]:
    """The checkpoint's directory if it is local; else a temporary download of the files of its manifest that are
    `wanted`, each checked against its sha256 in the manifest as it arrives, removed afterwards."""
    ckpt = location(ckpt_dir)
    if ckpt.local is not None:
        yield ckpt.local
        return
    files = read_manifest(ckpt)
    with tempfile.TemporaryDirectory(prefix="raysft-full-ckpt-") as tmp:
        for name in filter(wanted, files):
            if (ckpt / name).download(Path(tmp) / name) != files[name]["sha256"]:
                raise CheckpointError(f"{ckpt / name} does not match its sha256 in the manifest")
        yield Path(tmp)


def _read_optimizer_meta(ckpt_dir: Path) -> dict:
    """optimizer.json: the param groups (betas a tuple again, as AdamW keeps them) and the non-tensor state."""
    meta = json.loads((ckpt_dir / OPTIMIZER_META_FILE).read_text())
    for group in meta["param_groups"]:
        group["betas"] = tuple(group["betas"])
    return meta


def _read_optimizer(ckpt_dir: Path) -> dict:
    meta = _read_optimizer_meta(ckpt_dir)
    state = _nest_optimizer_state({**_read_all(ckpt_dir, "optimizer"), **meta["scalars"]}, {})
    return {"state": state, "param_groups": meta["param_groups"]}
