"""Validation of a DPO run: the objective and the implicit rewards on held-out preference pairs.

The eval store is a preference store like the training one (data.eval_paths, or the pairs data.eval_fraction holds
out of data.paths), with reference log-probabilities of its own, computed by the same pass of the starting model
and kept beside it (raysft.training.reference); a LoRA run's reference is the base with the adapters off, as in
training. Every rank takes pairs rank, rank + W, ... in micro-batches of train.micro_batch_size pairs, without
gradients, the model in eval mode, as many micro-batches as every other rank (raysft.data.dataloader's
lockstep_micro_batches). The sums over all pairs of every rank make the metrics, so they do not depend on the
worker count:

  eval_loss                  the DPO (or IPO) loss, plus dpo.sft_weight times the chosen answers' mean token NLL:
                             the training objective, on held-out pairs
  eval/rewards/accuracies    the share of pairs whose chosen answer's implicit reward is higher
  eval/rewards/margins, eval/rewards/chosen, eval/rewards/rejected   means over the pairs, as TRL's eval_ metrics

As the SFT validation (raysft.training.evaluation) it leaves training as it found it: no training sample, no data
cursor, and the RNG states put back.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from raysft.config import TrainConfig
from raysft.data.dataloader import TokenizedDataset, collate, lockstep_micro_batches, pair_rows, to_device
from raysft.data.store import pairs_in
from raysft.model.preference_loss import pair_losses, reward_sums, sequence_logps
from raysft.training.preference import pair_batch, reference_logps_of

EVAL_REWARDS = ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/accuracies", "eval/rewards/margins")


class PreferenceEvaluator:
    """The held-out pairs of a DPO run; `reference`: every eval store row's reference log-probability (None with
    LoRA: the adapters off)."""

    def __init__(self, store: Path, cfg: TrainConfig, reference: torch.Tensor | None, rank: int, world_size: int,
                 device: torch.device, pad_id: int):
        self.dataset = TokenizedDataset(store)
        self.cfg, self.reference, self.device, self.pad_id = cfg, reference, device, pad_id
        self.rank, self.world_size = rank, world_size
        self.answer_tokens = torch.as_tensor(self.dataset.num_loss_tokens, dtype=torch.float32)

    @property
    def num_pairs(self) -> int:
        return pairs_in(len(self.dataset))

    def due(self, step: int, checkpoint_due: bool) -> bool:
        """Every train.eval_every_n_steps, and at every scheduled checkpoint (keep_best may rank by it)."""
        every = self.cfg.train.eval_every_n_steps
        return checkpoint_due or bool(every) and step % every == 0

    def run(self, model: nn.Module) -> dict:
        """Collective: eval_loss, EVAL_REWARDS, eval_pairs and eval_s (the evaluation's wall time)."""
        start = time.perf_counter()
        o = self.cfg.dpo
        cut = lockstep_micro_batches(np.arange(self.num_pairs), None, self.rank, self.world_size,
                                     self.cfg.train.micro_batch_size)
        chosen_tokens = max(1.0, float(self.answer_tokens[0::2].sum()))
        # loss, the sft term's NLL sum, then reward_sums' six sums (the first four are EVAL_REWARDS)
        sums = torch.zeros(8, dtype=torch.float64, device=self.device)
        cpu_rng, was_training = torch.get_rng_state(), model.training
        model.eval()
        try:
            with torch.no_grad():
                for part, real in cut:
                    rows = pair_rows(part)
                    batch = to_device(pair_batch(collate(self.dataset, rows, self.pad_id, self.cfg.data.packing)),
                                      self.device)
                    logps, _ = sequence_logps(model, batch, len(rows))
                    ref = reference_logps_of(self.reference, model, batch, rows, self.device)
                    tokens = self.answer_tokens[torch.as_tensor(rows)].to(self.device)
                    losses = pair_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], tokens[0::2], tokens[1::2],
                                         o)
                    if real:
                        sums += torch.cat([torch.stack([losses.sum(), -logps[0::2].sum()]).double(),
                                           reward_sums(logps[0::2], logps[1::2], ref[0::2], ref[1::2], o.beta)])
            dist.all_reduce(sums)
        finally:
            model.train(was_training)
            torch.set_rng_state(cpu_rng)
        n = max(1, self.num_pairs)
        loss = sums[0].item() / n + o.sft_weight * sums[1].item() / chosen_tokens
        return {"eval_loss": loss, **{name: sums[2 + k].item() / n for k, name in enumerate(EVAL_REWARDS)},
                "eval_pairs": self.num_pairs, "eval_s": round(time.perf_counter() - start, 4)}

