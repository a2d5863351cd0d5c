"""Checkpoints of the whole training state, in one of two layouts, each made complete by a manifest written last.

full     rank 0 gathers everything to its CPU and writes plain files; the directory is an HF model directory:
           config.json, model.safetensors, tokenizer files      loadable by transformers as they are
           optimizer.safetensors, optimizer.json                AdamW state by parameter name, and the param groups
sharded  every worker writes its own shards with torch.distributed.checkpoint (DCP): `__<rank>_0.distcp`, plus
         `.metadata` from rank 0; replicated tensors (HSDP) are written once. Config and tokenizer come along so
         the checkpoint exports on its own.
Both:    rng.safetensors (every rank's RNG), trainer_state.json (step, data cursor, LR schedule, loss scale,
         world size), and manifest.json: every file's size and sha256, written by rank 0 after all ranks have
         written theirs. A directory without a manifest that matches its files is incomplete and never loaded.

Either layout loads on any number of workers and any sharding strategy (broadcast from rank 0, or DCP
resharding), and a run may switch modes across a resume. Checkpoints are written to local scratch directories (Ray
uploads them) and loaded from wherever the run lives: on remote storage each rank of a sharded load reads just its
byte ranges (`StorageReader`), and rank 0 of a full load downloads the files it needs. Tensors live in
safetensors or DCP files and the rest in JSON. A full checkpoint is never unpickled; a sharded one's DCP index
(`.metadata`, a pickle) and saved values are read by raysft.dcp_read, which admits only DCP's own metadata classes
and plain data, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from raysft.collectives import count_ranks, default_device
from raysft.dataloader import DataCursor
from raysft.dcp_read import SafeLoadPlanner, UnsafeCheckpointData, dcp_reader
from raysft.storage import Location, location

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"
TRAINING_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", STATE_FILE, MANIFEST_FILE)
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message names the path."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed on some rank (a full disk, a lost mount). Raised on every rank at once; the
    checkpoint is not complete and never reported, so the previous one stays the latest."""


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    cursor: DataCursor
    eval_loss: float | None = None  # of the weights at `step`, if validated there (checkpoint.keep_best ranks by it)


@dataclass
class TrainingObjects:
    """What a checkpoint saves and restores on one worker."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    aliases: dict[str, str]  # tied parameters: {alias: canonical name}


def choose_mode(mode: str, model: nn.Module) -> str:
    """Collective for "auto": full while rank 0's host can comfortably hold the gathered fp32 weights and AdamW
    moments (12 bytes per parameter) beside everything else, sharded beyond. The same answer on every rank."""
    if mode != "auto":
        return mode
    numel = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size, the same on every rank
    pick = [None]
    if dist.get_rank() == 0:
        pick[0] = auto_mode(12 * numel, available_memory_bytes())
    dist.broadcast_object_list(pick, src=0)
    return pick[0]


def auto_mode(state_bytes: int, available_bytes: int) -> str:
    """Gathering needs the whole state once on rank 0 (and a copy more with async saves): keep it to a quarter of
    what the host has available."""
    return "full" if 4 * state_bytes <= available_bytes else "sharded"


def available_memory_bytes() -> int:
    """What the host can still give this process: MemAvailable on Linux, free pages elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


class PendingSave:
    """A checkpoint whose files may still be being written in the background. `finish` is collective: it waits,
    makes sure every rank succeeded (a background failure is raised on all ranks, never lost) and then writes the
    manifest that makes the checkpoint complete."""

    def __init__(self, out_dir: Path, step: int, futures: list[Future], owner: int | None = None):
        self.out_dir, self.step, self.futures, self.owner = out_dir, step, futures, owner
        self.bytes_written = 0  # on rank 0 once finished: the size of the whole checkpoint, every rank's files
        # writing in the background: flushing, listing and hashing the files happen there too, off training's path
        writing = not all(f.done() for f in futures)
        self.listing = _chain(futures, lambda: _durable_file_list(out_dir, owner)) if writing else None

    def done(self) -> bool:
        return all(f.done() for f in self.futures) and (self.listing is None or self.listing.done())

    def finish(self) -> bool:
        """Returns whether this rank wrote files (Ray uploads those)."""
        error = None
        for future in [*self.futures, *([self.listing] if self.listing else [])]:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = error or e
        self._raise_if_any_rank_failed(error)
        try:
            mine = self.listing.result() if self.listing else _durable_file_list(self.out_dir, self.owner)
        except OSError as e:
            mine, error = {}, e
        everyone: list[dict] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is not None and error is None:
            try:
                _write_manifest(self.out_dir, self.step, everyone)
                self.bytes_written = sum(e["size"] for part in everyone for e in part.values())
            except (OSError, CheckpointError) as e:
                error = e
        self._raise_if_any_rank_failed(error)
        return bool(mine)

    def _raise_if_any_rank_failed(self, error: BaseException | None) -> None:
        failed = count_ranks(error is not None)
        if failed:
            raise CheckpointSaveError(
                f"{self.out_dir}: writing the checkpoint of step {self.step} failed on {failed} rank(s)"
                f"{f': {error}' if error else ''}. The previous checkpoint is still the latest complete one; "
                "launching again resumes from it once the cause (a full disk?) is fixed") from error


