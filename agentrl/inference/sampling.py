"""The μ contract: how the embedded engine samples a token and what logprob it reports.

Per row, logits are divided by ``temperature``; then, in vLLM v1's order, min-p (keep tokens
whose probability is at least ``min_p`` times the top token's), top-k, and top-p (nucleus over
the distribution the first two left, always keeping the top token).  Each filter keeps a
*prefix* of the tokens sorted by scaled logit, so what survives is always the top ``K`` tokens,
a tie at the boundary kept whole (:mod:`agentrl.support`, the rule the trainer applies too):
``K`` is the token's **support**, reported with every sampled token.  The token is drawn from
the softmax over its support, and the reported logprob μ is that distribution's log-probability
of the drawn token (vLLM's ``processed_logprobs``).

The trainer mirrors this exactly (:mod:`agentrl.trainer.logprobs`): π_θ of a token is the
softmax of the trainer's own scaled logits renormalised over its top ``K`` tokens, so with
identical weights π_θ/μ = 1 at any temperature, top-k, top-p and min-p, ties included.

``temperature == 0`` is greedy and reports the raw (T = 1, unfiltered) log-softmax with
support V.  A terminating eos token is sampled like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrl import support as support_rule
from agentrl.types import SamplingParams

TOP_LOGPROB_FLOOR = -9999.0  # what vLLM reports for a top logprob of a token that cannot be drawn


@dataclass
class EngineSampling(SamplingParams):
    """:class:`~agentrl.types.SamplingParams` plus what only the engine's HTTP layer sets."""

    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False


