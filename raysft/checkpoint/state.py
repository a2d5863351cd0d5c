"""What a checkpoint holds besides the weights: the training objects it saves, the trainer state file (step, data
cursor, LR schedule, loss scale, step guard, world size) and every rank's RNG.

The step guard (raysft.training.step_guard) is one of the training objects, saved and restored through its
state_dict like the scheduler's; the shape of what it saves is part of the trainer state's format, checked here
(step_guard_problem) with the rest of the file, so that the checkpoint package needs nothing of the training loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from raysft.config import LOSS_SPIKE_WINDOW
from raysft.data.dataloader import DataCursor
from raysft.distributed.collectives import default_device, uses_nccl
from raysft.errors import CheckpointError
from raysft.storage import Location, location

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
_STATE_KEYS = {"mode": str, "step": int, "cursor": dict, "scheduler": dict, "world_size": int}


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    cursor: DataCursor
    eval_loss: float | None = None  # of the weights at `step`, if validated there (checkpoint.keep_best ranks by it)
    eval_metrics: dict | None = None  # the validation pass's other metrics there (DPO's eval/rewards/..., eval_s)
    skipped_steps: int = 0  # steps not applied (raysft.training.step_guard), over the whole run


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
    guard: Stateful  # the step guard: its recent losses and skips in a row decide the steps after a resume
    lora: dict | None = None  # LoRA (raysft.model.lora.record): the checkpoint holds only the adapters


def write_run_files(out_dir: Path, mode: str, objs: TrainingObjects, state: TrainState,
                    rng: dict[str, torch.Tensor]) -> None:
    """Rank 0: the small files. Config and tokenizer come along so that any checkpoint exports on its own."""
    objs.hf_config.save_pretrained(out_dir)
    objs.tokenizer.save_pretrained(out_dir)
    save_file(rng, out_dir / RNG_FILE)
    (out_dir / STATE_FILE).write_text(json.dumps(trainer_state_dict(mode, objs, state), indent=1))


def trainer_state_dict(mode: str, objs: TrainingObjects, state: TrainState) -> dict:
    """Everything but the tensors that a resume needs, as JSON values: what trainer_state.json holds."""
    return {
        "format_version": FORMAT_VERSION,
        "mode": mode,
        "step": state.step,
        "cursor": state.cursor.state_dict(),
        "scheduler": objs.scheduler.state_dict(),
        "loss_scaler": objs.scaler.state_dict(),  # {} unless fp16
        "world_size": dist.get_world_size(),
        "eval_loss": state.eval_loss,
        **({"eval_metrics": state.eval_metrics} if state.eval_metrics else {}),
        "skipped_steps": state.skipped_steps,
        "step_guard": objs.guard.state_dict(),
        **({"lora": objs.lora} if objs.lora else {}),
    }


def read_trainer_state(ckpt_dir: Path | Location) -> dict:
    """The trainer state of a checkpoint of the format this raysft writes, checked key by key (valid JSON is not
    enough to be trusted)."""
    path = location(ckpt_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable trainer state: {e}") from e
    return check_trainer_state(state, path)


def check_trainer_state(state, where, modes: tuple[str, ...] = ("full", "sharded")) -> dict:
    """`state` if it is a trainer state of this raysft's format, checked key by key, the mode one of `modes` (a
    memory-tier snapshot's is "memory"); else CheckpointError naming `where` and the key."""
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else f"a JSON {type(state).__name__}"
        raise CheckpointError(f"{where}: checkpoint format {found}, expected {FORMAT_VERSION}")
    wrong = [k for k, tp in _STATE_KEYS.items() if not isinstance(state.get(k), tp)]
    if wrong or state["mode"] not in modes:
        raise CheckpointError(f"{where}: not a raysft trainer state: {wrong[0] if wrong else 'mode'} is missing or "
                              f"of the wrong type ({state.get(wrong[0] if wrong else 'mode')!r})")
    if "step_guard" in state and (problem := step_guard_problem(state["step_guard"])):  # absent: a fresh guard
        raise CheckpointError(f"{where}: step_guard: {problem}")
    return state


