"""`model.attn_implementation: varlen` on CPU: the per-sample reference path gives a packed row the loss and
gradients of the padded batch, and transformers builds no mask for it."""

import numpy as np
import pytest
import torch
from test_loss import Samples
from transformers import AutoModelForCausalLM, LlamaConfig

import raysft.attention  # noqa: F401  (registers "varlen")
from raysft.dataloader import collate
from raysft.loss import full_logits_loss_sum


def tiny_model(attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def loss_and_grads(model, batch):
    batch = dict(batch)
    model.zero_grad(set_to_none=True)
    loss = full_logits_loss_sum(model, batch, batch.pop("labels"))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_varlen_packed_rows_train_like_padded_batches():
    padded = loss_and_grads(tiny_model("sdpa"), collate(Samples, np.arange(4), 0))
    varlen_model = tiny_model("varlen")
    assert varlen_model.config._attn_implementation == "varlen"
    packed = collate(Samples, np.arange(4), 0, packing=True)
    varlen = loss_and_grads(varlen_model, packed)
    torch.testing.assert_close(varlen[0], padded[0])
    for name, g in varlen[1].items():
        torch.testing.assert_close(g, padded[1][name], msg=lambda m, n=name: f"{n}: {m}")
    # the boundaries are what keeps samples apart: one "sample" of the whole row is another loss
    leaky = {**packed, "cu_seq_lens_q": torch.tensor([0, 31], dtype=torch.int32), "cu_seq_lens_k": None}
    with torch.no_grad():
        inputs = {k: v for k, v in leaky.items() if k != "labels"}
        assert not torch.allclose(full_logits_loss_sum(varlen_model, inputs, leaky["labels"]), padded[0])


def test_varlen_needs_packed_batches():
    with pytest.raises(ValueError, match="data.packing"):
        tiny_model("varlen")(**{k: v for k, v in collate(Samples, np.arange(2), 0).items() if k != "labels"})
