"""The token path's wire format: a ``/v1/completions`` request for an exact token-id prompt
(or vLLM's ``/inference/v1/generate``) and its reply read back as
:class:`~agentrl.types.Completion` records, with each token's μ, support and version.

Pure functions over JSON; :meth:`~agentrl.inference.client.PolicyClient.complete` sends the
request and routes it.
"""

from __future__ import annotations

from typing import Any

from agentrl.errors import EndpointError, MalformedResponse
from agentrl.tool_format import get_parser
from agentrl.types import Completion, SamplingParams


def sampling_body(s: SamplingParams, n: int, tool_parser: str) -> dict[str, Any]:
    """Every sampling field, explicitly: server-side defaults never change the distribution.
    Special tokens stay in the text where the model's tool-call markers are special tokens
    (``[TOOL_CALLS]``, ``<|python_tag|>``), as vLLM's own tool parsers ask for."""
    body: dict[str, Any] = {
        "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "n": n,
        "top_k": s.top_k if s.top_k and s.top_k > 0 else -1, "min_p": s.min_p,
        "return_token_ids": True, "skip_special_tokens": not get_parser(tool_parser).special_markers,
    }  # fmt: skip
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = s.stop
    return body


def read_completions(resp: Any, choices: list[dict[str, Any]], prompt_ids: list[int], sampling: SamplingParams,
                     start_version: int, top_n: int) -> list[Completion]:
    """The reply's choices as completions, in index order.  A server without per-token
    versions gets ``start_version`` on every token; the support comes from the reply's
    ``token_support``, else top_k itself, else the top-``top_n`` logprobs (:func:`support_from_top`)."""
    out = []
    for ch in sorted(choices, key=lambda c: c.get("index", 0)):
        ids = ch.get("token_ids") or []
        lps = (ch.get("logprobs") or {}).get("token_logprobs") or []
        if len(lps) != len(ids):
            raise MalformedResponse(f"endpoint returned {len(ids)} token ids but {len(lps)} logprobs")
        versions = ch.get("token_versions")
        if not (isinstance(versions, list) and len(versions) == len(ids)):
            versions = [start_version] * len(ids)
        support = ch.get("token_support")
        if not (isinstance(support, list) and len(support) == len(ids)):
            support = []
        if not support and ids and top_k_only(sampling):  # the support is top_k itself
            support = [sampling.top_k] * len(ids)
        if not support and ids and top_n:
            support = support_from_top(ch, len(ids), top_n)
        out.append(
            Completion(
                text=ch.get("text") or "", token_ids=ids, logprobs=lps, versions=versions,
                finish_reason=ch.get("finish_reason"), support=support,
                prompt_token_ids=ch.get("prompt_token_ids") or resp.get("prompt_token_ids") or prompt_ids,
                prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
            )
        )  # fmt: skip
    return out


# vLLM's top logprob for a token outside the kept set (the embedded engine's too: sampling.TOP_LOGPROB_FLOOR;
# that module imports torch, which this client never needs)
_TOP_FLOOR = -9999.0


def generate_body(completions_body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` body as vLLM's ``/inference/v1/generate`` takes it (token ids in,
    vLLM's own SamplingParams fields, text detokenized)."""
    b = dict(completions_body)
    sampling = {k: b.pop(k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
                                      "logprobs", "skip_special_tokens") if k in b}  # fmt: skip
    out = {"model": b["model"], "token_ids": b["prompt"], "sampling_params": {**sampling, "detokenize": True},
           "output_mode": "text", "return_token_ids": True}  # fmt: skip
    if "cache_salt" in b:
        out["cache_salt"] = b["cache_salt"]
    return out


def from_generate(ch: dict[str, Any], start_version: int) -> dict[str, Any]:
    """A ``/inference/v1/generate`` choice in ``/v1/completions`` shape, with ``token_versions``
    read from its weight-version spans (a token outside every span: ``start_version``)."""
    ids = ch.get("token_ids") or []
    content = (ch.get("logprobs") or {}).get("content") or []
    versions = [start_version] * len(ids)
    for span in ch.get("weight_versions") or []:
        v = str(span.get("version", ""))
        if v.isdigit():
            for i in range(max(0, int(span["start"])), min(len(ids), int(span["end"]))):
                versions[i] = int(v)
    return {
        "index": ch.get("index", 0), "text": ch.get("text") or "", "token_ids": ids,
        "finish_reason": ch.get("finish_reason"), "token_versions": versions,
        "logprobs": {"token_logprobs": [e.get("logprob") for e in content],
                     "top_logprobs": [{i: t.get("logprob") for i, t in enumerate(e.get("top_logprobs") or [])}
                                      for e in content]},
    }  # fmt: skip


def truncates(s: SamplingParams) -> bool:
    """Whether the kept set is decided by the distribution (top-p, min-p), not by top_k alone."""
    return s.temperature > 0 and (s.top_p < 1 or s.min_p > 0)


def support_from_top(ch: dict[str, Any], n_tokens: int, top_n: int) -> list[int]:
    """Support sizes K from a choice's top-``top_n`` processed logprobs (vLLM: a token outside the
    kept set is at the floor, -9999).  Fewer than ``top_n`` entries above the floor is K exactly;
    ``top_n`` of them only says K ≥ ``top_n``: :class:`EndpointError` (the episode is errored,
    nothing is trained on a guessed distribution)."""
    tops = (ch.get("logprobs") or {}).get("top_logprobs")
    if not (isinstance(tops, list) and len(tops) == n_tokens):
        raise MalformedResponse(f"the endpoint returned {n_tokens} tokens but no top logprobs for each")
    support = []
    for top in tops:
        kept = sum(1 for v in (top or {}).values() if isinstance(v, int | float) and v > _TOP_FLOOR)
        if kept >= top_n:
            raise EndpointError(
                f"support size unknown: {kept} of the top {top_n} logprobs are in the kept set, so K ≥ {top_n} and "
                "the trainer cannot rebuild μ; lower rollout.top_p (or raise min_p), or start vLLM with a larger "
                "--max-logprobs"
            )
        support.append(kept)
    return support


def top_k_only(s: SamplingParams) -> bool:
    """Whether top_k alone decides the kept set (so it is the support)."""
    return s.temperature > 0 and s.top_k is not None and s.top_k > 0 and s.top_p >= 1 and s.min_p <= 0


def choices_of(resp: Any) -> list[dict[str, Any]]:
    """A reply's ``choices`` list; :class:`MalformedResponse` when there is none."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list):
        raise MalformedResponse("the endpoint's reply has no 'choices' list")
    return choices
