"""A model's attention under a name of agentrl's own: register the function once, switch a model to it.

transformers looks attention functions up by the model's ``_attn_implementation``; a function
registered under another name replaces the model's for its next forwards, and the name is the
model's in-memory setting only (a saved config does not record it).  Used by the trainer's
float32 attention under CPU autocast (:mod:`agentrl.cpu_attention`) and the engine's ragged
batches (:mod:`agentrl.inference.ragged`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def register(name: str, attention: Callable[..., Any], masks_of: str) -> None:
    """Register ``attention`` as ``name`` (once per process), its masks built as ``masks_of``'s are
    (without a mask builder of its own, a forward under ``name`` would get no masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, attention)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[masks_of])


def can_switch(model: Any) -> bool:
    """Can this model change its attention implementation at run time?"""
    allowed = getattr(type(model), "_can_set_attn_implementation", None)
    return allowed is None or bool(allowed())


def switch_to(model: Any, name: str) -> bool:
    """Put ``model`` on the registered attention ``name``; False (left as it was) where the model
    cannot switch or this transformers refuses the name for it."""
    if not can_switch(model):
        return False
    try:
        model.set_attn_implementation(name)
    except ValueError:
        return False
    return model.config._attn_implementation == name