def step_guard_problem(state: object) -> str | None:
    """What is wrong with a step guard's state read from a checkpoint, or None: `recent` a list of at most
    LOSS_SPIKE_WINDOW finite numbers, `in_a_row` a count."""
    if not isinstance(state, dict) or set(state) != {"recent", "in_a_row"}:
        return f"expected an object with keys recent and in_a_row, found {state!r}"
    recent, in_a_row = state["recent"], state["in_a_row"]
    if not isinstance(recent, list) or len(recent) > LOSS_SPIKE_WINDOW or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in recent):
        return f"recent must be a list of at most {LOSS_SPIKE_WINDOW} finite losses, found {recent!r}"
    if not isinstance(in_a_row, int) or isinstance(in_a_row, bool) or in_a_row < 0:
        return f"in_a_row must be a count, found {in_a_row!r}"
    return None


def restore_trainer_state(state: dict, objs: TrainingObjects) -> TrainState:
    """Apply a read trainer state to the scheduler and loss scaler; the step and data cursor to go on from. The
    schedule's position comes from the checkpoint, its base rate from this launch (`train.lr` may change between
    launches), as every other optimizer setting does: both layouts load the checkpoint's optimizer state into this
    launch's parameter groups (betas, eps, weight decay and its exclusions, fused), never the groups it was saved
    with."""
    launch_lrs = list(objs.scheduler.base_lrs)
    objs.scheduler.load_state_dict(state["scheduler"])
    objs.scheduler.base_lrs = launch_lrs
    for group, base, factor in zip(objs.optimizer.param_groups, launch_lrs, objs.scheduler.lr_lambdas, strict=True):
        group["initial_lr"], group["lr"] = base, base * factor(objs.scheduler.last_epoch)
    objs.scheduler._last_lr = [group["lr"] for group in objs.optimizer.param_groups]  # as LRScheduler.step sets it
    if objs.scaler.is_enabled() and state.get("loss_scaler"):  # an fp32/bf16 checkpoint resumed in fp16: fresh
        objs.scaler.load_state_dict(state["loss_scaler"])
    if "step_guard" in state:
        objs.guard.load_state_dict(state["step_guard"])
    return TrainState(step=state["step"], cursor=DataCursor.from_state_dict(state["cursor"]),
                      skipped_steps=skipped if isinstance(skipped := state.get("skipped_steps"), int) else 0)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise CheckpointError(f"{path}: cannot read: {e}") from e


def gather_rng_states() -> dict[str, torch.Tensor]:
    """Collective: every rank's RNG states, gathered to all ranks (the collective needs device tensors under
    NCCL)."""
    local = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and uses_nccl():
        local["cuda"] = torch.cuda.get_rng_state()
    out = {}
    for kind, state in local.items():
        parts = [torch.empty_like(state, device=default_device()) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, state.to(default_device()))
        out.update({f"{kind}.{rank}": part.cpu() for rank, part in enumerate(parts)})
    return out


def restore_rng_state(ckpt_dir: Path | Location, same_world: bool) -> None:
    if not same_world:  # another topology: per-rank streams have no counterpart; keep the fresh seeding
        return
    rng = location(ckpt_dir) / RNG_FILE
    if rng.local is not None:
        states = read_safetensors(rng.local)
    else:
        try:
            states = load_safetensors_bytes(rng.read_bytes())
        except Exception as e:  # safetensors raises its own error types for truncated or malformed files
            raise CheckpointError(f"{rng}: cannot read: {e}") from e
    rank = dist.get_rank()
    torch.set_rng_state(states[f"cpu.{rank}"])
    if f"cuda.{rank}" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[f"cuda.{rank}"])
