"""Shared-prompt packing: a group's prompt goes through the model once, not once per episode.

A group's ``G`` episodes start from the same prompt, so the plain forward computes the same
prompt activations ``G`` times (and backpropagates through each copy).  Here the rows of a
micro-batch whose tokens before their first loss token are identical become one *pack*:

    [prompt | continuation 1 | continuation 2 | ...]      one row of the forward

Each continuation keeps its own positions (it starts where the prompt ends) and a mask lets
it see the prompt and its own earlier tokens, never another continuation's.  Every hidden
state is then the one the plain forward computes for that token in its own row, so log π_θ,
and its gradient (summed over the continuations that share the prompt), are the plain
path's up to float rounding: ``tests/rl/test_packing.py`` checks both against the model's own
full-sequence forward.

A pack takes another member only when that is cheaper than a row of its own.  Per layer a
sequence of ``n`` tokens costs about ``24·n·d²`` in its linear layers and ``4·n²·d`` in
attention (``d`` the hidden size; a packed mask is dense), so cost(n) ∝ ``n + n² / (6·d)``:
a long prompt with short continuations packs; long continuations behind a short prompt do
not, since their attention over one long row would cost more than the prompt saves.  Rows
that share nothing stay one row each, and every row is padded to the longest pack, so
:func:`choose` keeps the plain forward unless the packed one costs less as a whole.

The packed mask is plain causal attention over ``position_ids``: models with a sliding
window or ALiBi keep the plain path (:func:`packable`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agentrl.cpu_attention import is_sdpa


@dataclass
class Packed:
    """One micro-batch as packs: what the decoder takes, and where each loss token's hidden state is."""

    ids: Tensor  # [P, N]
    positions: Tensor  # [P, N]
    visible: Tensor  # [P, 1, N, N] bool: query row sees key column
    hidden_at: Tensor  # [M] flat index into [P * N] of the state that predicts each loss token


def packable(config: Any, forward: Any = None) -> bool:
    """Whether the model's attention is plain causal over ``position_ids`` (sdpa or eager, no
    window, no ALiBi); ``forward``: the decoder's forward, which must take ``position_ids``."""
    if not (is_sdpa(config) or getattr(config, "_attn_implementation", None) == "eager"):
        return False
    # ALiBi biases by key column (MPT) or by a cumsum of a 2-D mask (Bloom), not by position_ids
    if getattr(config, "model_type", "") in ("bloom", "mpt") or getattr(config, "alibi", False) \
            or getattr(config, "position_embedding_type", None) == "alibi":
        return False
    if forward is not None and "position_ids" not in inspect.signature(forward).parameters:
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    return kinds == {"full_attention"}


def first_loss_position(mask: Sequence[int]) -> int:
    """Index of the first loss token; position 0 never is one (no state before it predicts it)."""
    return next((t for t in range(1, len(mask)) if mask[t]), len(mask))


def cost(n: int, hidden: int) -> float:
    """Relative forward cost of one row of ``n`` tokens (module docstring)."""
    return n + n * n / (6 * hidden)


def plan(rows: Sequence[tuple[Sequence[int], Sequence[int]]], hidden: int,
         max_tokens: int = 8192) -> list[tuple[int, list[int]]]:
    """Packs as (shared prefix length, row indices) for rows of (ids, loss mask).

    Rows whose ids before their first loss token are identical share that prefix; a pack takes
    them in order while each one adds less :func:`cost` than its own row would, and the pack
    stays within ``max_tokens``.
    """
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, mask) in enumerate(rows):
        buckets.setdefault(tuple(ids[: first_loss_position(mask)]), []).append(i)
    packs: list[tuple[int, list[int]]] = []
    for prefix, members in buckets.items():
        p = len(prefix)
        if p == 0:  # an empty row: nothing to share
            packs.extend((0, [i]) for i in members)
            continue
        cur: list[int] = []
        length = p
        for i in members:
            n = len(rows[i][0])
            grown = length + n - p
            if cur and (cost(grown, hidden) - cost(length, hidden) > cost(n, hidden) or grown > max_tokens):
                packs.append((p, cur))
                cur, length = [], p
            cur.append(i)
            length += n - p
        packs.append((p, cur))
    return packs


