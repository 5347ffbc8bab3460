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
keywords) once per *group* of consecutive slots, each with the masks
:func:`~agentrl.inference.kv_cache.attention_masks` builds for its queries' positions:

- the running sequences (slots ``0..B-1``), each row's queries its decode token and its
  drafts;
- each run of segments on consecutive slots (a step's new prompts).

A group's rows are padded to its longest (a padding query repeats its row's last position;
its output is dropped).  One call per sequence instead cost ~0.1 ms of fixed overhead per
layer: 64 rows with 4 drafts each took 3× a decode step.

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

from agentrl.attention_switch import can_switch, register, switch_to
from agentrl.inference import cpu_decode_attention

PREFIX = "agentrl_ragged_"  # + the model's own implementation: sdpa | eager
ORIGINALS = ("sdpa", "eager")
_state = threading.local()  # .plan: the Plan of the forward running on this thread


@dataclass
class Group:
    """Consecutive slots ``slot..slot+R-1`` whose queries take one attention call: row ``r``'s
    queries are the flat tokens ``index[r]`` (padded with its last one), at positions in order."""

    slot: int
    rows: int
    kv: int  # keys the group reads
    masks: dict[str, torch.Tensor]  # layer kind -> [R, 1, T, kv]
    index: torch.Tensor | None = None  # [R, T]; None: row r's one query is flat token r
    src: torch.Tensor | None = None  # flat token dst[j] takes the group's output src[j] (of R * T)
    dst: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None  # [R, T] position of each query (the decode group's, for the kernel)
    decode: bool = False  # the running sequences' group (decode tokens and drafts)


@dataclass
class Plan:
    """Where each flat token's attention looks (see the module docstring)."""

    layer_kinds: list[str]  # layer index -> mask kind
    groups: list[Group] = field(default_factory=list)
    # layer kind -> sliding window (None: full); set: the decode group runs the CPU kernel
    # (agentrl.inference.cpu_decode_attention) where the call is one it covers
    kernel_windows: dict[str, int | None] | None = None


class _Row:
    """The flat row being laid out: token ids, positions, slots."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.slots: list[int] = []

    def add(self, slot: int, tokens: list[int], first: int) -> list[int]:
        """Append ``tokens`` at positions ``first..`` of ``slot``; their flat indices."""
        start = len(self.ids)
        self.ids += tokens
        self.pos += range(first, first + len(tokens))
        self.slots += [slot] * len(tokens)
        return list(range(start, start + len(tokens)))


def _group(slot: int, rows: list[list[int]], row: _Row, masks: Callable[[torch.Tensor, int], dict[str, torch.Tensor]],
           device: torch.device) -> Group:  # fmt: skip
    width = max(len(r) for r in rows)
    src = [i * width + j for i, r in enumerate(rows) for j in range(len(r))]
    dst = [t for r in rows for t in r]
    index = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=device)
    query_pos = torch.tensor(row.pos, device=device)[index]
    kv = max(row.pos[t] for r in rows for t in r) + 1  # from the list: no device sync
    return Group(slot, len(rows), kv, masks(query_pos, kv), index, torch.tensor(src, device=device),
                 torch.tensor(dst, device=device), query_pos)  # fmt: skip


def layout(decode: list[tuple[int, int]], drafts: list[list[int]], segments: list[tuple[int, list[int], int]],
           layer_kinds: list[str], masks: Callable[[torch.Tensor, int], dict[str, torch.Tensor]],
           device: torch.device) -> tuple[Plan, list[int], torch.Tensor, torch.Tensor]:  # fmt: skip
    """The flat row of one step: (plan, token ids, positions, slots).

    ``decode[i]`` = (token, position) of slot ``i``, followed by the tokens ``drafts[i]``
    (``[]`` for none); each segment is (slot, tokens, first position).  Flat order: the decode
    tokens, then the drafts, then the segments' tokens.  Segments on consecutive slots (a step's
    new prompts) share one attention call, their queries padded to the longest's.
    ``masks(positions, kv_len)``: one mask per layer kind for queries at ``positions``
    (``[R, T]``) over ``kv_len`` keys."""
    row, plan = _Row(), Plan(layer_kinds)
    for i, (token, position) in enumerate(decode):
        row.add(i, [token], position)
    if decode and not any(drafts):
        kv, query_pos = max(row.pos) + 1, torch.tensor(row.pos, device=device)[:, None]
        plan.groups.append(Group(0, len(decode), kv, masks(query_pos, kv), query_pos=query_pos, decode=True))
    elif decode:
        rows = [[i, *row.add(i, d, decode[i][1] + 1)] for i, d in enumerate(drafts)]
        plan.groups.append(_group(0, rows, row, masks, device))
        plan.groups[-1].decode = True
    run: list[list[int]] = []
    for k, (slot, toks, first) in enumerate(segments):
        run.append(row.add(slot, toks, first))
        if k + 1 == len(segments) or segments[k + 1][0] != slot + 1:  # the run of consecutive slots ends
            plan.groups.append(_group(slot + 1 - len(run), run, row, masks, device))
            run = []
    return plan, row.ids, torch.tensor(row.pos, device=device), torch.tensor(row.slots, device=device)


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


def _plain(kwargs: dict[str, Any]) -> bool:
    """Nothing in the call that transformers' sdpa function would add to plain SDPA."""
    return not kwargs.get("dropout") and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "position_bias"))