def start_save(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState,
               asynchronous: bool = False, shared: bool = False) -> PendingSave:
    """Collective: snapshot this rank's part of the training state and write it into out_dir: a directory of this
    rank's own, or with `shared` one that every rank writes into (each then lists only the files it wrote). With
    asynchronous, the writing (and hashing) happens in the background and training may go on; either way, call
    `finish()` on the result, on every rank, before the checkpoint is used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "full":
        future = _save_full(out_dir, objs, asynchronous)
    else:
        future = _save_sharded(out_dir, objs, asynchronous)
    rng = _gather_rng_states()
    futures = [future]
    if dist.get_rank() == 0:  # small files, written now
        futures.append(_run_now(lambda: _write_run_files(out_dir, mode, objs, state, rng)))
    return PendingSave(out_dir, state.step, futures, owner=dist.get_rank() if shared else None)


def _write_run_files(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState,
                     rng: dict[str, torch.Tensor]) -> None:
    objs.hf_config.save_pretrained(out_dir)
    objs.tokenizer.save_pretrained(out_dir)
    save_file(rng, out_dir / "rng.safetensors")
    (out_dir / STATE_FILE).write_text(json.dumps({
        "format_version": FORMAT_VERSION,
        "mode": mode,
        "step": state.step,
        "cursor": state.cursor.state_dict(),
        "scheduler": objs.scheduler.state_dict(),
        "loss_scaler": objs.scaler.state_dict(),  # {} unless fp16
        "world_size": dist.get_world_size(),
        "eval_loss": state.eval_loss,
    }, indent=1))


def save(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState) -> bool:
    """Collective, synchronous: write a complete checkpoint part. Returns whether this rank wrote files."""
    return start_save(out_dir, mode, objs, state).finish()


def load(ckpt_dir: Path | Location, objs: TrainingObjects) -> TrainState:
    """Collective: restore everything from a complete checkpoint of either mode, on any topology, local or on
    remote storage (sharded: each rank reads its byte ranges from storage; full: rank 0 downloads the files)."""
    state = read_trainer_state(ckpt_dir)
    if state["mode"] == "full":
        _load_full(ckpt_dir, objs)
    else:
        _load_sharded(ckpt_dir, objs)
    objs.scheduler.load_state_dict(state["scheduler"])
    if objs.scaler.is_enabled() and state.get("loss_scaler"):  # an fp32/bf16 checkpoint resumed in fp16: fresh
        objs.scaler.load_state_dict(state["loss_scaler"])
    _restore_rng_state(ckpt_dir, same_world=state["world_size"] == dist.get_world_size())
    return TrainState(step=state["step"], cursor=DataCursor.from_state_dict(state["cursor"]))


def read_trainer_state(ckpt_dir: Path | Location) -> dict:
    path = location(ckpt_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable trainer state: {e}") from e
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else f"a JSON {type(state).__name__}"
        raise CheckpointError(f"{path}: checkpoint format {found}, expected {FORMAT_VERSION}")
    wrong = [k for k, tp in _STATE_KEYS.items() if not isinstance(state.get(k), tp)]
    if wrong or state["mode"] not in ("full", "sharded"):
        raise CheckpointError(f"{path}: not a raysft trainer state: {wrong[0] if wrong else 'mode'} is missing or "
                              f"of the wrong type ({state.get(wrong[0] if wrong else 'mode')!r})")
    return state


_STATE_KEYS = {"mode": str, "step": int, "cursor": dict, "scheduler": dict, "world_size": int}


def is_payload(name: str) -> bool:
    """The big files: weights and optimizer state (DCP shards or safetensors), all but the small ones."""
    return name.endswith(".distcp") or name in (MODEL_FILE, "optimizer.safetensors")


def incomplete_reason(ckpt_dir: Path | Location, checksums: bool | None = None) -> str | None:
    """Why ckpt_dir is not a complete checkpoint (None if it is): the manifest is missing or unreadable, or a file
    it lists is missing, of another size or (with checksums) of other content.

    checksums None: every file's on local storage; on remote storage only the small files', since hashing the
    payload would read the whole checkpoint through one process. An object store never shows a partly written
    object, and a full checkpoint's payload is checked as rank 0 downloads it (`_load_full`).
    """
    ckpt = location(ckpt_dir)
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (the save did not finish)"
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"unreadable {MANIFEST_FILE}: {e}"
    problem = manifest_problem(manifest)
    if problem:
        return f"{MANIFEST_FILE} is not a raysft manifest: {problem}"
    sizes = ckpt.files()
    for name, entry in manifest["files"].items():
        if name not in sizes:
            return f"{name} is missing"
        if sizes[name] != entry["size"]:
            return f"{name} has {sizes[name]} bytes, the manifest says {entry['size']}"
        hashed = checksums if checksums is not None else ckpt.local is not None or not is_payload(name)
        if hashed and (ckpt / name).sha256() != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def manifest_problem(manifest: object) -> str | None:
    """What makes parsed JSON not a manifest (None if it is one): valid JSON is not enough to be trusted."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no 'files' listing"
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or \
                not isinstance(entry.get("sha256"), str):
            return f"the entry of {name!r} lacks an integer size and a sha256"
        if name.startswith("/") or ".." in name.split("/"):
            return f"{name!r} is not a path inside the checkpoint"
    return None


