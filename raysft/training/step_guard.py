"""Whether an optimizer step may change the model: the skip rule for non-finite steps and loss spikes.

A step whose loss or gradient norm is NaN or inf on any rank, or whose loss exceeds `train.loss_spike_factor` times
the median of recent steps' losses, is skipped on every rank together: no optimizer step (weights and AdamW state,
step counts included, stay as they were), no learning-rate schedule step. The decision needs the loss summed over
the ranks, so it costs one small all-reduce and one read on the host per step, as fp16's loss scaler costs already.
The data cursor still moves past the batch (the next step takes the next one) and the step counts toward
train.max_steps, as Megatron-LM counts its skipped iterations. Too many skips in a row end the run with
TrainingDivergedError: a run whose every step is skipped is not training.

The guard's state (the recent losses and the skips in a row) goes into each checkpoint's trainer state, so that a
resumed run decides every step as the uninterrupted run would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
import torch.distributed as dist

from raysft.config import LOSS_SPIKE_MIN_HISTORY, LOSS_SPIKE_WINDOW, TrainLoopConfig
from raysft.errors import TrainingDivergedError


class StepGuard:
    """Decides, the same on every rank, whether each step is applied; counts the skips in a row."""

    def __init__(self, cfg: TrainLoopConfig):
        self.max_skipped, self.spike_factor = cfg.max_skipped_steps, cfg.loss_spike_factor
        self.recent: deque[float] = deque(maxlen=LOSS_SPIKE_WINDOW)  # losses of applied steps
        self.in_a_row = 0
        self.diverged: TrainingDivergedError | None = None  # set when the skips in a row reach max_skipped

    def state_dict(self) -> dict:
        """JSON-ready: the losses of the recent applied steps, oldest first, and the skips in a row."""
        return {"recent": list(self.recent), "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Take up a state that raysft.checkpoint.state.step_guard_problem accepts."""
        self.recent = deque(state["recent"], maxlen=LOSS_SPIKE_WINDOW)
        self.in_a_row = state["in_a_row"]

    def check(self, step: int, loss_sum: torch.Tensor, loss_tokens: int, grad_norm: torch.Tensor) -> str | None:
        """Collective: why step `step` must be skipped on every rank, or None to apply it. `loss_sum` is this
        rank's summed loss, `loss_tokens` the global batch's, `grad_norm` the global norm (NaN if any rank's
        gradients hold one)."""
        norm = grad_norm.detach().reshape(()).float()
        if dist.get_rank():  # the norm is global already: summed, only rank 0's counts (exactly), or a non-finite one
            norm = torch.where(torch.isfinite(norm), torch.zeros_like(norm), norm)
        values = torch.stack([loss_sum.detach().reshape(()).float(), norm])
        dist.all_reduce(values)  # a NaN or inf on any rank reaches every rank
        total, norm = values.tolist()
        loss = total / loss_tokens
        reason = None
        if not math.isfinite(loss) or not math.isfinite(norm):
            wrong = [name for name, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v)]
            reason = f"non-finite {' and '.join(wrong)} (loss {loss}, gradient norm {norm})"
        elif self.spike_factor and len(self.recent) >= LOSS_SPIKE_MIN_HISTORY:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                reason = (f"loss spike (loss {loss:.4f} > train.loss_spike_factor {self.spike_factor:g} × median "
                          f"{median:.4f} of the last {len(self.recent)} applied steps)")
        if reason is None:
            self.recent.append(loss)
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.max_skipped and self.in_a_row >= self.max_skipped:
            self.diverged = TrainingDivergedError(
                f"step {step}: {self.in_a_row} steps in a row skipped (train.max_skipped_steps={self.max_skipped}), "
                f"the last for {reason}. The weights are those of step {step - self.in_a_row}; lower train.lr, "
                "check the data of these steps, or raise train.max_skipped_steps (0: never stop)")
        return reason

