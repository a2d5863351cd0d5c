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

import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import (
    TokenizedDataset,
    collate,
    micro_batches,
    pair_lengths,
    pair_rows,
    sample_lengths,
    to_device,
)
from raysft.distributed.layout import SequenceShard
from raysft.model.lora import adapters_disabled
from raysft.model.preference_loss import (
    PAIR_METRICS,
    REWARD_METRICS,
    pair_losses,
    reward_sums,
    sequence_logps,
    sequence_loss_inputs,
)
from raysft.training.metrics import StepResult


def pair_batch(batch: dict) -> dict:
    """A collated micro-batch of pairs as the model's `sequence_nll` takes it: the labels replaced by each label
    token's position and sequence."""
    batch.update(sequence_loss_inputs(batch.pop("labels"), batch.get("cu_seq_lens_q")))
    return batch


class PreferenceStep:
    """The DPO objective on one worker. `reference` holds every store row's reference log-probability
    (raysft.training.reference); None with LoRA, whose reference is the base with the adapters off. `shard` is this
    worker's data-parallel place, `world_size` every worker FSDP averages the gradients over."""

    def __init__(self, cfg: TrainConfig, dataset: TokenizedDataset, reference: torch.Tensor | None,
                 shard: SequenceShard, world_size: int, device: torch.device, pad_id: int):
        self.cfg, self.dataset, self.reference = cfg, dataset, reference
        self.dp_rank, self.dp_size, self.world_size = shard.dp_rank, shard.dp_size, world_size
        self.device, self.pad_id = device, pad_id
        self.answer_tokens = torch.as_tensor(dataset.num_loss_tokens, dtype=torch.float32)

    @functools.cached_property
    def pair_lengths(self) -> np.ndarray:
        """Each pair's token count, both answers: what a token budget cuts pairs by."""
        return pair_lengths(self.dataset)

    def forward_backward(self, model: nn.Module, pairs: np.ndarray,
                         backward: Callable[[torch.Tensor], None]) -> StepResult:
        """Forward and `backward` (the trainer's loss scaling) of every micro-batch of this worker, its pairs of the
        global batch cut as SFT cuts samples (a pure function of the global batch); each micro-batch's loss times
        the world size, because FSDP averages the gradients over every worker. Its metrics: PAIR_METRICS' shares
        and the step's pairs."""
        o, t = self.cfg.dpo, self.cfg.train
        step_rows = pair_rows(pairs)
        chosen_total, rejected_total = (max(1.0, float(self.answer_tokens[torch.as_tensor(step_rows[k::2])].sum()))
                                        for k in (0, 1))
        loss_sum = torch.zeros((), device=self.device)
        sums = torch.zeros(len(PAIR_METRICS), dtype=torch.float64, device=self.device)
        lengths: list[int] = []
        computed = 0
        parts = micro_batches(pairs, self.pair_lengths, self.dp_rank, self.dp_size, t.micro_batch_size,
                              t.micro_batch_tokens)
        for i, part in enumerate(parts):
            rows = pair_rows(part)
            batch = collate(self.dataset, rows, self.pad_id, self.cfg.data.packing)
            lengths += sample_lengths(batch)
            computed += batch["input_ids"].numel()
            batch = to_device(pair_batch(batch), self.device)
            model.set_requires_gradient_sync(i == len(parts) - 1)  # reduce once per optimizer step
            logps, logit_sums = sequence_logps(model, batch, len(rows))
            ref = reference_logps_of(self.reference, model, batch, rows, self.device)
            tokens = self.answer_tokens[torch.as_tensor(rows)].to(self.device)
            losses = pair_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], tokens[0::2], tokens[1::2], o)
            loss = losses.sum() / len(pairs)
            if o.sft_weight:
                loss = loss - o.sft_weight * logps[0::2].sum() / chosen_total
            backward(loss * self.world_size)
            loss_sum += loss.detach()
            sums += torch.cat([reward_sums(logps[0::2], logps[1::2], ref[0::2], ref[1::2], o.beta),
                               torch.stack([logit_sums[0::2].sum(), logit_sums[1::2].sum()]).double()])
        # the rewards are means over the step's pairs, the logits over its chosen and its rejected answer tokens
        divisors = torch.tensor([len(pairs)] * len(REWARD_METRICS) + [chosen_total, rejected_total],
                                dtype=torch.float64, device=self.device)
        return StepResult(loss_sum, 1, lengths, computed, means=dict(zip(PAIR_METRICS, sums / divisors, strict=True)),
                          host={"pairs": len(pairs)})


def reference_logps_of(reference: torch.Tensor | None, model: nn.Module, batch: dict, rows: np.ndarray,
                       device: torch.device) -> torch.Tensor:
    """The reference log-probabilities of `rows` (their `batch`): read from the store's `reference` file, or with
    LoRA (None) computed by `model` with its adapters off, without gradients. Training's and validation's alike."""
    if reference is not None:
        return reference[torch.as_tensor(rows)].to(device, torch.float32)
    with torch.no_grad(), adapters_disabled(model):
        return sequence_logps(model, batch, len(rows))[0]
