"""The errors raysft raises for what a user can fix or must know, defined once, and which of them end a run.

Each message names the key, file, record or step at fault. The module imports nothing of raysft, so every layer
(config, data, the HF format, checkpoints, the loop, the launchers) raises the same classes.

RUN_ENDING is the one list of errors that no relaunch changes: a bad file, values that disagree, a refusal. A rank
that meets one (every rank together, or only some) ends the run on that first occurrence: the torchrun entry
prints one line and exits, and under Ray the rank records it in the run directory and Ray Train is told not to
restart the workers into the same error (raysft.launch.ray_worker). What a retry may not meet again is not in
it: an OSError of the storage (a mount or network hiccup), a worker or node lost, a collective that broke with
them. `ends_the_run` tells the two apart, as everything that decides it asks.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or inconsistent; the message names the key."""


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and the record."""


class SourceError(ValueError):
    """A source that cannot be read as conversations; the message names the path."""


class StoreFull(OSError):
    """The disk of data.store_dir filled up while a store was written; the message names the directory."""


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


class RunInUse(RuntimeError):
    """Another live launch holds the run (raysft.launch.lease)."""


class ClusterUnreachable(RuntimeError):
    """Nothing answers at the address in RAY_ADDRESS."""


class RayVersionError(ImportError):
    """The installed Ray is older than the one whose Ray Train API raysft uses; the message names both."""


class CannotPlaceWorkers(RuntimeError):
    """The Ray cluster cannot place the requested workers: too small, or busy for longer than Ray waits."""


RUN_ENDING: tuple[type[Exception], ...] = (ConfigError, DataError, SourceError, ModelDirError, WeightsFileError,
                                           CheckpointError, TrainingDivergedError)


def ends_the_run(error: BaseException) -> bool:
    """Whether no relaunch would change `error`: one of RUN_ENDING, unless it is a checkpoint that could not be
    read for an OSError (storage that may answer on the next try). A failed save ends the run whatever its cause:
    the run cannot go on past a checkpoint it cannot write, and the previous one stays the latest."""
    if not isinstance(error, RUN_ENDING):
        return False
    if isinstance(error, CheckpointError) and not isinstance(error, CheckpointSaveError):
        return not isinstance(error.__cause__, OSError)
    return True


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
