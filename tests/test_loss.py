"""The chunked loss against the loss from the model's full logits: same value and gradients, with and without
FSDP (a gloo group of one process: the LM head is used while FSDP holds the root's parameters gathered)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from raysft.data.dataloader import collate
from raysft.model.loss import full_logits_loss_sum, install_chunked_loss, loss_inputs, micro_batch_loss_sum


class Samples:
    """Four samples whose first half is prompt (no labels)."""

    input_ids = [torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                 for n in (7, 12, 3, 9)]
    labels = [[-100] * (len(ids) // 2) + ids[len(ids) // 2:] for ids in input_ids]


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def losses_and_grads(model, batch, chunk_tokens):
    """(loss, {name: grad}) of the full-logits path (chunk_tokens 0) or the chunked one."""
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    labels = batch.pop("labels")
    if chunk_tokens:
        install_chunked_loss(model, chunk_tokens)
        loss = micro_batch_loss_sum(model, {**batch, **loss_inputs(labels)})
    else:
        loss = full_logits_loss_sum(model, batch, labels)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters()}
    return loss.detach(), grads


def test_loss_inputs_are_the_positions_whose_next_token_is_a_label():
    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, -100, -100]])
    got = loss_inputs(labels)
    assert got["loss_positions"].tolist() == [1, 2, 4] and got["loss_targets"].tolist() == [5, 6, 7]


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_loss_equals_the_full_logits_loss_in_value_and_gradients(packing):
    model = tiny_model()
    batch = collate(Samples, np.arange(4), 0, packing)
    ref_loss, ref_grads = losses_and_grads(model, batch, 0)
    for chunk in (3, 1024):  # many chunks; one
        loss, grads = losses_and_grads(model, batch, chunk)
        torch.testing.assert_close(loss, ref_loss)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_loss_applies_gemma2s_final_logit_softcapping_as_the_model_does():
    """Gemma-2 soft-caps its logits after the LM head (tanh(x / cap) · cap); the chunked loss must do the same, not
    train on the uncapped logits. A cap of 1 is far below these logits, so leaving it out changes the loss."""
    torch.manual_seed(0)
    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=128, final_logit_softcapping=1.0)
    model = Gemma2ForCausalLM._from_config(config, attn_implementation="eager")
    batch = collate(Samples, np.arange(4), 0)
    ref_loss, ref_grads = losses_and_grads(model, batch, 0)
    loss, grads = losses_and_grads(model, batch, 3)
    torch.testing.assert_close(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_micro_batch_without_loss_tokens_still_backpropagates_through_the_model():
    model = tiny_model()
    install_chunked_loss(model, 4)
    batch = collate(Samples, np.arange(2), 0)
    labels = torch.full_like(batch.pop("labels"), -100)
    loss = micro_batch_loss_sum(model, {**batch, **loss_inputs(labels)})
    loss.backward()
    assert loss.item() == 0 and all(p.grad is not None for p in model.parameters())


def test_chunked_loss_under_fsdp_equals_the_full_logits_loss(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        batch = collate(Samples, np.arange(4), 0, packing=True)
        reference = losses_and_grads(tiny_model(), batch, 0)
        model = tiny_model()
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # reshards the root after forward: the LM head must run inside one
        loss, grads = losses_and_grads(model, batch, 5)
        torch.testing.assert_close(loss, reference[0])
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[1][name], msg=lambda m, n=name: f"{n}: {m}")
    finally:
        dist.destroy_process_group()
