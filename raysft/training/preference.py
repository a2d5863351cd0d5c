"""One DPO step's forward and backward on this worker (train.objective dpo), between the trainer's batch and its
clip-and-step.

The global batch is train.global_batch_size pairs, drawn by the same cursor as SFT's samples. This worker's pairs
are cut into micro-batches as SFT cuts samples (train.micro_batch_size pairs, or train.micro_batch_tokens tokens of
both answers), and each micro-batch holds both answers of each of its pairs (raysft.data.dataloader.pair_rows).

Each micro-batch's loss is the sum of its pairs' losses divided by the pairs of the whole global batch, plus
`dpo.sft_weight` times its chosen answers' NLL divided by the chosen tokens of the whole global batch: the step's
loss and gradient are the means over the global batch (TRL's, for one device and one micro-batch), the same for any
split into workers and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import (
    TokenizedDataset,
    collate,
    pair_lengths,
    pair_rows,
    rank_micro_batches,
    sample_lengths,
    to_device,
    token_budget_micro_batches,
)
from raysft.model.lora import adapters_disabled
from raysft.model.preference_loss import (
    PAIR_METRICS,
    REWARD_METRICS,
    pair_losses,
    reward_sums,
    sequence_logps,
    sequence_loss_inputs,
)


def pair_batch(batch: dict) -> dict:
    """A collated micro-batch of pairs as the model's `sequence_nll` takes it: the labels replaced by each label
    token's position and sequence."""
    batch.update(sequence_loss_inputs(batch.pop("labels"), batch.get("cu_seq_lens_q")))
    return batch


@dataclass
class PairStep:
    """What a worker's part of a DPO step leaves for the trainer: its share of the step's loss and of each of the
    PAIR_METRICS (summed over the workers, the loss and the step's means), and the token counts of its
    micro-batches."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    lengths: list[int]
    computed_tokens: int


class PreferenceStep:
    """The DPO objective on one worker. `reference` holds every store row's reference log-probability
    (raysft.training.reference); None with LoRA, whose reference is the base with the adapters off."""

    def __init__(self, cfg: TrainConfig, dataset: TokenizedDataset, reference: torch.Tensor | None, dp_rank: int,
                 dp_size: int, device: torch.device, pad_id: int):
        self.cfg, self.dataset, self.reference = cfg, dataset, reference
        self.dp_rank, self.dp_size, self.device, self.pad_id = dp_rank, dp_size, device, pad_id
        self.answer_tokens = torch.as_tensor(dataset.num_loss_tokens, dtype=torch.float32)

    @property
    def num_pairs(self) -> int:
        return len(self.dataset) // 2

    def micro_batches(self, pairs: np.ndarray) -> list[np.ndarray]:
        """This worker's pairs of the global batch, cut as SFT cuts samples (a pure function of the global batch)."""
        t = self.cfg.train
        if t.micro_batch_tokens:
            return token_budget_micro_batches(pairs, pair_lengths(self.dataset), self.dp_rank, self.dp_size,
                                              t.micro_batch_tokens)
        return rank_micro_batches(pairs, self.dp_rank, self.dp_size, t.micro_batch_size)

    def forward_backward(self, model: nn.Module, pairs: np.ndarray,
                         backward: Callable[[torch.Tensor], None]) -> PairStep:
        """Forward and `backward` (the trainer's: loss scaling, × world size) of every micro-batch of this worker."""
        o = self.cfg.dpo
        step_rows = pair_rows(pairs)
        chosen_total, rejected_total = (max(1.0, float(self.answer_tokens[torch.as_tensor(step_rows[k::2])].sum()))
                                        for k in (0, 1))
        loss_sum = torch.zeros((), device=self.device)
        sums = torch.zeros(len(PAIR_METRICS), dtype=torch.float64, device=self.device)
        lengths: list[int] = []
        computed = 0
        parts = self.micro_batches(pairs)
        for i, part in enumerate(parts):
            rows = pair_rows(part)
            batch = collate(self.dataset, rows, self.pad_id, self.cfg.data.packing)
            lengths += sample_lengths(batch)
            computed += batch["input_ids"].numel()
            batch = to_device(pair_batch(batch), self.device)
            model.set_requires_gradient_sync(i == len(parts) - 1)  # reduce once per optimizer step
            logps, logit_sums = sequence_logps(model, batch, len(rows))
            ref = self._reference(model, batch, rows)
            tokens = self.answer_tokens[torch.as_tensor(rows)].to(self.device)
            losses = pair_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], tokens[0::2], tokens[1::2], o)
            loss = losses.sum() / len(pairs)
            if o.sft_weight:
                loss = loss - o.sft_weight * logps[0::2].sum() / chosen_total
            backward(loss)
            loss_sum += loss.detach()
            sums += torch.cat([reward_sums(logps[0::2], logps[1::2], ref[0::2], ref[1::2], o.beta),
                               torch.stack([logit_sums[0::2].sum(), logit_sums[1::2].sum()]).double()])
        # the rewards are means over the step's pairs, the logits over its chosen and its rejected answer tokens
        divisors = torch.tensor([len(pairs)] * len(REWARD_METRICS) + [chosen_total, rejected_total],
                                dtype=torch.float64, device=self.device)
        return PairStep(loss_sum, dict(zip(PAIR_METRICS, sums / divisors, strict=True)), lengths, computed)

    def _reference(self, model: nn.Module, batch: dict, rows: np.ndarray) -> torch.Tensor:
        if self.reference is not None:
            return self.reference[torch.as_tensor(rows)].to(self.device, torch.float32)
        with torch.no_grad(), adapters_disabled(model):
            return sequence_logps(model, batch, len(rows))[0]
