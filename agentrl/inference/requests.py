"""What a request to the embedded engine is and what comes back: the checks a request must
pass (the engine's and an engine core's front end apply the same), the finished choice
(:class:`SequenceResult`) and the per-token stream events (:class:`TokenEvent`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentrl.errors import RequestError


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
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
