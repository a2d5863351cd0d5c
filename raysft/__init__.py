"""raysft: distributed supervised fine-tuning of LLaMA-style chat models with FSDP2 on Ray Train.

A package per role, each importing only those before it in this order (tests/test_architecture.py holds them to it):
errors, storage → distributed (the rank layout, collectives, the local Ray) → config → hf (the file format) → data
(tokenize to parquet, micro-batches) → model → parallel (FSDP2, sequence parallelism, FP8) → checkpoint → training
(the loop) → products (export, adapters, a model loaded to answer) → evals → tools (plan, chat, report) → launch
(Ray, or torchrun) → the CLI and this package's face. docs/ARCHITECTURE.md draws the picture.
"""

__all__ = ["TrainConfig", "export", "load_config", "train"]


def __getattr__(name: str):
    """The package's face, imported on first use: `import raysft.<anything>` runs this module first, and Ray Train's
    controller imports raysft.launch.ray_controller without torch or transformers (whose import is seconds of every
    launch's start). `raysft.train` also imports Ray: the worker run (raysft.run) and export work without it."""
    if name in ("TrainConfig", "load_config"):
        from raysft import config

        return getattr(config, name)
    if name == "export":
        from raysft.products.export import export

        return export
    if name == "train":
        from raysft.launch.ray_driver import train

        return train
    raise AttributeError(f"module 'raysft' has no attribute {name!r}")
