"""The engine's slot KV cache and the attention masks its forwards use.

Running sequences own one *slot* each: a row of the preallocated tensors ``k``/``v``
``[layers, slots, kv_heads, max_model_len + 1, head_dim]``.  Column ``max_model_len`` is a
scratch column: padding tokens of a batched prefill write their K/V there, so they never
touch a real position (a real token's position is at most ``max_model_len - 2``).

:class:`SlotCache` is the one ``Cache.update`` hook HF attention layers call: before a
forward the engine binds the first slot row, the column each new token writes and the key
length attention sees; ``update`` scatters the new K/V into the slots and returns the views.

:func:`attention_masks` builds the masks HF's own mask builders would build for the same
positions (``masking_utils``: causal, ``kv_idx > q_idx - sliding_window`` for sliding layers),
per row, since every row of a batch sits at its own position: boolean for SDPA, additive
(0 / dtype min) for every other attention implementation (eager *adds* the mask to the scores).
"""

from __future__ import annotations

import torch

# layer kinds whose masks the engine builds (HF ``config.layer_types`` names)
FULL, SLIDING = "full_attention", "sliding_attention"


class SlotCache:
    """Slot tensors plus the ``Cache.update`` hook (see the module docstring)."""

    is_compileable = False

    def __init__(self, layers: int, slots: int, kv_heads: int, max_model_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):  # fmt: skip
        shape = (layers, slots, kv_heads, max_model_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scratch = max_model_len  # the column padding tokens write to
        self.r0 = 0
        self.write_idx: torch.Tensor | None = None
        self.kv_len = 0
        self._rows: torch.Tensor | None = None  # [R, 1] slot of each row, broadcast against write_idx
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None  # (slot, column) of each token of a ragged row
        self._flat_rows: torch.Tensor | None = None  # [N * heads] rows of a layer's [S * heads * L, dim] view

    def bind(self, r0: int, write_idx: torch.Tensor, kv_len: int) -> None:
        """Rows ``r0..r0+R`` take the next forward; token ``[r, t]`` writes column ``write_idx[r, t]``."""
        self.r0, self.write_idx, self.kv_len = r0, write_idx, kv_len
        self._rows = torch.arange(r0, r0 + write_idx.shape[0], device=write_idx.device)[:, None]
        self._flat = None

    def bind_flat(self, slots: torch.Tensor, columns: torch.Tensor) -> None:
        """The next forward is one ragged row (:mod:`agentrl.inference.ragged`): its token ``j``
        writes column ``columns[j]`` of slot ``slots[j]``; ``update`` returns whole layers."""
        self._flat = (slots, columns)
        self._flat_rows = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows, heads, t, dim = key_states.shape
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self._flat is not None:  # one ragged row: the attention slices each group's slots itself
            # token j, head h lands in row (slot_j * H + h) * L + column_j of the layer's [S*H*L, dim]
            # view: one index_copy_ of whole rows (k[slots, :, columns] = ... took ~100 us a layer)
            if self._flat_rows is None:
                slots, columns = self._flat
                _, n_heads, length, _ = k.shape
                per_head = torch.arange(n_heads, device=slots.device)[None, :]
                self._flat_rows = ((slots[:, None] * n_heads + per_head) * length + columns[:, None]).reshape(-1)
            k.view(-1, dim).index_copy_(0, self._flat_rows, key_states[0].transpose(0, 1).reshape(-1, dim).to(k.dtype))
            v.view(-1, dim).index_copy_(0, self._flat_rows, value_states[0].transpose(0, 1).reshape(-1, dim).to(v.dtype))
            return k, v
        kb, vb = k[self.r0 : self.r0 + rows], v[self.r0 : self.r0 + rows]
        if t == 1:  # decode: index_put over (slot, column) pairs, 25-40x less time than scatter_ on a CPU
            k[self._rows, :, self.write_idx] = key_states.transpose(1, 2).to(k.dtype)
            v[self._rows, :, self.write_idx] = value_states.transpose(1, 2).to(v.dtype)
        else:  # prefill rows (scatter_ measured as fast or faster there)
            idx = self.write_idx[:, None, :, None].expand(rows, heads, t, dim)
            kb.scatter_(2, idx, key_states.to(kb.dtype))
            vb.scatter_(2, idx, value_states.to(vb.dtype))
        return kb[:, :, : self.kv_len], vb[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def attention_masks(
    positions: torch.Tensor,
    kv_len: int,
    kinds: dict[str, int | None],
    boolean: bool,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One ``[R, 1, T, kv_len]`` mask per layer kind for queries at ``positions`` ``[R, T]``.

    ``kinds`` maps a layer kind to its sliding window (None: full causal).  A key at column
    ``j`` is visible to a query at position ``p`` iff ``j <= p`` (and ``j > p - window``).
    """
    keys = torch.arange(kv_len, device=positions.device)[None, None, None, :]
    query = positions[:, None, :, None]
    out: dict[str, torch.Tensor] = {}
    for kind, window in kinds.items():
        visible = keys <= query
        if window is not None:
            visible = visible & (keys > query - window)
        if boolean:
            out[kind] = visible
        else:
            zero = torch.zeros((), dtype=dtype, device=positions.device)
            out[kind] = torch.where(visible, zero, torch.finfo(dtype).min)
    return out
