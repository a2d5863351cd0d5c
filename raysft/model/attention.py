"""Padding-free attention over packed rows: `model.attn_implementation: varlen`.

A packed micro-batch is one row of samples back to back. With SDPA, transformers keeps attention inside each sample
through a block-causal mask that it builds from the restarting position_ids, and a masked SDPA cannot use the flash
kernel. Here the sample boundaries come as cumulative lengths (`cu_seq_lens_q/k`, transformers' flash-attention
kwargs, built on the CPU by `raysft.data.dataloader.collate`), and attention runs per sample:

- on CUDA in bf16/fp16, `torch.nn.attention.varlen.varlen_attn` (flash varlen, part of torch; no mask at all);
- elsewhere (CPU, or fp32 on CUDA, which flash does not take), causal SDPA over each sample's slice of the row:
  the same result as a padded batch, used as the reference on CPU.

transformers builds no mask for an attention name it has no mask function for, so the model passes
`attention_mask=None` here and never looks for packed sequences in the position_ids (which costs a device sync).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from raysft.config import ConfigError

VARLEN = "varlen"
FLASH_DTYPES = (torch.bfloat16, torch.float16)
# transformers' kernels that take the model's sliding window and attention-logit soft-capping as the model asks;
# sdpa takes the window (through the mask transformers builds) but not the soft-capping
KEEPS_WINDOW_AND_SOFTCAP = ("eager", "flex_attention", "flash_attention_2")


def check_attention(config: PretrainedConfig, attn_implementation: str, max_seq_len: int) -> None:
    """ConfigError, naming the model's setting, when `attn_implementation` would attend otherwise than the model was
    built to: raysft's varlen has no sliding window (it matters once a sample is longer than the window: Mistral
    v0.1, Gemma-2/3) and no logit soft-capping (Gemma-2), and SDPA no soft-capping. Checked on the driver, before
    anything starts; a model trained on other attention than it runs with would not fail, only learn wrong."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)  # Qwen2 sets it to None unless use_sliding_window
    layer_types = getattr(text, "layer_types", None)
    if window and layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    softcap = getattr(text, "attn_logit_softcapping", None)
    name = attn_implementation
    if name == VARLEN and window and max_seq_len > window:
        raise ConfigError(f"config key 'model.attn_implementation': '{VARLEN}' has no sliding window, but the model's "
                          f"config sets sliding_window={window} and data.max_seq_len={max_seq_len} is longer: use "
                          f"one of {', '.join(KEEPS_WINDOW_AND_SOFTCAP)} or sdpa, or data.max_seq_len <= {window}")
    if name in (VARLEN, "sdpa") and softcap:
        raise ConfigError(f"config key 'model.attn_implementation': '{name}' has no logit soft-capping, but the "
                          f"model's config sets attn_logit_softcapping={softcap}: use one of "
                          f"{', '.join(KEEPS_WINDOW_AND_SOFTCAP)}")


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                             max_length_q: int | None = None, max_length_k: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (1, heads, tokens, dim), key/value (1, kv heads, tokens,
    dim); returns (1, tokens, heads, dim). Causal inside each sample of the packed row, nothing across samples."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"attention '{VARLEN}' needs packed batches with cumulative sample lengths "
                         "(data.packing: true); got none")
    if dropout:
        raise ValueError(f"attention '{VARLEN}' has no dropout (the model asks for {dropout})")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    if query.is_cuda and query.dtype in FLASH_DTYPES:
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # (tokens, heads, dim)
        options = {"window_size": (-1, 0)} if _varlen_takes("window_size") else {"is_causal": True}
        if q.shape[1] != k.shape[1]:
            if _varlen_takes("enable_gqa"):
                options["enable_gqa"] = True
            else:  # torch < 2.12: each query head gets its own key/value head
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_k, max_length_q, max_length_k or max_length_q, scale=scaling,
                          **options)
        return out.unsqueeze(0), None
    return per_sample_sdpa(query, key, value, cu_seq_lens_q, scaling), None


@functools.cache
def _varlen_takes(argument: str) -> bool:
    """Whether this torch's varlen_attn has `argument`: its keywords changed between releases (2.11 has no
    enable_gqa; earlier ones said causal with is_causal rather than window_size)."""
    from torch.nn.attention.varlen import varlen_attn

    return argument in inspect.signature(varlen_attn).parameters


def per_sample_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """The reference: causal SDPA on each sample's slice of the row (reads the boundaries on the host)."""
    bounds = cu_seq_lens.tolist()
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                            scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
             for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


AttentionInterface.register(VARLEN, varlen_attention_forward)
