"""What kind of directory a path is, told by the files it holds: the one answer that chat, export, the evaluation
and the CLI act on. raysft's directories are Hugging Face model directories with files of raysft's own beside them:

  checkpoint  trainer_state.json or manifest.json: a raysft checkpoint, full or sharded (its trainer state says
              which, and whether it holds LoRA adapters only)
  partial     a checkpoint's training files without either: its weights cannot be checked against anything
  adapters    adapter_config.json: a peft adapter directory (a LoRA checkpoint's export)
  model       config.json: a Hugging Face model directory (a full export among them)

None is none of these: a run directory, for one, holds its checkpoints below it (run_or_checkpoint_in finds them).
An export of either form holds raysft_export.json too: which checkpoint, which step (is_export). Whether a model
directory holds a sharded checkpoint's DCP files, which no Hugging Face load reads, is raysft.hf.files' check on
any model directory (model.path among them), below the checkpoint package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from raysft.checkpoint import MANIFEST_FILE, STATE_FILE, TRAINING_FILES
from raysft.checkpoint.discovery import RUN_FILE
from raysft.storage import Location, location

CONFIG_FILE = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
EXPORT_FILE = "raysft_export.json"  # marks a directory raysft exported: which checkpoint, which step

Kind = Literal["checkpoint", "partial", "adapters", "model"]


def is_checkpoint(path: str | os.PathLike | Location) -> bool:
    """Whether the path holds a checkpoint's record (trainer_state.json or manifest.json)."""
    where = location(path)
    return (where / STATE_FILE).exists() or (where / MANIFEST_FILE).exists()


def kind(path: str | os.PathLike | Location) -> Kind | None:
    """The kind of directory at `path` (the module's list, in that order of precedence), or None."""
    where = location(path)
    if is_checkpoint(where):
        return "checkpoint"
    if any((where / name).exists() for name in TRAINING_FILES):
        return "partial"
    if (where / ADAPTER_CONFIG).is_file():
        return "adapters"
    if (where / CONFIG_FILE).is_file():
        return "model"
    return None


def is_export(path: str | os.PathLike | Location) -> bool:
    return (location(path) / EXPORT_FILE).is_file()


def run_or_checkpoint_in(root: Path) -> tuple[str, Path] | None:
    """("run" or "checkpoint", its directory) for the first raysft run or checkpoint at or below `root`, by the
    record that marks it (raysft_run.json, trainer_state.json); None if it holds neither."""
    for marker, what in ((RUN_FILE, "run"), (STATE_FILE, "checkpoint")):
        found = next(root.rglob(marker), None)
        if found is not None:
            return what, found.parent
    return None
