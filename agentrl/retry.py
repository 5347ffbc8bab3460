"""The one retry policy for HTTP endpoints (the policy client and LLM judges).

``await retrying(attempt_fn, what=..., max_retries=3)`` calls ``attempt_fn(attempt)``; a
:class:`Transient` failure is retried after a jittered exponential backoff (0.1 s, 0.2 s,
0.4 s ... capped at ``max_backoff_s``), anything else propagates at once.  After the last
attempt the last transient error is raised as ``exhausted(message)``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Status codes worth another try: timeouts, conflicts, rate limits, server errors.
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


def is_transient_status(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


class Transient(Exception):
    """Wraps a failure that another attempt may not repeat (connection, timeout, 5xx, 429)."""

    def __init__(self, cause: BaseException, where: str = ""):
        super().__init__(f"{where}: {cause!r}" if where else repr(cause))
        self.cause, self.where = cause, where


def backoff_s(attempt: int, base_s: float = 0.1, max_backoff_s: float = 2.0) -> float:
    """Jittered exponential backoff before retry number ``attempt + 1``."""
    return min(max_backoff_s, base_s * 2**attempt) * (0.5 + random.random())


async def retrying(
    attempt_fn: Callable[[int], Awaitable[T]],
    *,
    what: str,
    max_retries: int,
    exhausted: Callable[[str], Exception],
    base_s: float = 0.1,
    max_backoff_s: float = 2.0,
) -> T:
    """Run ``attempt_fn(0)``, ``attempt_fn(1)`` … until one returns or fails non-transiently."""
    last: Transient | None = None
    for attempt in range(max_retries + 1):
        try:
            return await attempt_fn(attempt)
        except Transient as e:
            last = e
        if attempt < max_retries:
            await asyncio.sleep(backoff_s(attempt, base_s, max_backoff_s))
    assert last is not None
    raise exhausted(f"{what} failed after {max_retries + 1} attempts: {last}") from last.cause
