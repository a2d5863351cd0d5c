"""raysft: distributed supervised fine-tuning of LLaMA-style chat models with FSDP2 on Ray Train.

A package per role, in the order data flows: config → data (tokenize to parquet, micro-batches) → model →
parallel (the layout, FSDP2) → training (the loop) → checkpoint → launch (Ray, or torchrun) → hf (export); tools
(plan, chat, report) around a run. docs/ARCHITECTURE.md draws the picture.
"""

from raysft.config import TrainConfig, load_config
from raysft.hf.export import export

__all__ = ["TrainConfig", "export", "load_config", "train"]


def __getattr__(name: str):
    """`raysft.train` imports Ray on first use: the worker run (raysft.run) and export work without it."""
    if name == "train":
        from raysft.launch.ray_driver import train

        return train
    raise AttributeError(f"module 'raysft' has no attribute {name!r}")