def _length(rows: Sequence[tuple[Sequence[int], Sequence[int]]], prefix: int, members: list[int]) -> int:
    """Tokens in one pack: the shared prefix once, then each member's continuation."""
    return prefix + sum(len(rows[i][0]) - prefix for i in members)


def choose(rows: Sequence[tuple[Sequence[int], Sequence[int]]], hidden: int,
           max_tokens: int = 8192) -> list[tuple[int, list[int]]] | None:
    """:func:`plan`'s packs when their forward costs less than the plain one, else None.

    Every pack is padded to the longest, as every plain row is: a long pack beside rows that
    share nothing can cost more than the prompts it saves.
    """
    packs = plan(rows, hidden, max_tokens)
    if len(packs) == len(rows):
        return None
    n_cols = max(_length(rows, p, members) for p, members in packs)
    longest = max(len(ids) for ids, _ in rows)
    return packs if len(packs) * cost(n_cols, hidden) < len(rows) * cost(longest, hidden) else None


def pack(rows: Sequence[tuple[Sequence[int], Sequence[int]]], packs: list[tuple[int, list[int]]], pad_id: int,
         device: torch.device | str = "cpu") -> Packed:
    """The decoder inputs for ``rows`` of (ids, loss mask) packed as :func:`plan` says.

    ``hidden_at`` lists the loss tokens in row order, each row's in position order: the order
    of ``mask[:, 1:] > 0`` on the plain right-padded ``[B, T]`` batch.
    """
    n_cols = max(_length(rows, p, members) for p, members in packs)
    ids = torch.full((len(packs), n_cols), pad_id, dtype=torch.long)
    positions = torch.zeros((len(packs), n_cols), dtype=torch.long)
    segment = torch.full((len(packs), n_cols), -1, dtype=torch.long)  # -1 pad, 0 prefix, k continuation k
    where: dict[int, tuple[int, int, int]] = {}  # row -> (pack, prefix length, column of its continuation)
    for k, (p, members) in enumerate(packs):
        first = rows[members[0]][0]
        ids[k, :p] = torch.tensor(list(first[:p]), dtype=torch.long)
        positions[k, :p] = torch.arange(p)
        segment[k, :p] = 0
        col = p
        for s, i in enumerate(members, start=1):
            rest = list(rows[i][0][p:])
            ids[k, col: col + len(rest)] = torch.tensor(rest, dtype=torch.long)
            positions[k, col: col + len(rest)] = torch.arange(p, p + len(rest))
            segment[k, col: col + len(rest)] = s
            where[i] = (k, p, col)
            col += len(rest)
    segment = segment.to(device)  # the [P, N, N] mask is built where it is used
    cols = torch.arange(n_cols, device=device)
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    causal = cols[None, None, :] <= cols[None, :, None]
    visible = causal & (q_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    visible |= (cols[None, :, None] == cols[None, None, :]) & (q_seg < 0)  # a pad sees itself: no all-masked row
    hidden_at: list[int] = []
    for i, (_, mask) in enumerate(rows):
        k, p, col = where[i]
        for t in range(1, len(mask)):
            if mask[t]:  # the state at position t - 1 predicts token t
                hidden_at.append(k * n_cols + (t - 1 if t - 1 < p else col + t - 1 - p))
    return Packed(ids.to(device), positions.to(device), visible[:, None],
                  torch.tensor(hidden_at, dtype=torch.long, device=device))


def attention_mask(packed: Packed, config: Any, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
    """The 4-D mask in the form the model takes: boolean for sdpa, additive for eager; a dict
    keyed by layer kind for models that take one mask per kind."""
    if is_sdpa(config):
        mask = packed.visible
    else:
        zero = torch.zeros((), dtype=dtype, device=packed.visible.device)
        mask = torch.where(packed.visible, zero, torch.finfo(dtype).min)
    kinds = getattr(config, "layer_types", None)
    return {kind: mask for kind in set(kinds)} if kinds else mask
