"""What a request to the embedded engine is and what comes back: the checks a request must
pass (the engine's and an engine core's front end apply the same), a request and its choices
while they run, the finished choice (:class:`SequenceResult`), the per-token stream events
(:class:`TokenEvent`), and :class:`Recorder`, which appends a step's sampled tokens."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentrl import devices
from agentrl.errors import EngineStartError, RequestError
from agentrl.inference.sampling import Draw, EngineSampling


@dataclass
class SequenceResult:
    """One finished choice."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    support: list[int] = field(default_factory=list)  # kept-set size K of each token's distribution


@dataclass
class TokenEvent:
    """One token one choice sampled in one step, as handed to a request's ``on_tokens``."""

    index: int  # the choice
    token_id: int
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None = None  # set on the choice's last token
    text: str | None = None  # the choice's whole final text, with finish_reason
    support: int = 0


TokenCallback = Callable[[list[TokenEvent]], None]


def resolve_device(device: str) -> torch.device:
    """The torch device an engine runs on; :class:`~agentrl.errors.EngineStartError` (one line, which
    an engine's server prints as its refused start) for a name that is not a device or a CUDA
    device this host lacks (:mod:`agentrl.devices`)."""
    return devices.resolve_device(device, EngineStartError, "inference.device")


def check_request(prompt_ids: list[int], n: int, vocab_size: int, max_model_len: int, max_batch_size: int) -> None:
    """Raise :class:`~agentrl.errors.RequestError` for a request the engine cannot run (what
    :meth:`Engine.submit` refuses; a front end in another process checks the same before sending)."""
    if not prompt_ids:
        raise RequestError("prompt must contain at least one token", param="prompt")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {len(prompt_ids)} tokens, leaving no room for a completion. Please reduce "
            "the length of the messages or prompt.",
            code="context_length_exceeded",
            param="messages",
        )
    if n < 1 or n > max_batch_size:
        raise RequestError(f"n must be between 1 and {max_batch_size}, got {n}", param="n")


@dataclass
class _Sequence:
    request: _Request
    index: int
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the cache
    epoch: int = 0  # the prefix-cache epoch its K/V started in (stale once the weights change)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    support: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    draft_limit: int = 1 << 30  # draft tokens this sequence may run next step (speculation adapts it)
    finish_reason: str | None = None
    text: str | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: EngineSampling
    n: int
    future: concurrent.futures.Future
    seqs: list[_Sequence] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    on_tokens: TokenCallback | None = None


class Recorder:
    """Appends one step's sampled tokens to their sequences and collects their stream events
    (the engine hands them off and counts them once per step)."""

    def __init__(self, draw: Draw, version: int, check_finished: Callable[[_Sequence, int], None],
                 detokenize: Callable[[list[int]], str]):  # fmt: skip
        self.draw, self.version = draw, version
        self.check_finished, self.detokenize = check_finished, detokenize
        self.count = 0
        self.streams: dict[int, tuple[_Request, list[TokenEvent]]] = {}  # id(request) -> step's events

    def add(self, s: _Sequence, k: int) -> None:
        """Row ``k`` of the draw is ``s``'s next token."""
        draw = self.draw
        tok, logp, top = draw.tokens[k], draw.logprobs[k], draw.top_logprobs[k] if draw.top_logprobs is not None else None
        s.token_ids.append(tok)
        s.logprobs.append(logp)
        s.versions.append(self.version)
        s.support.append(draw.support[k])
        if top is not None:
            s.top_logprobs.append(top)
        self.check_finished(s, tok)
        self.count += 1
        if s.request.on_tokens is not None:
            if s.finish_reason is not None and s.text is None:
                s.text = self.detokenize(s.token_ids)  # _result reuses it
            ev = TokenEvent(s.index, tok, logp, self.version, top, s.finish_reason,
                            s.text if s.finish_reason is not None else None, draw.support[k])  # fmt: skip
            self.streams.setdefault(id(s.request), (s.request, []))[1].append(ev)
