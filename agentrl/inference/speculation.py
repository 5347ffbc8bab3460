"""N-gram speculation: draft tokens from what earlier sequences wrote after the same n tokens.

An agent's completions repeat themselves: the tool-call JSON around the arguments, the
chat template's markers, phrases of the task.  :class:`NgramDrafter` keeps, for each
``n``-token context it has seen in a finished sequence, the ``k`` tokens that followed
(the latest seen wins), and proposes them as a running sequence's next tokens.  The engine
runs them in the same ragged forward as the sequence's decode token
(:mod:`agentrl.inference.ragged`) and samples every position as usual; a draft token is
kept while it equals the token sampled at its position, and the first sampled token that
differs ends the run (it is kept too).

That is exact: each kept token is the token sampling drew from the same distribution at the
same position, so tokens, their μ, their support and the weight version are what decoding
one token at a time would have given (with a point-mass draft this is speculative sampling's
rule: a draft ``d`` is accepted with probability ``p(d)``, and after a rejection the token is
drawn from ``p`` without ``d``).  A draft only changes how many forwards the tokens take.

:class:`Speculation` is the engine's side: which drafts each running sequence runs this step,
which of them it keeps, and how many drafts a sequence may run next (as many as it kept plus
one).  It owns the rule above, so the engine's step only lays the drafts out in its forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentrl.inference.requests import Recorder, _Sequence


class NgramDrafter:
    """A bounded table: ``n`` tokens -> the up to ``k`` tokens that followed them last.  Past
    ``capacity`` entries it keeps the most recently written half."""

    def __init__(self, n: int, k: int, capacity: int = 1 << 17):
        if n < 1 or k < 1:
            raise ValueError(f"n-gram speculation needs n >= 1 and k >= 1, got n={n}, k={k}")
        self.n, self.k, self.capacity = n, k, capacity
        self._table: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def learn(self, tokens: Sequence[int], start: int = 0) -> None:
        """Record what followed each n-gram of ``tokens`` whose continuation starts at or after ``start``."""
        n, k, table = self.n, self.k, self._table
        end = len(tokens)
        for i in range(max(n, start), end):
            key = tuple(tokens[i - n : i])
            if i + k <= end:
                table.pop(key, None)  # re-inserted: the table's order is last use
                table[key] = tuple(tokens[i : i + k])
            elif key not in table:  # a sequence's short tail never replaces a full continuation
                table[key] = tuple(tokens[i:end])
        if len(table) > self.capacity:  # keep the newest half, in one pass (deleting one by one went quadratic)
            self._table = dict(islice(table.items(), len(table) - self.capacity // 2, None))

    def propose(self, tail: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` draft tokens to follow ``tail`` (the context's last ``n`` tokens at least)."""
        if limit < 1 or len(tail) < self.n:
            return ()
        return self._table.get(tuple(tail[-self.n :]), ())[:limit]


class Speculation:
    """Drafts for one ragged step and the rule that keeps them, with the counts the engine
    reports.  Without a drafter every sequence runs no drafts and nothing changes."""

    def __init__(self, drafter: NgramDrafter | None, max_model_len: int):
        self.drafter, self.max_model_len = drafter, max_model_len
        self.k = drafter.k if drafter is not None else 0  # most draft tokens per sequence and step
        self.draft_tokens = 0  # draft tokens run through a forward
        self.accepted_draft_tokens = 0  # of those, kept (equal to the token sampled at their position)

    def drafts(self, seqs: list[_Sequence]) -> list[list[int]]:
        """Each sequence's draft tokens (none past its max_tokens or the context: every one it keeps must fit)."""
        d = self.drafter
        if d is None:
            return [[] for _ in seqs]
        out = []
        for s in seqs:
            prompt, done = s.request.prompt_ids, s.token_ids
            limit = min(d.k, s.draft_limit, s.request.sampling.max_tokens - len(done) - 1,
                        self.max_model_len - len(prompt) - len(done) - 1)  # fmt: skip
            out.append(list(d.propose(prompt[-d.n :] + done[-d.n :], limit)))  # it reads the last n
        return out

    @staticmethod
    def generator_states(seqs: list[_Sequence], drafts: list[list[int]]) -> dict[int, torch.Tensor]:
        """Before sampling: the seeded drafting sequences' generator states.  Sampling draws one uniform
        per row, rows after a mismatch too; :meth:`keep` rewinds to one per kept token, so a seed gives
        the same tokens with or without drafts (whatever the drafter has seen)."""
        return {id(s): s.generator.get_state() for s, d in zip(seqs, drafts, strict=True)
                if d and s.generator is not None and s.request.sampling.temperature > 0}  # fmt: skip

    def keep(self, seqs: list[_Sequence], drafts: list[list[int]], rec: Recorder,
             states: dict[int, torch.Tensor]) -> int:  # fmt: skip
        """Record each sequence's tokens from its rows of ``rec``'s draw (its decode row, then one per
        draft, sequence after sequence): each row's sampled token, up to and including the first that
        differs from the draft at its position or finishes the sequence.  Returns the number of rows
        these sequences occupy (the first admitted prompt's row)."""
        tokens, k = rec.draw.tokens, 0
        for s, d in zip(seqs, drafts, strict=True):
            valid = 1  # the decode token's K/V, then each kept draft token's
            for j in range(len(d) + 1):
                rec.add(s, k + j)
                kept = j < len(d) and tokens[k + j] == d[j]
                valid += kept
                if s.finish_reason is not None or not kept:
                    break
            s.cached += valid
            state = states.get(id(s))
            if state is not None:
                s.generator.set_state(state)
                for _ in range(j + 1):  # one draw per token kept, as sampling takes them (rand(n) differs on CUDA)
                    torch.rand(1, generator=s.generator, device=s.generator.device, dtype=torch.float64)
            if d:  # one more draft token after a run that kept all its drafts, else as many as it kept plus one
                s.draft_limit = len(d) + 1 if valid > len(d) else valid
            k += len(d) + 1
            self.draft_tokens += len(d)
            self.accepted_draft_tokens += valid - 1
        return k

    def learn(self, done: list[_Sequence]) -> None:
        """What finished sequences wrote drafts the next ones."""
        if self.drafter is None:
            return
        n = self.drafter.n
        for s in done:
            self.drafter.learn(s.request.prompt_ids[-n:] + s.token_ids, start=min(n, len(s.request.prompt_ids)))