# --- full: gathered to rank 0 -------------------------------------------------------------------------------------

def _save_full(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    model_sd = get_model_state_dict(objs.model, options=_GATHER)
    optim_sd = get_optimizer_state_dict(objs.model, objs.optimizer, options=_GATHER)
    if dist.get_rank() != 0:
        return _run_now(lambda: None)
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
        save_file(tensors, out_dir / "optimizer.safetensors")
        (out_dir / "optimizer.json").write_text(optimizer_json)

    if not asynchronous:
        return _run_now(write)
    # a gathered tensor may share memory with a live one (a mesh of one shard): copy before training goes on
    model = {k: v.clone() for k, v in model.items()}
    tensors = {k: v.clone() for k, v in tensors.items()}
    return _background().submit(write)


def _load_full(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    """Rank 0 reads the files (downloaded first from remote storage) and broadcasts; the other ranks receive only
    their shards."""
    model_sd: dict = {}
    optim_sd: dict = {}
    if dist.get_rank() == 0:
        with local_copy(ckpt_dir, (MODEL_FILE, "optimizer.safetensors", "optimizer.json")) as local:
            model_sd = _read_safetensors(local / MODEL_FILE)
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
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
    with tempfile.TemporaryDirectory(prefix="raysft-full-ckpt-") as tmp:
        for name in names:
            if (ckpt / name).download(Path(tmp) / name) != manifest[name]["sha256"]:
                raise CheckpointError(f"{ckpt / name} does not match its sha256 in the manifest")
        yield Path(tmp)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise CheckpointError(f"{path}: cannot read: {e}") from e


def _read_optimizer(ckpt_dir: Path) -> dict:
    meta = json.loads((ckpt_dir / "optimizer.json").read_text())
    state: dict[str, dict] = {}
    for key, value in [*_read_safetensors(ckpt_dir / "optimizer.safetensors").items(), *meta["scalars"].items()]:
        fqn, _, name = key.rpartition("/")
        state.setdefault(fqn, {})[name] = value
    for group in meta["param_groups"]:
        group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": meta["param_groups"]}


# --- sharded: torch.distributed.checkpoint ------------------------------------------------------------------------

def _save_sharded(out_dir: Path, objs: TrainingObjects, asynchronous: bool) -> Future:
    model_sd, optim_sd = get_state_dict(objs.model, objs.optimizer)
    # each rank writes __<rank>_0.distcp into its own directory; the planner writes a replicated tensor once
    if not asynchronous:
        return _run_now(lambda: dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=out_dir))
    # staged to CPU memory now, written by a background thread that synchronizes over its own gloo group
    return dcp.async_save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=out_dir,
                          process_group=_checkpoint_group())


