"""raysft: distributed supervised fine-tuning of LLaMA-style chat models with FSDP2 on Ray Train.

Data path, one module each: config → data (tokenize to parquet) → dataloader → model → parallelize →
trainer (the loop) → checkpointer → launch (Ray) or run (torchrun) → hf_export.
"""

from raysft.config import TrainConfig, load_config
from raysft.hf_export import export

__all__ = ["TrainConfig", "export", "load_config", "train"]


def __getattr__(name: str):
    """`raysft.train` imports Ray on first use: the worker run (raysft.run) and export work without it."""
    if name == "train":
        from raysft.launch import train

        return train
    raise AttributeError(f"module 'raysft' has no attribute {name!r}")
