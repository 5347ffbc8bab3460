"""Prefix reuse for the embedded engine: K/V blocks of earlier prompts and completions.

A sequence's K/V lives in its slot (:mod:`agentrl.inference.kv_cache`) only while it runs.
This cache keeps copies of full ``block_size``-token blocks in a pool
``[layers, num_blocks, kv_heads, block_size, head_dim]`` after a prompt is prefilled and when
a sequence finishes, so that

- a multi-turn episode's next turn (whose prompt extends the previous prompt + completion)
  prefills only its new tokens, and
- the G episodes of a group (same prompt) prefill that prompt once.

Blocks form a tree: a block is keyed by ``(parent block id, its tokens)``, ids are never
reused, so a key names one exact token prefix (no hash can collide).  A prompt's cached
prefix is the chain of its full blocks found from the root; admission copies those blocks
into the new sequence's slot and prefills the rest.

Eviction is least-recently-used over blocks, with every block kept more recent than all its
descendants (a lookup or insert touches its chain from the deepest block up to the root), so
the least recent block is always a leaf and no chain is left with a hole.

Weights: K/V computed by older weights are stale.  The engine clears the cache on every
weight update (unless told to keep it) and never stores a sequence whose K/V spans an update.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from agentrl.inference.kv_cache import SlotCache

BlockKey = tuple[int, tuple[int, ...]]  # (parent block id, the block's tokens); root id 0


@dataclass(eq=False)
class Block:
    id: int
    index: int  # row of the pool
    key: BlockKey


class PrefixCache:
    """Block pool + tree + LRU (see the module docstring)."""

    def __init__(self, slots: SlotCache, num_blocks: int, block_size: int):
        layers, _, kv_heads, _, head_dim = slots.k.shape
        shape = (layers, num_blocks, kv_heads, block_size, head_dim)
        self.slots = slots
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = torch.zeros(shape, dtype=slots.k.dtype, device=slots.k.device)
        self.v = torch.zeros(shape, dtype=slots.v.dtype, device=slots.v.device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._by_key: dict[BlockKey, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()  # block id -> block, least recent first
        self._next_id = 1
        self.evicted_blocks = 0
        self.stored_blocks = 0

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: list[int]) -> list[Block]:
        """The cached chain of ``tokens``' full blocks, from the first (touched as used)."""
        bs, parent, chain = self.block_size, 0, []
        for j in range(len(tokens) // bs):
            block = self._by_key.get((parent, tuple(tokens[j * bs : (j + 1) * bs])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        self._touch(chain)
        return chain

    def next_key(self, tokens: list[int], chain: list[Block]) -> BlockKey | None:
        """The key of the first full block of ``tokens`` after ``chain`` (None if there is none)."""
        bs, j = self.block_size, len(chain)
        if (j + 1) * bs > len(tokens):
            return None
        return (chain[-1].id if chain else 0, tuple(tokens[j * bs : (j + 1) * bs]))

    def load(self, chain: list[Block], row: int) -> None:
        """Copy ``chain``'s K/V into slot ``row`` at columns ``0 .. len(chain) * block_size``."""
        if not chain:
            return
        idx = torch.tensor([b.index for b in chain], device=self.k.device)
        n = len(chain) * self.block_size
        # pool [L, m, H, bs, D] -> slot [L, H, m*bs, D]
        self.slots.k[:, row, :, :n] = self.k[:, idx].transpose(1, 2).flatten(2, 3)
        self.slots.v[:, row, :, :n] = self.v[:, idx].transpose(1, 2).flatten(2, 3)

    # ------------------------------------------------------------------ insert / evict

    def store(self, tokens: list[int], row: int, length: int) -> int:
        """Keep the full blocks of ``tokens[:length]`` from slot ``row``; returns blocks added."""
        bs = self.block_size
        n_blocks = min(length, len(tokens)) // bs
        parent, chain, new = 0, [], []  # new: (pool index, block number in the sequence)
        for j in range(n_blocks):
            key = (parent, tuple(tokens[j * bs : (j + 1) * bs]))
            block = self._by_key.get(key)
            if block is None:
                index = self._allocate(protect={b.id for b in chain})
                if index is None:
                    break
                block = Block(self._next_id, index, key)
                self._next_id += 1
                self._by_key[key] = block
                self._lru[block.id] = block
                new.append((index, j))
            chain.append(block)
            parent = block.id
        if new:
            dst = torch.tensor([i for i, _ in new], device=self.k.device)
            src = [j for _, j in new]
            # slot [L, H, n*bs, D] -> [L, H, n, bs, D] -> the new blocks as pool rows [L, m, H, bs, D]
            self.k[:, dst] = self.slots.k[:, row, :, : n_blocks * bs].unflatten(2, (n_blocks, bs))[:, :, src].transpose(1, 2)
            self.v[:, dst] = self.slots.v[:, row, :, : n_blocks * bs].unflatten(2, (n_blocks, bs))[:, :, src].transpose(1, 2)
            self.stored_blocks += len(new)
        self._touch(chain)
        return len(new)

    def _allocate(self, protect: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim = next(iter(self._lru.values()))
        if victim.id in protect:  # the pool is smaller than this one chain
            return None
        del self._lru[victim.id]
        del self._by_key[victim.key]
        self.evicted_blocks += 1
        return victim.index

    def _touch(self, chain: list[Block]) -> None:
        for block in reversed(chain):  # the root ends most recent: eviction takes leaves first
            self._lru.move_to_end(block.id)

    def clear(self) -> None:
        """Forget every block (weights changed)."""
        self._by_key.clear()
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def used_blocks(self) -> int:
        return len(self._lru)
