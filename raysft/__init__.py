"""raysft: distributed supervised fine-tuning of LLaMA-style chat models with FSDP2 on Ray Train.

Data path: config → data (tokenize to parquet) → dataloader → model → parallelize → train (loop) →
checkpoint → launch (Ray) → export.
"""

from raysft.config import TrainConfig, load_config


def train(config: TrainConfig):
    """Run SFT on Ray; returns Ray's `Result`. See raysft.launch.train."""
    from raysft.launch import train as _train

    return _train(config)


def export(checkpoint_dir, out_dir, overwrite: bool = False):
    """Write a checkpoint as a Hugging Face model directory. See raysft.export.export."""
    from raysft.export import export as _export

    return _export(checkpoint_dir, out_dir, overwrite=overwrite)


__all__ = ["TrainConfig", "export", "load_config", "train"]
