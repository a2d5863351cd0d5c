"""Validation: the loss over every label token of the eval store, on all workers, without gradients.

The eval store is tokenized like the training store (data.eval_paths, or the records data.eval_fraction holds out
of data.paths: raysft.data.store.split_copies) and read the same lazy way (dataloader.TokenizedDataset), so the eval set
is never held in memory. The loss is the training loss with the same labels: the sum of every label token's
cross-entropy over all workers, divided by the number of label tokens, so it does not depend on the worker count.

Evaluation leaves training exactly as it found it: it reads no training sample, moves no data cursor, and the RNG
states are put back afterwards (nothing in an eval forward should draw from them; a model with dropout would), so
a run with validation trains the same floats as one without, and resumes as exactly.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import TokenizedDataset, collate, lockstep_micro_batches, to_device
from raysft.distributed.layout import SequenceShard
from raysft.model.loss import micro_batch_loss_sum
from raysft.parallel.sequence import model_batch


class Evaluator:
    """Every rank's share of the eval store, walked in rounds of train.global_batch_size samples cut into
    micro-batches by training's own cut (raysft.data.dataloader.lockstep_micro_batches: micro_batch_size samples, or
    micro_batch_tokens tokens with packing); the workers of a sequence group share their group's samples, each its
    slice of them, as in training."""

    def __init__(self, store: Path, cfg: TrainConfig, shard: SequenceShard, device: torch.device, pad_id: int):
        self.dataset = TokenizedDataset(store)
        self.cfg, self.shard, self.device, self.pad_id = cfg, shard, device, pad_id
        self.rank, self.world_size = shard.dp_rank, shard.dp_size
        self.label_tokens = int(self.dataset.num_loss_tokens.sum())

    def due(self, step: int, checkpoint_due: bool) -> bool:
        """Every train.eval_every_n_steps, and at every scheduled checkpoint (keep_best ranks checkpoints by it)."""
        every = self.cfg.train.eval_every_n_steps
        return checkpoint_due or bool(every) and step % every == 0

    def run(self, model: nn.Module) -> dict:
        """Collective: {"eval_loss", "eval_tokens", "eval_s"}; eval_s is the wall time of the whole evaluation."""
        start = time.perf_counter()
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                n, per_round = len(self.dataset), self.cfg.train.global_batch_size
                for first in range(0, n, per_round):
                    chunk = np.arange(first, min(n, first + per_round))
                    for indices, real in self._micro_batches(chunk):
                        batch = collate(self.dataset, indices, self.pad_id, self.cfg.data.packing)
                        batch = model_batch(batch, self.shard, self.pad_id, bool(self.cfg.train.loss_chunk_tokens))
                        loss = micro_batch_loss_sum(model, to_device(batch, self.device))
                        if real:
                            total += loss.double()
            dist.all_reduce(total)
        finally:
            model.train(was_training)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
        return {"eval_loss": total.item() / max(1, self.label_tokens), "eval_tokens": self.label_tokens,
                "eval_s": round(time.perf_counter() - start, 4)}

    def _micro_batches(self, chunk: np.ndarray) -> list[tuple[np.ndarray, bool]]:
        """This rank's micro-batches of the chunk, as many as every other rank runs (the dataloader's
        lockstep_micro_batches); the loss of one that is not `real` is dropped."""
        t = self.cfg.train
        return lockstep_micro_batches(chunk, self.dataset.num_tokens, self.rank, self.world_size, t.micro_batch_size,
                                      t.micro_batch_tokens)
