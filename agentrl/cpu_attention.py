"""Attention in float32 inside a CPU bf16 autocast region (the trainer's and SFT's bf16).

CPU autocast runs ``scaled_dot_product_attention`` in bf16.  torch's CPU flash attention is
slower in bf16 than in float32 (its backward ~1.9x, its forward ~1.1x: SmolLM2-135M's 30
layers in one trainer step on an avx512_bf16 EPYC took 237 + 67 ms in bf16 against 124 + 57 ms
in float32), while the linear layers around it gain ~1.9x from bf16.  So under CPU autocast
:func:`float32_attention` makes a model's sdpa attention take float32 queries, keys, values
and mask (float32 is also the more precise choice); the projections stay in bf16.  Outside
autocast, or on another device, it is the model's own sdpa attention unchanged.

The model keeps its attention (transformers' sdpa function and mask builder) under a name of
its own, :data:`NAME`; the name is the model's in-memory setting only (a saved config does not
record it).
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "agentrl_sdpa"  # transformers' sdpa, float32 under CPU autocast


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            if attention_mask is not None and attention_mask.is_floating_point():
                attention_mask = attention_mask.float()  # additive: its -inf stays -inf in float32
            return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa takes


def float32_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is transformers' ``sdpa`` to :data:`NAME`; returns whether it did.
    Models on another attention implementation (eager, flash, a custom one) are left as they are."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


def is_sdpa(config: Any) -> bool:
    """Does a model with this config run transformers' sdpa attention (plain or :data:`NAME`)?"""
    return getattr(config, "_attn_implementation", None) in ("sdpa", NAME)
