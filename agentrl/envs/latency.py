"""Slow tools on purpose: a heavy-tailed delay before a tool answers.

Real agentic tools (a search API, a sandboxed test run, a web page) answer in a few hundred
milliseconds most of the time and in seconds now and then.  :class:`ToolLatency` draws such
delays from a lognormal fixed by its median and its 99th percentile
(σ = ln(p99 / median) / z₀.₉₉, z₀.₉₉ ≈ 2.326), capped at ``max_s``; :func:`with_latency`
wraps a tool so every call waits one draw (``asyncio.sleep``: the event loop keeps running,
so other episodes go on meanwhile).  Environments expose it as arguments, e.g. the calc
environment's ``tool_latency_median_s`` / ``tool_latency_p99_s``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass
class ToolLatency:
    """Lognormal delay with the given median and p99 (seconds), capped at ``max_s``."""

    median_s: float
    p99_s: float
    max_s: float = 30.0
    seed: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.max_s <= 0:
            raise ValueError(f"tool latency needs median_s >= 0 and max_s > 0, got {self.median_s}, {self.max_s}")
        if self.median_s > 0 and self.p99_s < self.median_s:
            raise ValueError(f"tool latency p99_s ({self.p99_s}) must be >= median_s ({self.median_s})")
        self.rng = random.Random(f"tool-latency-{self.seed}")

    @property
    def sigma(self) -> float:
        """σ of the underlying normal: ln(p99 / median) / z₀.₉₉ (0 when p99 == median)."""
        return math.log(self.p99_s / self.median_s) / Z99 if self.median_s > 0 else 0.0

    def sample(self) -> float:
        """One delay in seconds (0 when the median is 0)."""
        if self.median_s == 0:
            return 0.0
        return min(self.max_s, self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)))


def with_latency(fn: Callable[..., Any], latency: ToolLatency) -> Callable[..., Any]:
    """``fn`` as an async tool that first waits one draw of ``latency``; same name, signature,
    docstring and type hints (so the same schema)."""

    @functools.wraps(fn)
    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(latency.sample())
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return slow
