"""`model.attn_implementation: varlen` on CPU: the per-sample reference path gives a packed row the loss and
gradients of the padded batch, and transformers builds no mask for it. Attention that would differ from the
model's own (a sliding window or soft-capping the kernel lacks) is refused on the driver."""

import re

import numpy as np
import pytest
import torch
from conftest import cli_in_process, tiny_config
from test_loss import Samples
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import raysft.model.attention  # noqa: F401  (registers "varlen")
from raysft.config import ConfigError
from raysft.data.dataloader import collate
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.prelaunch import check_model
from raysft.model.loss import full_logits_loss_sum


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


def _model_dir(tmp_path, config) -> str:
    out = tmp_path / type(config).__name__
    config.save_pretrained(out)
    return str(out)


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(("config", "attn", "refused"), [
    # Mistral v0.1's window, shrunk: samples longer than it would attend past it under varlen
    (MistralConfig(**SMALL, sliding_window=64), "varlen", "sliding_window=64 and data.max_seq_len=96"),
    (MistralConfig(**SMALL, sliding_window=96), "varlen", None),  # no sample is longer than the window
    (MistralConfig(**SMALL, sliding_window=64), "sdpa", None),  # transformers' sliding-window mask
    (Qwen2Config(**SMALL, sliding_window=32, use_sliding_window=False), "varlen", None),  # Qwen2's configs
    (Gemma3TextConfig(**SMALL, sliding_window=32), "varlen", "sliding_window=32"),  # every 6th layer global
    (Gemma2Config(**SMALL, sliding_window=4096), "varlen", "attn_logit_softcapping=50.0"),
    (Gemma2Config(**SMALL, sliding_window=4096), "sdpa", "attn_logit_softcapping=50.0"),
    (Gemma2Config(**SMALL, sliding_window=32), "eager", None),
    (Gemma2Config(**SMALL, sliding_window=32), "flex_attention", None),
])
def test_attention_that_would_differ_from_the_models_is_refused_naming_its_setting(tmp_path, config, attn, refused):
    """On the driver, before Ray or any worker: the model's own config against model.attn_implementation."""
    tokenizer = load_tokenizer(tiny_config(tmp_path).model)
    config.vocab_size = len(tokenizer)
    cfg = tiny_config(tmp_path, **{"model.config": _model_dir(tmp_path, config), "model.attn_implementation": attn,
                                   "data.packing": True})
    if refused is None:
        check_model(cfg, tokenizer)
        return
    with pytest.raises(ConfigError, match=f"model.attn_implementation.*'{attn}'.*{re.escape(refused)}"):
        check_model(cfg, tokenizer)


def test_raysft_train_refuses_varlen_on_a_sliding_window_model_before_starting_anything(tmp_path):
    pytest.importorskip("ray", reason="raysft train launches on Ray, which the GPU machine does not have")
    tokenizer = load_tokenizer(tiny_config(tmp_path).model)
    model = _model_dir(tmp_path, MistralConfig(**SMALL, sliding_window=64, vocab_size=len(tokenizer)))
    out = cli_in_process("train", "--set", f"model.config={model}", "--set", "model.attn_implementation=varlen",
                         "--set", "data.packing=true", "--set", "data.max_seq_len=128", "--set",
                         f"run.storage_path={tmp_path / 'runs'}")
    assert out.returncode == 2, out.stderr
    assert "config error: config key 'model.attn_implementation': 'varlen' has no sliding window, but the model's " \
           "config sets sliding_window=64 and data.max_seq_len=128" in out.stderr
    assert not (tmp_path / "runs" / "raysft-demo").exists()  # the run was never claimed