def _grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scaling: float | None) -> torch.Tensor:  # fmt: skip
    """SDPA with grouped-query heads for ``T > 1`` queries per row, without repeating K/V.

    transformers' sdpa function repeats each K/V head for its query heads when a row has
    several queries and a mask is given (a copy of the group's whole K/V per layer, the heads'
    group size times over); here a K/V head's query heads and their queries become one axis,
    ``[R, kv_heads, group * T, dim]``, as it already packs a single query.  Returns ``[R, T, heads, dim]``.
    """
    r, heads, t, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    packed = query.reshape(r, kv_heads, group * t, dim)  # query head h reads K/V head h // group
    mask = mask.unsqueeze(2).expand(r, mask.shape[1], group, t, mask.shape[-1]).reshape(r, mask.shape[1], group * t, -1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(r, heads, t, dim).transpose(1, 2)


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
        out = None
        kernel = (plan.kernel_windows is not None and original == "sdpa" and _plain(kwargs)
                  and cpu_decode_attention.supported(query, key, value))  # fmt: skip
        for g in plan.groups:
            if kernel and g.decode:
                out = query.new_empty((1, n, heads, dim)) if out is None else out
                index = g.index if g.index is not None else torch.arange(g.rows)[:, None]
                scale = kwargs.get("scaling")
                scale = dim**-0.5 if scale is None else scale  # SDPA's default when the model passes none
                cpu_decode_attention.attend(q.transpose(0, 1), key, value, out[0], index, g.query_pos, g.slot,
                                            plan.kernel_windows[kind], scale)  # fmt: skip
                continue
            keys, values = key[g.slot : g.slot + g.rows, :, : g.kv], value[g.slot : g.slot + g.rows, :, : g.kv]
            if g.index is None:  # one query per row, flat tokens 0..R-1: [R, heads, 1, dim]
                o, _ = fn(module, q[:, : g.rows].transpose(0, 1).unsqueeze(2), keys, values, g.masks[kind], **kwargs)
                if len(plan.groups) == 1:  # decode only: [R, 1, heads, dim] is already the flat row's layout
                    return o.reshape(1, n, heads, dim), None
                out = query.new_empty((1, n, heads, dim)) if out is None else out
                out[0, : g.rows] = o[:, 0]
            else:
                qg = q[:, g.index].transpose(0, 1)  # [R, heads, T, dim]
                if original == "sdpa" and keys.shape[1] < heads and _plain(kwargs):
                    o = _grouped_sdpa(qg, keys, values, g.masks[kind], kwargs.get("scaling"))
                else:
                    o, _ = fn(module, qg, keys, values, g.masks[kind], **kwargs)
                out = query.new_empty((1, n, heads, dim)) if out is None else out
                out[0].index_copy_(0, g.dst, o.reshape(-1, heads, dim).index_select(0, g.src))
        return out, None

    return attention


def switchable(model: Any) -> bool:
    """Does ``model`` run an attention ragged batches wrap (sdpa or eager), and can it switch at run time?"""
    return getattr(model.config, "_attn_implementation", None) in ORIGINALS and can_switch(model)


def switch(model: Any) -> str | None:
    """Put ``model`` on the ragged attention; returns its original implementation's name, or
    None (left as it was) when it runs another one or cannot switch at run time."""
    original = getattr(model.config, "_attn_implementation", None)
    if original not in ORIGINALS:
        return None
    register(PREFIX + original, _attention(original), masks_of=original)  # a plain forward: the original's masks
    return original if switch_to(model, PREFIX + original) else None


def unswitch(model: Any, original: str) -> None:
    """Back to the model's own implementation (a ragged self-check failed)."""
    model.set_attn_implementation(original)
