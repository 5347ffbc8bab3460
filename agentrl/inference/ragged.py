"""Ragged batches: one forward per engine step for every token the step runs.

A padded batch gives every row the longest row's length, so a step that prefills a new
prompt while others decode ran two forwards (the prefill rows, then the decode rows), and a
decode row could not carry draft tokens (:mod:`agentrl.inference.speculation`) without
padding every other row to the same length: 64 rows × 8 tokens cost 3.2× one token's step
on the tiny model, though most rows have no draft.

Here the step's tokens are one flat row ``[1, N]``: one token per running sequence (slot
``i`` at flat index ``i``), then each sequence's draft tokens, then *segments*, each a run
of consecutive positions of one slot (a prompt's uncached part).  The linear layers, norms
and rotary embedding see one row of ``N`` tokens; only attention needs the rows, so the
model runs under an attention implementation of ours (:func:`switch`).  While a
:class:`Plan` is bound (:func:`bound`) it calls the model's own attention function
(transformers' ``sdpa``, or the modeling file's ``eager``, with the model's own scaling and
keywords) once for the *decode group* and once per segment, each with the mask
:func:`~agentrl.inference.kv_cache.attention_masks` builds for its positions:

- the decode group is the running sequences over slots ``0..B-1``, each row's queries its
  decode token and its drafts, padded to the longest row's (a padding query repeats its
  row's last position; its output is dropped).  One call per sequence instead cost ~0.1 ms
  of fixed overhead per layer: 64 rows with 4 drafts each took 3× a decode step;
- a segment attends to its own slot, up to its last position.

Unbound (a plain forward, the padded path) it is the model's own function unchanged.  K/V
reach the slot cache (:meth:`~agentrl.inference.kv_cache.SlotCache.bind_flat`) before
attention runs, so a segment sees its own earlier tokens and a draft its decode token.

The engine switches a model only after a ragged self-check (the padded self-check's probe,
through this path) matches the model's plain forward; otherwise it keeps padded batches.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "agentrl_ragged_"  # + the model's own implementation: sdpa | eager
ORIGINALS = ("sdpa", "eager")
_state = threading.local()  # .plan: the Plan of the forward running on this thread


@dataclass
class Segment:
    """Positions ``first..first+n-1`` of slot ``slot``, at flat indices ``start..start+n-1``."""

    slot: int
    start: int
    n: int
    masks: dict[str, torch.Tensor]  # layer kind -> [1, 1, n, first + n]


@dataclass
class Plan:
    """Where each flat token's attention looks (see the module docstring)."""

    layer_kinds: list[str]  # layer index -> mask kind
    decode_rows: int = 0  # slots 0..B-1: the decode group
    decode_kv: int = 0  # keys the decode group reads
    decode_masks: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [B, 1, T, decode_kv]
    # T > 1 (draft tokens): row i's queries are the flat tokens rows[i] (its decode token, its drafts, then
    # its last token again as padding); flat index dst[j] takes the group's output src[j] (of B * T)
    rows: torch.Tensor | None = None  # [B, T]
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    segments: list[Segment] = field(default_factory=list)


