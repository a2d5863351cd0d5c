"""torchtitan 0.3.0's own configs for the device check's torchtitan leg (bench/gpu/steps.py `titan`): its Llama-3
trainer at raysft's shapes, chosen the way torchtitan's users choose one:

    python -m torchtitan.train --module titan_config --config raysft_1b --training.steps 11 ...

(with bench/gpu on PYTHONPATH). What differs from raysft's `compiled` recipe is said in the check's JSON
(steps.TITAN_DIFFERENCES). The data is registered here as a torchtitan text dataset: the same conversations as
plain text in one JSON-lines file, which torchtitan's loader tokenizes and packs into rows of seq_len tokens.
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import TrainingConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

DATASET = "raysft_text"


def _load_json_lines(path: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=path, split="train")


DATASETS[DATASET] = DatasetConfig(path="", loader=_load_json_lines, sample_processor=lambda sample: sample["text"])


def _config(flavor: str, untied: bool) -> Trainer.Config:
    """Llama-3 of `flavor`, trained as the check trains raysft: AdamW, a short warmup, no activation checkpointing,
    no checkpoints, no validation, a log line every step. Shapes, batch and paths come as CLI flags."""
    spec = model_registry(flavor, attn_backend="varlen")  # one attention per packed document, as raysft's varlen
    if untied:
        spec.model.enable_weight_tying = False  # raysft's 1B shape has its own LM head (1.50B parameters)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        model_spec=spec,
        optimizer=default_adamw(lr=2e-5),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=4, seq_len=2048, steps=10),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
    )


def raysft_1b() -> Trainer.Config:
    """The Llama-3.2-1B shape (torchtitan's flavor "1B": 2048 wide, 16 layers, 32 heads, 8 KV heads, MLP 8192,
    vocab 128256), untied as raysft's."""
    return _config("1B", untied=True)


def raysft_toy() -> Trainer.Config:
    """torchtitan's debug model (256 wide, 6 layers, vocab 2048): the same leg on the CPU, for its smoke test."""
    return _config("debugmodel", untied=False)