@dataclass
class Draw:
    """One sampling step over ``R`` rows."""

    tokens: list[int]
    logprobs: list[float]  # μ of each drawn token
    support: list[int]  # K: size of the kept set each token was drawn from
    top_logprobs: list[list[tuple[int, float]]] | None = None


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled logits with everything outside the support at −inf, and the support sizes ``K``.

    ``logits`` is ``[R, V]`` float32; greedy rows are returned unscaled and unfiltered.
    """
    r, v = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    greedy = temps <= 0
    # x / 1 == x exactly: at T = 1 (or greedy) skip a [R, V] pass and its allocation
    unit = all(p.temperature == 1 or p.temperature <= 0 for p in params)
    scaled = logits if unit else logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < v and p.temperature > 0 else v for p in params], device=device)
    top_p = torch.tensor([p.top_p if p.temperature > 0 else 1.0 for p in params], device=device)
    min_p = torch.tensor([p.min_p if p.temperature > 0 else 0.0 for p in params], device=device)
    if not (bool((top_k < v).any()) or bool((top_p < 1).any()) or bool((min_p > 0).any())):
        return scaled, torch.full((r,), v, dtype=torch.long, device=device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=device)[None, :]
    # vLLM v1's order: 1) min-p on the temperature-scaled distribution, p_i ≥ min_p·p_max ⇔
    # logit_i ≥ logit_max + log(min_p); 2) top-k; 3) top-p over what the first two kept
    floor = sorted_logits[:, :1] + torch.log(min_p.clamp(min=1e-30))[:, None]
    remove = (sorted_logits < floor) & (min_p[:, None] > 0) & (ranks > 0)
    remove |= ~support_rule.kept(sorted_logits, torch.minimum(top_k, (~remove).sum(dim=-1)), sorted_logits)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    # top_p = 1 is off (greedy rows too): a float32 running mass reaches 1.0 before the tail, and
    # cutting that tail made a row's support depend on whether another row in its batch filters
    remove |= (before >= top_p[:, None]) & (ranks > 0) & (top_p[:, None] < 1)
    # a tie at the boundary is kept whole (agentrl.support: the trainer applies the same rule to K)
    keep = support_rule.kept(sorted_logits, (~remove).sum(dim=-1), sorted_logits)
    support = keep.sum(dim=-1)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits), support


BLOCK = 256  # the inverse CDF's first level: one float64 sum per block of this many tokens


def draw(probs: torch.Tensor, generator: torch.Generator, sums: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``[R, V]`` (unnormalised, >= 0), by inverting its CDF.

    One uniform per row instead of ``torch.multinomial``'s one exponential per vocabulary entry
    (15-60x less time on a CPU, the largest part of sampling at a 49k vocabulary).  ``sums``:
    :func:`block_sums` of ``probs`` when the caller has them already.
    """
    u = 1 - torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    return invert_cdf(probs, u, sums)


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """``[R, ceil(V / BLOCK)]`` float64 sums of consecutive blocks of ``probs`` (the last may be short)."""
    r, v = probs.shape
    full = v // BLOCK
    sums = torch.empty((r, -(-v // BLOCK)), dtype=torch.float64, device=probs.device)
    if full:
        torch.sum(probs[:, : full * BLOCK].reshape(r, full, BLOCK), dim=-1, dtype=torch.float64, out=sums[:, :full])
    if v % BLOCK:
        sums[:, full] = probs[:, full * BLOCK :].sum(dim=-1, dtype=torch.float64)
    return sums


def invert_cdf(probs: torch.Tensor, u: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """The first index whose running sum reaches ``u`` (in ``(0, 1]``) of the row's total: it has
    ``cdf[i-1] < u·total <= cdf[i]``, so its probability is positive and a token outside the
    support is never drawn.  Sums run in float64: in float32, at a 49k vocabulary, thousands of
    tokens with p > 0 got zero-width intervals (never drawn) and others were drawn up to 5 % off
    their reported μ.

    Two levels, so no ``[R, V]`` float64 running sum is ever built: the block whose running
    sum reaches the target, then the token inside that block.  ``sums``: :func:`block_sums`
    of ``probs`` when the caller has them already."""
    r, v = probs.shape
    if sums is None:
        sums = block_sums(probs)
    cum = sums.cumsum(dim=-1)
    target = u.double() * cum[:, -1]  # <= the total, since u <= 1
    # the first block whose running sum reaches the target: its sum is > 0 and the target is past its start
    b = torch.searchsorted(cum, target[:, None]).squeeze(1).clamp_(max=cum.shape[1] - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(target))
    cols = b[:, None] * BLOCK + torch.arange(BLOCK, device=probs.device)[None, :]
    # past the vocabulary (a short last block) the gather repeats token v-1; the final clamp maps those back
    inside = probs.gather(1, cols.clamp(max=v - 1)).double().cumsum_(dim=-1)
    # the block's own running sum may end a rounding error short of the target: its last token with p > 0 then
    rest = torch.minimum(target - before, inside[:, -1])
    j = torch.searchsorted(inside, rest[:, None]).squeeze(1)
    return (b * BLOCK + j).clamp_(max=v - 1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rng: torch.Generator,
) -> Draw:
    """Draw one token per row (see the module docstring for μ and the support).

    Three passes over the ``[R, V]`` logits (max, exp, block sums) and no log-softmax: μ of the
    drawn token is its scaled logit minus the row's log-sum-exp, from the same sums the draw
    inverts (a full ``[R, V]`` log-softmax is built only for top logprobs)."""
    r, v = logits.shape
    is_greedy = [p.temperature <= 0 for p in params]
    scaled, support = filtered_logits(logits, params)  # greedy rows: the raw logits, support V
    top = scaled.amax(dim=-1, keepdim=True)
    probs = torch.sub(scaled, top).exp_()  # in (0, 1], 0 outside the support
    sums = block_sums(probs)
    lse = top.squeeze(1).double() + sums.sum(dim=-1).log()

    tokens = draw(probs, rng, sums) if not all(is_greedy) else None
    if any(is_greedy):
        greedy = torch.tensor(is_greedy, device=logits.device)
        tokens = logits.argmax(dim=-1) if tokens is None else torch.where(greedy, logits.argmax(dim=-1), tokens)
    for i, g in enumerate(generators):
        if g is not None and not is_greedy[i]:
            tokens[i] = draw(probs[i : i + 1], g, sums[i : i + 1])[0]  # its block sums are already here
    chosen = scaled.gather(1, tokens[:, None]).squeeze(1).double() - lse

    tops = None
    k_max = max(getattr(p, "top_logprobs", 0) for p in params)
    if k_max > 0:
        vals, idx = scaled.topk(min(k_max, v), dim=-1)
        vals = (vals.double() - lse[:, None]).clamp_min(TOP_LOGPROB_FLOOR)  # outside the kept set: -inf; JSON has no -inf
        vals_l, idx_l = vals.float().tolist(), idx.tolist()  # float32 as μ is: the drawn token's entry equals its μ
        ks = [getattr(p, "top_logprobs", 0) for p in params]
        tops = [list(zip(idx_l[i][: ks[i]], vals_l[i][: ks[i]], strict=True)) for i in range(r)]
    return Draw(tokens.tolist(), chosen.float().tolist(), support.tolist(), tops)
