"""The errors raysft raises for what a user can fix or must know, defined once, and which of them end a run.

Each message names the key, file, record or step at fault. The module imports nothing of raysft, so every layer
(config, data, the HF format, checkpoints, the loop, the launchers) raises the same classes.

RUN_ENDING is the one list of errors that no relaunch can change: every rank raises them together (or the driver
does, before any worker starts), so the torchrun entry prints one line and exits, and under Ray the workers end
the run on the first occurrence instead of letting Ray Train restart them into the same error.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or inconsistent; the message names the key."""


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and the record."""


class ModelDirError(ValueError):
    """A model or tokenizer directory that raysft will not read; the message names the file and the fault."""


class WeightsFileError(ValueError):
    """A safetensors file whose tensor cannot fill a parameter (absent, or of another shape); names both."""


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message names the path."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed on some rank (a full disk, a lost mount). Raised on every rank at once; the
    checkpoint is not complete and never reported, so the previous one stays the latest."""


class NonFiniteStateError(CheckpointSaveError):
    """The weights or optimizer state to be saved hold NaN or inf: nothing is written, and the checkpoints before
    stay the latest (retention never prunes them for it)."""


class TrainingDivergedError(RuntimeError):
    """train.max_skipped_steps steps in a row were skipped; the message names the step and what was wrong. The
    run ends (no restart would change it); its checkpoints are those of steps before the skips."""


RUN_ENDING: tuple[type[Exception], ...] = (ConfigError, CheckpointSaveError, TrainingDivergedError)


def run_ending_type(name: str) -> type[Exception]:
    """The RUN_ENDING class (or subclass) of that name: how an error written down by a worker is raised again on
    the driver as what it was."""
    todo = list(RUN_ENDING)
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    raise KeyError(name)