def layout(decode: list[tuple[int, int]], drafts: list[list[int]], segments: list[tuple[int, list[int], int]],
           layer_kinds: list[str], masks: Callable[[torch.Tensor, int], dict[str, torch.Tensor]],
           device: torch.device) -> tuple[Plan, list[int], torch.Tensor, torch.Tensor]:  # fmt: skip
    """The flat row of one step: (plan, token ids, positions, slots).

    ``decode[i]`` = (token, position) of slot ``i``, followed by the tokens ``drafts[i]``
    (``[]`` for none); each segment is (slot, tokens, first position).  Flat order: the decode
    tokens, then the drafts, then the segments' tokens.  ``masks(positions, kv_len)``: one mask
    per layer kind for queries at ``positions`` (``[R, T]``) over ``kv_len`` keys."""
    b = len(decode)
    ids = [t for t, _ in decode]
    pos = [p for _, p in decode]
    slots = list(range(b))
    plan = Plan(layer_kinds, decode_rows=b)
    width = 1 + max((len(d) for d in drafts), default=0)
    if width == 1:
        if b:
            plan.decode_kv = max(pos) + 1
            plan.decode_masks = masks(torch.tensor(pos, device=device)[:, None], plan.decode_kv)
    else:
        rows, src, dst = [], [], []
        for i, d in enumerate(drafts):
            idx = [i, *range(len(ids), len(ids) + len(d))]
            ids += d
            pos += range(pos[i] + 1, pos[i] + 1 + len(d))
            slots += [i] * len(d)
            src += range(i * width, i * width + len(idx))
            dst += idx
            rows.append(idx + [idx[-1]] * (width - len(idx)))
        plan.rows = torch.tensor(rows, device=device)
        plan.src, plan.dst = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        query_pos = torch.tensor(pos, device=device)[plan.rows]
        plan.decode_kv = int(query_pos.max()) + 1
        plan.decode_masks = masks(query_pos, plan.decode_kv)
    for slot, toks, first in segments:
        n = len(toks)
        seg_pos = torch.arange(first, first + n, device=device)[None]
        plan.segments.append(Segment(slot, len(ids), n, masks(seg_pos, first + n)))
        ids += toks
        pos += range(first, first + n)
        slots += [slot] * n
    return plan, ids, torch.tensor(pos, device=device), torch.tensor(slots, device=device)


@contextmanager
def bound(plan: Plan) -> Iterator[None]:
    """Forwards on this thread run ``plan`` until the block ends."""
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = None


def _function(original: str, module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The model's own attention function: transformers' registered one (sdpa), or eager's, which
    each modeling file defines for itself (Gemma 2's soft-caps its scores there)."""
    if original != "eager":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[original]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__}'s module defines no eager_attention_forward")
    return fn


def _attention(original: str):
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        fn = _function(original, module)
        plan: Plan | None = getattr(_state, "plan", None)
        if plan is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        kind = plan.layer_kinds[module.layer_idx]
        _, heads, n, dim = query.shape
        q = query[0]  # [heads, N, dim]
        b = plan.decode_rows
        out = None
        if b:
            kv = plan.decode_kv
            if plan.rows is None:  # one token per row: [B, heads, 1, dim]
                qd = q[:, :b].transpose(0, 1).unsqueeze(2)
            else:
                qd = q[:, plan.rows].transpose(0, 1)  # [B, heads, T, dim]
            o, _ = fn(module, qd, key[:b, :, :kv], value[:b, :, :kv], plan.decode_masks[kind], **kwargs)
            if plan.rows is None and not plan.segments:  # [B, 1, heads, dim] is already the flat row's layout
                return o.reshape(1, b, heads, dim), None
            out = query.new_empty((1, n, heads, dim))
            if plan.rows is None:
                out[0, :b] = o[:, 0]
            else:
                out[0].index_copy_(0, plan.dst, o.reshape(-1, heads, dim).index_select(0, plan.src))
        if out is None:
            out = query.new_empty((1, n, heads, dim))
        for s in plan.segments:
            kv = s.masks[kind].shape[-1]
            qs = q[None, :, s.start : s.start + s.n]
            o, _ = fn(module, qs, key[s.slot : s.slot + 1, :, :kv], value[s.slot : s.slot + 1, :, :kv],
                      s.masks[kind], **kwargs)  # fmt: skip
            out[0, s.start : s.start + s.n] = o[0]
        return out, None

    return attention


def _register(original: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, _attention(original))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # a plain forward builds the original's masks
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def switch(model: Any) -> str | None:
    """Put ``model`` on the ragged attention; returns its original implementation's name, or
    None (left as it was) when it runs another one or cannot switch at run time."""
    original = getattr(model.config, "_attn_implementation", None)
    if original not in ORIGINALS:
        return None
    can_switch = getattr(type(model), "_can_set_attn_implementation", None)
    if can_switch is not None and not can_switch():
        return None
    try:
        model.set_attn_implementation(_register(original))
    except ValueError:  # this transformers refuses the name for this model
        return None
    if model.config._attn_implementation != PREFIX + original:
        return None
    return original


def unswitch(model: Any, original: str) -> None:
    """Back to the model's own implementation (a ragged self-check failed)."""
    model.set_attn_implementation(original)
