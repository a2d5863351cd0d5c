"""The training loss: next-token cross-entropy summed over the assistant tokens of a micro-batch.

The trainer divides the sum by the loss tokens of the whole global batch (see `Trainer.train_step`), so the
gradient is the same for any split into workers and micro-batches.

Computing it from the model's logits costs a (tokens × vocabulary) tensor in the compute dtype and again in fp32,
for every position, padding and prompt included: with a 128k vocabulary that is most of a step's activation
memory. `chunked_loss_sum` instead takes the final hidden states at the positions whose next token is a label
(found on the CPU, `loss_inputs`), and runs the LM head and the cross-entropy over `chunk_tokens` of them at a time,
each chunk upcast to fp32 inside the chunk and recomputed in the backward pass (activation checkpointing), so that
at most one chunk's logits exist at any time.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig

from raysft.config import ConfigError
from raysft.data import IGNORE_INDEX

METHOD = "chunked_loss_sum"


def loss_inputs(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """On the CPU, from a collated micro-batch's labels (batch, seq): the flat positions (into batch × seq) whose
    next token is a label, and those labels. The positions' count sets the chunks without a device sync."""
    targets = labels[:, 1:]
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    return {"loss_positions": rows * labels.shape[1] + cols, "loss_targets": targets[rows, cols]}


def full_logits_loss_sum(model: nn.Module, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    """The loss from the model's full logits, upcast to fp32 (what `train.loss_chunk_tokens: 0` selects)."""
    logits = model(**batch, use_cache=False).logits  # no KV cache in training; the export keeps it
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def check_chunked_loss(config: PretrainedConfig) -> None:
    """ConfigError for a model whose logits are more than its LM head's output in a way the chunked loss does not
    repeat (Cohere's logit_scale); final_logit_softcapping (Gemma-2) it applies as the model does."""
    if getattr(config.get_text_config(), "logit_scale", None):
        raise ConfigError(f"config key 'train.loss_chunk_tokens': the model's config sets logit_scale="
                          f"{config.get_text_config().logit_scale}, which the chunked loss does not apply: set "
                          "train.loss_chunk_tokens: 0 to take the loss from the model's own logits")


def install_chunked_loss(model: nn.Module, chunk_tokens: int) -> None:
    """Give the (FSDP-wrapped) causal LM a `chunked_loss_sum(**batch)` method that runs as one of its forwards:
    FSDP gathers the root's parameters (embeddings, final norm, LM head) around it like around `forward`, so the
    LM head may be used outside `forward` without reading a resharded weight."""
    check_chunked_loss(model.config)
    setattr(model, METHOD, types.MethodType(_chunked_loss_sum, model))
    model.loss_chunk_tokens = chunk_tokens
    model.loss_softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    register_fsdp_forward_method(model, METHOD)  # a no-op on a model that is not FSDP-wrapped


def _chunked_loss_sum(self: nn.Module, loss_positions: torch.Tensor, loss_targets: torch.Tensor,
                      **batch) -> torch.Tensor:
    hidden = self.get_decoder()(**batch, use_cache=False).last_hidden_state
    hidden = hidden.flatten(0, 1).index_select(0, loss_positions)  # (loss tokens, hidden)
    head, chunk = self.get_output_embeddings(), self.loss_chunk_tokens
    total = None
    # at least one (maybe empty) chunk: a micro-batch without loss tokens still backpropagates through the model,
    # so that FSDP reduces gradients on every rank alike
    for start in range(0, max(1, len(loss_targets)), chunk):
        part = checkpoint(chunk_cross_entropy, head, hidden[start : start + chunk], loss_targets[start : start + chunk],
                          self.loss_softcap, use_reentrant=False)
        total = part if total is None else total + part
    return total


def chunk_logits(head: nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The chunk's logits, upcast to fp32 as the loss takes them."""
    logits = head(hidden)
    if softcap:  # Gemma-2's final_logit_softcapping, in the compute dtype as the model's own forward does
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float()


def chunk_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                        softcap: float | None) -> torch.Tensor:
    """The chunk's cross-entropy in fp32, summed."""
    return F.cross_entropy(chunk_logits(head, hidden, softcap), targets, reduction="sum")


def micro_batch_loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """The micro-batch's summed loss: chunked when `batch` carries `loss_inputs`, else from the full logits."""
    if "loss_positions" in batch:
        return getattr(model, METHOD)(**batch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return full_logits_loss_sum(model, inputs, batch["labels"])
