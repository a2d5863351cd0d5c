"""One SFT step's forward and backward on this worker (train.objective sft), between the trainer's batch and its
clip-and-step; DPO's is raysft.training.preference.

The global batch is train.global_batch_size samples. This worker's are cut into micro-batches (the dataloader's
micro_batches: micro_batch_size samples, or rows of about micro_batch_tokens tokens), and the workers of a sequence
group take the same samples, each its own slice of them (raysft.parallel.sequence). The step's loss is the sum of the
cross-entropy over the global batch's assistant tokens divided by their count, so the gradient is the same for any
split into workers, micro-batches and sequence slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import TokenizedDataset, collate, micro_batches, sample_lengths, to_device
from raysft.distributed.layout import SequenceShard
from raysft.model.loss import micro_batch_loss_sum
from raysft.parallel.sequence import model_batch
from raysft.training.metrics import StepResult


class SFTStep:
    """The SFT objective on one worker: `dataset` is the training store, `shard` this worker's data-parallel and
    sequence place, `world_size` every worker FSDP averages the gradients over (sequence groups included)."""

    def __init__(self, cfg: TrainConfig, dataset: TokenizedDataset, shard: SequenceShard, world_size: int,
                 device: torch.device, pad_id: int):
        self.cfg, self.dataset, self.shard, self.world_size = cfg, dataset, shard, world_size
        self.device, self.pad_id = device, pad_id

    def forward_backward(self, model: nn.Module, global_batch: np.ndarray, backward: Callable[[torch.Tensor], None],
                         share: tuple[int, int] | None = None) -> StepResult:
        """Forward and `backward` (the trainer's loss scaling) of every micro-batch of this worker. Each
        micro-batch's loss is normalized by the assistant tokens of the whole global batch, times the world size
        because FSDP averages the gradients over every worker. `share` (rank, count): a replica group of one
        worker's place among the groups of a live quorum (raysft.training.live), which sums the gradients."""
        loss_tokens = max(1, int(self.dataset.num_loss_tokens[global_batch].sum()))
        loss_sum = torch.zeros((), device=self.device)
        lengths: list[int] = []
        computed = 0
        for batch, sizes, last in self._micro_batches(global_batch, share):
            lengths += sizes
            computed += batch["input_ids"].numel()
            model.set_requires_gradient_sync(last)  # reduce once per optimizer step
            ce = micro_batch_loss_sum(model, batch)
            backward(ce * self.world_size / loss_tokens)
            loss_sum += ce.detach()
        return StepResult(loss_sum, loss_tokens, lengths, computed)

    def _micro_batches(self, global_batch: np.ndarray,
                       share: tuple[int, int] | None = None) -> Iterator[tuple[dict, list[int], bool]]:
        """This worker's micro-batches on the device, each with its samples' lengths and whether it is the last.
        Each is collated (and, on CUDA, pinned and copied without blocking) while the device still runs the
        previous one's backward. The first worker of a sequence group counts the samples' lengths in the metrics.
        The cut reads train.micro_batch_tokens at every step."""
        t, shard = self.cfg.train, self.shard
        rank, count = share or (shard.dp_rank, shard.dp_size)
        parts = micro_batches(global_batch, self.dataset.num_tokens, rank, count, t.micro_batch_size,
                              t.micro_batch_tokens)
        for i, indices in enumerate(parts):
            batch = collate(self.dataset, indices, self.pad_id, self.cfg.data.packing)
            sizes = sample_lengths(batch) if shard.sp_rank == 0 else []
            batch = model_batch(batch, shard, self.pad_id, bool(t.loss_chunk_tokens))
            yield to_device(batch, self.device), sizes, i == len(parts) - 1
