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
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice


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
