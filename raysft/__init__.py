"""raysft: distributed supervised fine-tuning of LLaMA-style chat models with FSDP2 on Ray Train.

Data path, one module each: config → data (tokenize to parquet) → dataloader → model → parallelize →
trainer (the loop) → checkpoint → launch (Ray) → hf_export.
"""

from raysft.config import TrainConfig, load_config
from raysft.hf_export import export
from raysft.launch import train

__all__ = ["TrainConfig", "export", "load_config", "train"]
