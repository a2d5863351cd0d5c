"""Turning a checkpoint into a Hugging Face model directory that AutoModelForCausalLM.from_pretrained loads."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from raysft.checkpoint import MODEL_FILE, TRAINING_FILES, CheckpointError, read_trainer_state


def export(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Copy the model, config and tokenizer of a full checkpoint, leaving the training state behind.

    The directory appears complete or not at all (written beside it, then renamed); an existing non-empty
    directory is only replaced with overwrite=True.
    """
    ckpt, out = Path(checkpoint_dir), Path(out_dir).expanduser().resolve()
    read_trainer_state(ckpt)  # a raysft checkpoint of a format we know, or a clear error
    if not (ckpt / MODEL_FILE).is_file():
        raise CheckpointError(f"{ckpt}: no {MODEL_FILE}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in ckpt.iterdir():
            if f.is_file() and f.name not in TRAINING_FILES:
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
