"""Ray Train, imported in one place: the installed Ray's version is checked first, then the names raysft uses.

raysft uses Ray Train's V2 API as Ray 2.60 has it: asynchronous validation (`ValidationConfig`,
`ValidationTaskConfig` and `report(validation=...)`), checkpoint upload modes, controller callbacks. Those are
alpha APIs that older releases lack or shape otherwise, so an older Ray would fail with an ImportError of some name
deep in a launch, or worse, run with another behaviour. Here it is refused by name instead (RayVersionError, with
the installed and the needed version), before Ray Train is imported. pyproject.toml's floor is the same RAY_FLOOR.

ray.train.torch is imported on first use (a module `__getattr__`): it imports torch, which Ray Train's controller,
importing raysft.launch.ray_controller through this module, must not pay for on every launch.
"""

from __future__ import annotations

import re

import ray

from raysft.errors import RayVersionError

RAY_FLOOR = (2, 60)  # pyproject.toml's `ray[default,train]>=2.60`


def check_ray_version(installed: str) -> None:
    """RayVersionError naming `installed` (ray.__version__) and RAY_FLOOR when it is older; a version that does not
    parse (a source build) is let through."""
    found = re.match(r"(\d+)\.(\d+)", installed)
    if found and (int(found[1]), int(found[2])) < RAY_FLOOR:
        need = ".".join(map(str, RAY_FLOOR))
        raise RayVersionError(f"raysft needs Ray {need} or newer (Ray Train's validation API), but Ray {installed} "
                              f"is installed: pip install 'ray[default,train]>={need}'")


check_ray_version(ray.__version__)

from ray.train import (  # noqa: E402  (after the check: an older Ray is named, not a missing name)
    Checkpoint,
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    LoggingConfig,
    Result,
    RunConfig,
    ScalingConfig,
    UserCallback,
    ValidationConfig,
    ValidationTaskConfig,
)
from ray.train.v2.api.report_config import CheckpointUploadMode  # noqa: E402

__all__ = ["RAY_FLOOR", "Checkpoint", "CheckpointConfig", "CheckpointUploadMode", "ControllerError", "FailureConfig",
           "LoggingConfig", "Result", "RunConfig", "ScalingConfig", "UserCallback", "ValidationConfig",
           "ValidationTaskConfig", "check_ray_version"]  # and TorchConfig, TorchTrainer: __getattr__


def __getattr__(name: str):
    """TorchConfig and TorchTrainer, from ray.train.torch when first asked for (it imports torch)."""
    if name in ("TorchConfig", "TorchTrainer"):
        import ray.train.torch

        return getattr(ray.train.torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