def _first_failure(e: BaseException) -> BaseException:
    """DCP's CheckpointException holds each rank's exception, its message their tracebacks: say the first."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values())) if isinstance(failures, dict) and failures else e


def read_index(ckpt_dir: Path | Location, reader: FileSystemReader | None = None) -> Metadata:
    """The DCP index of a sharded checkpoint, read without running anything from it (raysft.dcp_read)."""
    try:
        return (reader or dcp_reader(ckpt_dir)).read_metadata()
    except (OSError, UnsafeCheckpointData) as e:
        raise CheckpointError(f"{ckpt_dir}: cannot read the sharded checkpoint's index: {e}") from e


def _load_sharded(ckpt_dir: Path | Location, objs: TrainingObjects) -> None:
    model_sd, optim_sd = get_state_dict(objs.model, objs.optimizer)  # this topology's shards, to be filled
    reader = dcp_reader(ckpt_dir)
    read_index(ckpt_dir, reader)  # a refused index, said plainly (DCP's own reading would bury it in a traceback)
    try:
        dcp.load({"model": model_sd, "optimizer": optim_sd}, storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures (in a BaseException); name the dir
        raise CheckpointError(f"{ckpt_dir}: cannot load the sharded state: {_first_failure(e)}") from e
    set_state_dict(objs.model, objs.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


# --- background writing, manifest, RNG -----------------------------------------------------------------------------

@functools.cache
def _background() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysft-checkpoint")


@functools.cache
def _checkpoint_group() -> dist.ProcessGroup:
    """Collective on first use: a gloo group for background checkpoint traffic, apart from training's."""
    return dist.new_group(backend="gloo")


def _chain(first: list[Future], then) -> Future:
    """A future of `then()`, run in the background writer once every one of `first` succeeded (else its error)."""
    def run():
        for future in first:
            future.result()
        return then()

    return _background().submit(run)


def _run_now(write) -> Future:
    """Run a synchronous write, keeping its error in the future: `PendingSave.finish` raises it on every rank
    (raised here, it would leave the other ranks waiting in the next collective)."""
    future: Future = Future()
    try:
        future.set_result(write())
    except Exception as e:  # noqa: BLE001 - delivered by finish()
        future.set_exception(e)
    return future


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _owned_by(name: str, rank: int) -> bool:
    """In a directory every rank writes into: rank r writes its DCP shard file __<r>_<n>.distcp, rank 0 the rest."""
    match = _SHARD_FILE.fullmatch(name)
    return int(match[1]) == rank if match else rank == 0


def _durable_file_list(out_dir: Path, owner: int | None = None) -> dict[str, dict]:
    """This rank's files (all in its own directory; those it wrote in a shared one), flushed to disk, with their
    sizes and sha256."""
    mine = {str(f.relative_to(out_dir)): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(out_dir.rglob("*"))
            if f.is_file() and (owner is None or _owned_by(str(f.relative_to(out_dir)), owner))}
    for name in mine:
        fsync(out_dir / name)
    return mine


def _write_manifest(out_dir: Path, step: int, everyone: list[dict]) -> None:
    """Rank 0, last: every rank's files in one manifest, which makes the checkpoint complete."""
    files: dict[str, dict] = {}
    for rank, part in enumerate(everyone):
        for name, entry in part.items():
            if name in files:
                raise CheckpointError(f"{out_dir}: rank {rank} also wrote {name}; Ray would keep only one of them")
            files[name] = entry
    tmp = out_dir / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, "files": files}, indent=1))
    fsync(tmp)
    tmp.rename(out_dir / MANIFEST_FILE)
    fsync(out_dir)


def _gather_rng_states() -> dict[str, torch.Tensor]:
    """Every rank's RNG states, gathered to all ranks (the collective needs device tensors under NCCL)."""
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        local["cuda"] = torch.cuda.get_rng_state()
    out = {}
    for kind, state in local.items():
        parts = [torch.empty_like(state, device=default_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, state.to(default_device()))
        out.update({f"{kind}.{rank}": part.cpu() for rank, part in enumerate(parts)})
    return out


def _restore_rng_state(ckpt_dir: Path | Location, same_world: bool) -> None:
    if not same_world:  # another topology: per-rank streams have no counterpart; keep the fresh seeding
        return
    rng = location(ckpt_dir) / "rng.safetensors"
    if rng.local is not None:
        states = _read_safetensors(rng.local)
    else:
        try:
            states = load_safetensors_bytes(rng.read_bytes())
        except Exception as e:  # safetensors raises its own error types for truncated or malformed files
            raise CheckpointError(f"{rng}: cannot read: {e}") from e
    rank = dist.get_rank()
    torch.set_rng_state(states[f"cpu.{rank}"])
    if f"cuda.{rank}" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[f"cuda.{rank}"])
