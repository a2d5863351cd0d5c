"""Rank-0-full checkpoints: the whole training state, gathered to rank 0's CPU and written as plain files.

Layout of a checkpoint directory (an HF model directory plus the training state beside it):
  config.json, model.safetensors, tokenizer files   loadable by transformers as they are
  optimizer.safetensors, optimizer.json             AdamW state by parameter name, and the param groups
  rng.safetensors                                    every rank's torch RNG state
  trainer_state.json                                 step, data cursor, LR scheduler, loss scaler, world size
Tensors live in safetensors and everything else in JSON: loading a checkpoint never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from raysft.dataloader import DataCursor

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
TRAINING_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "trainer_state.json")
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message names the path."""


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    cursor: DataCursor


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


def save_full(
    out_dir: Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    state: TrainState,
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    aliases: dict[str, str],
) -> None:
    """Collective: every rank must call it. Only rank 0 materializes the full state and writes to out_dir."""
    model_sd = get_model_state_dict(model, options=_GATHER)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    rng = _gather_rng_states()
    if dist.get_rank() != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    for alias in aliases:
        model_sd.pop(alias, None)
    save_file({k: v.contiguous() for k, v in model_sd.items()}, out_dir / MODEL_FILE, metadata={"format": "pt"})
    hf_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tensors, scalars = {}, {}
    for fqn, param_state in optim_sd["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}/{key}"] = value.contiguous()
            else:
                scalars[f"{fqn}/{key}"] = value
    save_file(tensors, out_dir / "optimizer.safetensors")
    (out_dir / "optimizer.json").write_text(json.dumps({"param_groups": optim_sd["param_groups"], "scalars": scalars}))
    save_file(rng, out_dir / "rng.safetensors")
    (out_dir / "trainer_state.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION,
        "mode": "full",
        "step": state.step,
        "cursor": state.cursor.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loss_scaler": scaler.state_dict(),  # {} unless fp16
        "world_size": dist.get_world_size(),
    }, indent=1))


def read_trainer_state(ckpt_dir: Path) -> dict:
    path = ckpt_dir / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable trainer state: {e}") from e
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format_version')}, expected {FORMAT_VERSION}")
    return state


def load_full(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    aliases: dict[str, str],
) -> TrainState:
    """Collective: rank 0 reads the files and broadcasts; the other ranks receive only their shards."""
    state = read_trainer_state(ckpt_dir)
    model_sd: dict = {}
    optim_sd: dict = {}
    if dist.get_rank() == 0:
        model_sd = _read_safetensors(ckpt_dir / MODEL_FILE)
        for alias, canonical in aliases.items():
            model_sd[alias] = model_sd[canonical]
        optim_sd = _read_optimizer(ckpt_dir)
    set_model_state_dict(model, model_sd, options=_BROADCAST)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=_BROADCAST)
    scheduler.load_state_dict(state["scheduler"])
    if scaler.is_enabled() and state.get("loss_scaler"):  # an fp32/bf16 checkpoint resumed in fp16 starts fresh
        scaler.load_state_dict(state["loss_scaler"])
    _restore_rng_state(ckpt_dir, same_world=state["world_size"] == dist.get_world_size())
    return TrainState(step=state["step"], cursor=DataCursor.from_state_dict(state["cursor"]))


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


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _gather_rng_states() -> dict[str, torch.Tensor]:
    """Every rank's RNG states, gathered to all ranks (the collective needs device tensors under NCCL)."""
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        local["cuda"] = torch.cuda.get_rng_state()
    out = {}
    for kind, state in local.items():
        parts = [torch.empty_like(state, device=_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, state.to(_device()))
        out.update({f"{kind}.{rank}": part.cpu() for rank, part in enumerate(parts)})
    return out


def _restore_rng_state(ckpt_dir: Path, same_world: bool) -> None:
    if not same_world:  # another topology: per-rank streams have no counterpart; keep the fresh seeding
        return
    states = _read_safetensors(ckpt_dir / "rng.safetensors")
    rank = dist.get_rank()
    torch.set_rng_state(states[f"cpu.{rank}"])
    if f"cuda.{rank}" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[f"cuda.{rank}"])
