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
record it).  The cost is memory: autograd keeps the attention's float32 queries, keys, values
and output, twice the bytes of bf16's (by arithmetic, SmolLM2-135M: 9 query heads of 64, keys
and values repeated to all 9 when a mask is given: 4.6 KB more per token per layer, 138 KB per
token over its 30 layers).
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.attention_switch import register, switch_to

NAME = "agentrl_sdpa"  # transformers' sdpa, float32 under CPU autocast
_sdpa: Any = None  # transformers' sdpa attention function, as registered when NAME was


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
    sdpa = _sdpa or _register()
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            if attention_mask is not None and attention_mask.is_floating_point():
                attention_mask = attention_mask.float()  # additive: its -inf stays -inf in float32
            # a floating keyword (a model's position_bias) joins the mask: it must match the query's dtype
            kwargs = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in kwargs.items()}  # fmt: skip
            return sdpa(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return sdpa(module, query, key, value, attention_mask, **kwargs)


def _register() -> Any:
    """Register :data:`NAME` (once per process); returns transformers' sdpa function."""
    global _sdpa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _sdpa is None:
        _sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    register(NAME, _attention, masks_of="sdpa")
    return _sdpa


def _configs(config: Any) -> list[Any]:
    """A config and every sub-config in it (a multimodal model's text and vision configs)."""
    from transformers import PretrainedConfig

    out = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            out.extend(_configs(value))
    return out


def float32_attention(model: torch.nn.Module) -> bool:
    """Switch a model whose attention is transformers' ``sdpa`` (every sub-model's) to :data:`NAME`;
    returns whether it did.  Models on another implementation (eager, flash, a custom one, a
    sub-model on eager) or that cannot switch at run time are left as they are."""
    if not all(getattr(c, "_attn_implementation", None) == "sdpa" for c in _configs(model.config)):
        return False
    _register()
    return switch_to(model, NAME)  # refused: the model keeps its own sdpa


def is_sdpa(config: Any) -> bool:
    """Does a model with this config run transformers' sdpa attention (plain or :data:`NAME`)?"""
    return getattr(config, "_attn_implementation", None) in ("sdpa", NAME)
