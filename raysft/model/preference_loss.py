"""The preference loss: each answer's log-probability under the model, and DPO's and IPO's loss per pair.

An answer's log-probability is the sum over its label tokens of log p(token | everything before it), in fp32. The
model returns it for every sequence of a micro-batch at once (`sequence_nll`, the negative): the final hidden
states are taken at the label positions (found on the CPU, `sequence_loss_inputs`), the LM head and the
cross-entropy run over `train.loss_chunk_tokens` of them at a time as the SFT loss does (raysft.model.loss), and the
per-token values are summed into their sequences. A packed row holds many sequences: its cumulative lengths say
which. `train.loss_chunk_tokens: 0` takes the values from the model's full logits instead. Beside it, without
gradient, each sequence's sum over its label positions of the mean logit over the vocabulary: TRL's `logits/*`.

The loss per pair follows TRL's DPOTrainer (loss_type "sigmoid" and "ipo", and "sft" as `dpo.sft_weight`); the
trainer sums it over a micro-batch's pairs and divides by the pairs of the global batch, so the step's loss is the
mean over the global batch's pairs for any split into workers and micro-batches.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

from raysft.config import DpoConfig
from raysft.data import IGNORE_INDEX
from raysft.model.loss import check_chunked_loss, chunk_logits

METHOD = "sequence_nll"
# The step's means over its pairs (REWARD_METRICS) and over the label tokens of its chosen and rejected answers
# (LOGIT_METRICS), under TRL's names.
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")
LOGIT_METRICS = ("logits/chosen", "logits/rejected")
PAIR_METRICS = REWARD_METRICS + LOGIT_METRICS


def sequence_loss_inputs(labels: torch.Tensor, cu_seq_lens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """On the CPU, from a collated micro-batch's labels (batch, seq): the flat positions whose next token is a
    label, those labels, and the sequence each belongs to (a padded batch's row; in a packed row, the sample that
    `cu_seq_lens` places it in)."""
    targets = labels[:, 1:]
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    sequence = rows if cu_seq_lens is None else torch.searchsorted(cu_seq_lens[1:], cols + 1, right=True)
    return {"loss_positions": rows * labels.shape[1] + cols, "loss_targets": targets[rows, cols],
            "loss_sequence": sequence}


def install_sequence_nll(model: nn.Module, chunk_tokens: int) -> None:
    """Give the (FSDP-wrapped) causal LM a `sequence_nll(num_sequences, loss_positions, loss_targets,
    loss_sequence, **batch)` method that runs as one of its forwards (FSDP gathers the root's parameters around
    it), chunked over `chunk_tokens` label tokens (0: from the full logits). It returns each sequence's summed
    label NLL and, without gradient, its summed mean logits (`_chunk_nll`)."""
    if chunk_tokens:
        check_chunked_loss(model.config)
    setattr(model, METHOD, types.MethodType(_sequence_nll, model))
    model.sequence_chunk_tokens = chunk_tokens
    model.loss_softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    register_fsdp_forward_method(model, METHOD)


def _sequence_nll(self: nn.Module, num_sequences: int, loss_positions: torch.Tensor, loss_targets: torch.Tensor,
                  loss_sequence: torch.Tensor, **batch) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = self.sequence_chunk_tokens
    if not chunk:
        logits = self(**batch, use_cache=False).logits
        token_nll, mean_logits = _token_nll(logits.flatten(0, 1).index_select(0, loss_positions).float(),
                                            loss_targets)
    else:
        hidden = self.get_decoder()(**batch, use_cache=False).last_hidden_state
        hidden = hidden.flatten(0, 1).index_select(0, loss_positions)
        head = self.get_output_embeddings()
        # at least one (maybe empty) chunk, so that every rank backpropagates through the model alike
        parts = [checkpoint(_chunk_nll, head, hidden[s : s + chunk], loss_targets[s : s + chunk], self.loss_softcap,
                            use_reentrant=False) for s in range(0, max(1, len(loss_targets)), chunk)]
        token_nll, mean_logits = (torch.cat(values) for values in zip(*parts, strict=True))
    sums = torch.zeros(num_sequences, dtype=token_nll.dtype, device=token_nll.device)
    return sums.index_add(0, loss_sequence, token_nll), sums.index_add(0, loss_sequence, mean_logits)


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
               softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _token_nll(chunk_logits(head, hidden, softcap), targets)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's NLL from its fp32 logits, and (no gradient) the mean of those logits over the vocabulary."""
    return F.cross_entropy(logits, targets, reduction="none"), logits.detach().mean(-1)


DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of the policy off (dpo.disable_dropout): dropout layers (peft's lora_dropout among them) get
    p = 0, as TRL's disable_dropout_in_model does, and so does each module's float `attention_dropout` (`dropout` in
    OPT), the probability LLaMA-style attention hands its kernel in training mode, which no nn.Dropout holds. The
    model's config keeps its values, so a checkpoint or an export says what the architecture was."""
    for module in model.modules():
        if isinstance(module, DROPOUT_LAYERS):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def sequence_logps(model: nn.Module, batch: dict, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed label log-probability (fp32), from a batch with `sequence_loss_inputs`, and (without
    gradient) its sum over the label positions of the mean logit over the vocabulary."""
    nll, logit_sums = getattr(model, METHOD)(num_sequences, **batch)
    return -nll, logit_sums


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, cfg: DpoConfig) -> torch.Tensor:
    """Each pair's preference loss from the policy's and the reference's answer log-probabilities."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if cfg.loss == "ipo":  # the log-ratios per answer token, as TRL normalizes them
        margin = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        return (margin - 1 / (2 * cfg.beta)) ** 2
    return -F.logsigmoid(cfg.beta * (chosen_ratio - rejected_ratio))


def reward_sums(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                beta: float) -> torch.Tensor:
    """REWARD_METRICS summed over the pairs (the step divides by its pairs): the implicit rewards beta · log-ratio,
    how often the chosen one's is higher, their margin, and the policy's log-probabilities."""
    chosen, rejected = chosen.detach(), rejected.detach()
    chosen_reward, rejected_reward = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return torch.stack([chosen_reward.sum(), rejected_reward.sum(), (chosen_reward > rejected_reward).float().sum(),
                        (chosen_reward - rejected_reward).sum(), chosen.sum(), rejected.sum()]).double()
