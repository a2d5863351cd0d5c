"""The run configuration: what can be set, how it is read and what it must pass.

Modules, by role (each imports only those above it in this list):
  gen_eval  the `eval` section (generation evaluation of checkpoints), a module of its own beside sections
  live      the `live` section (live fault tolerance under Ray), a module of its own beside sections
  sections  one small dataclass per component (model, data, train, parallel, checkpoint, scaling, run, metrics, dpo,
            eval, live), composed into TrainConfig; their docstrings are the configuration reference
            (reference_markdown)
  checks    the checks beyond types, one function per section (check_train, check_data, ...) and then those that
            join sections; the parallel layout's, for every worker count, asked of raysft.distributed.layout's
            ParallelDims
  load      YAML and `--set section.key=value` overrides into the dataclasses, each value's type checked, then
            the checks: load_config and config_from_dict are the only ways in
"""

from raysft.config.checks import best_mode, data_sources
from raysft.config.gen_eval import SCORERS, GenEvalConfig
from raysft.config.live import LiveConfig
from raysft.config.load import config_from_dict, load_config
from raysft.config.sections import (
    ATTN_IMPLEMENTATIONS,
    BUILTIN,
    LOSS_SPIKE_MIN_HISTORY,
    LOSS_SPIKE_WINDOW,
    TRACKERS,
    CheckpointConfig,
    DataConfig,
    DpoConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    Precision,
    RunConfig,
    ScalingConfig,
    TrainConfig,
    TrainLoopConfig,
    reference_markdown,
)
from raysft.errors import ConfigError

__all__ = [
    "ATTN_IMPLEMENTATIONS", "BUILTIN", "LOSS_SPIKE_MIN_HISTORY", "LOSS_SPIKE_WINDOW", "SCORERS", "TRACKERS",
    "CheckpointConfig", "ConfigError", "DataConfig", "DpoConfig", "GenEvalConfig", "LiveConfig", "LoraConfig",
    "MetricsConfig", "ModelConfig", "ParallelConfig", "Precision", "RunConfig", "ScalingConfig", "TrainConfig",
    "TrainLoopConfig",
    "best_mode", "config_from_dict", "data_sources", "load_config", "reference_markdown",
]
