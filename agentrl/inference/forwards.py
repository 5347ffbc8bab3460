"""The embedded engine's model forwards over its slot cache (:mod:`agentrl.inference.kv_cache`).

Every forward is the model's own ``*ForCausalLM`` forward, unchanged: the slot cache is its
``Cache``, the engine passes per-row masks (causal, sliding window per layer kind) and position
ids, and ``logits_to_keep`` picks the rows' tokens, so the model's own logit processing applies.
Padded forwards take rows of slots (:meth:`Forwards.prefill`, :meth:`Forwards.decode`); a ragged
one takes a step's every token as one row (:meth:`Forwards.ragged`, :mod:`agentrl.inference.ragged`).
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch

from agentrl.inference import model_support, ragged
from agentrl.inference.kv_cache import SlotCache, attention_masks


class Forwards:
    """A model and its slot cache, run padded or ragged."""

    def __init__(self, model: Any, cache: SlotCache, dtype: torch.dtype, device: torch.device,
                 decode_kernel: bool = False):  # fmt: skip
        """``decode_kernel``: ragged forwards run their decode rows' attention in
        :mod:`agentrl.inference.cpu_decode_attention` (the caller checked it is available)."""
        cfg = model.config.get_text_config()
        self.model, self.cache, self.dtype, self.device = model, cache, dtype, device
        self.mask_kinds, self.mask_dict = model_support.mask_kinds(cfg)
        self.bool_mask = cfg._attn_implementation == "sdpa"  # eager adds the mask: it must be 0 / -inf
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.layer_kinds = model_support.layer_kinds(cfg)
        self.masks = partial(attention_masks, kinds=self.mask_kinds, boolean=self.bool_mask, dtype=dtype)
        self.decode_kernel = decode_kernel

    def padded(self, r0: int, ids: torch.Tensor, positions: torch.Tensor, write_idx: torch.Tensor,
                 kv_len: int) -> torch.Tensor:  # fmt: skip
        """The model's own forward on slot rows ``r0..``: ``[R, V]`` float32 logits of each row's last token.

        Running the whole ``*ForCausalLM`` (not the base model + LM head) keeps the model's
        own logit processing (softcapping, scaling); only the last column's logits are computed.
        """
        masks = self.masks(positions, kv_len)
        self.cache.bind(r0, write_idx, kv_len)
        out = self.model(
            input_ids=ids,
            attention_mask=masks if self.mask_dict else masks[next(iter(masks))],
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1].float()

    def prefill(self, r0: int, chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run ``chunks[i]`` at positions ``starts[i]..`` of slot ``r0 + i`` (K/V before ``starts[i]`` are
        already there); left-padded, pads write the scratch column.  Logits of each last token."""
        dev = self.device
        lens = [len(c) for c in chunks]
        start = torch.tensor(starts, device=dev)
        t = max(lens)  # from the host lists: no device sync on CUDA
        ids = torch.zeros((len(chunks), t), dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, t - len(c) :] = torch.tensor(c)
        # left padding puts every row's last token in the last column, so an int ``logits_to_keep``
        # picks them on every transformers version (a per-row index tensor means different things
        # across versions).  A pad takes its row's first position (its rope and mask stay in
        # range) but writes the scratch column, which no query sees.
        pad = torch.tensor([t - k for k in lens], device=dev)[:, None]
        cols = torch.arange(t, device=dev)[None, :]
        positions = start[:, None] + (cols - pad).clamp(min=0)
        write_idx = torch.where(cols >= pad, positions, self.cache.scratch)
        kv_len = max(s + k for s, k in zip(starts, lens, strict=True))
        return self.padded(r0, ids.to(dev), positions, write_idx, kv_len)

    def decode(self, r0: int, ids: list[list[int]], positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        tok = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.padded(r0, tok, pos, pos, max(positions) + 1)

    def ragged(self, decode: list[tuple[int, int]], drafts: list[list[int]],
                       segments: list[tuple[int, list[int], int]], keep: list[int]) -> torch.Tensor:  # fmt: skip
        """One ragged forward (:mod:`agentrl.inference.ragged`): ``decode[i]`` = (token, position) of
        slot ``i``, followed by the tokens ``drafts[i]``; each segment (slot, tokens, first position).
        ``[len(keep), V]`` float32 logits of the flat tokens ``keep`` names: decode tokens first, then
        the drafts, then the segments' tokens, each in order."""
        dev, kinds = self.device, self.mask_kinds
        plan, ids, positions, slots = ragged.layout(decode, drafts, segments, self.layer_kinds, self.masks, dev)
        if self.decode_kernel:
            plan.kernel_windows = self.mask_kinds
        self.cache.bind_flat(slots, positions)
        # the attention reads the plan's masks; the model only passes a 4-D mask on (it builds none)
        dummy = torch.ones((1, 1, len(ids), 1), dtype=torch.bool, device=dev)
        with ragged.bound(plan):
            out = self.model(
                input_ids=torch.tensor(ids, device=dev)[None],
                attention_mask={kind: dummy for kind in kinds} if self.mask_dict else dummy,
                position_ids=positions[None],
                use_cache=True,
                logits_to_keep=torch.tensor(keep, device=dev),
                **{self.cache_kw: self.cache},
            )
        return out.logits[0].float()
