"""π_θ of sampled tokens on the sampler's own basis, computed in chunks.

The engine reports, per sampled token, μ and the size ``K`` of the kept set it was drawn
from (temperature, then top-k / top-p / min-p, which always keep the top ``K`` tokens by
scaled logit, a tie at the boundary kept whole: :mod:`agentrl.support`, the rule both sides
call).  The trainer mirrors that distribution:

    log π_θ(y) = z_y / T − logsumexp_{top K of z / T}       (K = 0 or K ≥ V: the full vocabulary)

where ``z`` are the trainer's logits.  With identical weights this equals μ exactly, so the
ratio π_θ/μ is 1 at any temperature, top-k, top-p and min-p.  When the weights differ the
trainer's own top ``K`` may no longer contain ``y``: such a token has no probability under
the replayed distribution and is reported in ``outside`` (the loss masks it).

Memory (:func:`token_logprobs_from_hidden`, what the trainer uses): the decoder's hidden
states at the loss positions go through the LM head ``chunk_tokens`` rows at a time, every
chunk but the last under activation checkpointing (the last one's backward runs first, before
any other chunk is rebuilt), so no ``[N, V]`` tensor — logits, log-softmax, the sort a
truncated support needs, or their gradients — exists for more than one chunk, in the forward
or the backward.  ``benchmarks/trainer_memory.py`` measures it against the naive path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from agentrl import support as support_rule


def _chunk(logits: Tensor, tokens: Tensor, support: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log π_θ of ``tokens``, entropy over the support, token outside the support) for one chunk."""
    z = logits.float() * inv_t  # [n, V]
    v = z.shape[-1]
    chosen = z.gather(-1, tokens[:, None]).squeeze(-1)
    truncated = bool((~support_rule.full(support, v)).any())
    if truncated:
        # the top-K set's logsumexp, the set as the engine built it (agentrl.support: ties at the boundary kept)
        z_sorted = z.detach().sort(dim=-1, descending=True).values
        kth = support_rule.boundary(z_sorted, support)
        kept = z >= kth
        lse = torch.logsumexp(z.masked_fill(~kept, float("-inf")), dim=-1)
        outside = chosen.detach() < kth.squeeze(-1)
    else:
        kept = None
        lse = torch.logsumexp(z, dim=-1)
        outside = torch.zeros_like(chosen, dtype=torch.bool)
    with torch.no_grad():  # entropy is a metric: no graph, no saved [n, V] intermediates
        logp_all = z.detach() - lse.detach()[:, None]
        if kept is not None:
            logp_all = logp_all.masked_fill(~kept, float("-inf"))
        p = logp_all.exp()
        entropy = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return chosen - lse, entropy, outside


def _recompute(start: int, rows: int, chunk_tokens: int) -> bool:
    """Whether the chunk at ``start`` runs under a checkpoint: every chunk but the last.

    Autograd runs the chunks' backwards last chunk first, so the last chunk's saved
    ``[n, V]`` tensors are freed before any other chunk's are rebuilt: keeping them costs no more
    peak memory than rebuilding them would, and saves one LM head forward per micro-batch
    (0.19 CPU s for 183 tokens of SmolLM2's 49k vocabulary in float32, one thread).
    """
    return start + chunk_tokens < rows


def _rows_per_chunk(vocab: int, budget_bytes: int = 64 << 20) -> int:
    """Rows of float32 logits that fit the per-chunk budget (a few such tensors live at once)."""
    return max(1, budget_bytes // (4 * max(1, vocab)))


def token_logprobs(
    logits: Tensor, tokens: Tensor, support: Tensor, temperature: float, *, chunk_tokens: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` ``[N, V]``: (log π_θ(token) with grad, entropy, outside-support mask).

    ``temperature <= 0`` (greedy sampling) uses T = 1 over the full vocabulary, as the engine
    reports for greedy tokens.
    """
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    if temperature <= 0:
        support = torch.zeros_like(support)
    chunk_tokens = chunk_tokens or _rows_per_chunk(logits.shape[-1])
    outs: list[tuple[Tensor, Tensor, Tensor]] = []
    for i in range(0, logits.shape[0], chunk_tokens):
        sl = slice(i, i + chunk_tokens)
        args = (logits[sl], tokens[sl], support[sl])
        if logits.requires_grad and _recompute(i, logits.shape[0], chunk_tokens):
            outs.append(checkpoint(_chunk, *args, inv_t, use_reentrant=False))
        else:
            outs.append(_chunk(*args, inv_t))
    if not outs:
        empty = logits.new_zeros((0,), dtype=torch.float32)
        return empty, empty, torch.zeros(0, dtype=torch.bool, device=logits.device)
    logp, ent, outside = (torch.cat(parts) for parts in zip(*outs, strict=True))
    return logp, ent, outside


def head_of(model: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[Tensor], Tensor]]:
    """(the decoder that returns hidden states, hidden → logits exactly as the model computes them).

    Covers the final-logit processing HF causal LMs apply after the LM head: ``logit_scale``
    (multiplied), ``logits_scaling`` (divided) and ``final_logit_softcapping`` (tanh cap).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model
    decoder = getattr(base, base.base_model_prefix)
    head = base.get_output_embeddings()
    cfg = base.config
    scale = getattr(cfg, "logit_scale", None)
    divide = getattr(cfg, "logits_scaling", None)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def logits(h: Tensor) -> Tensor:
        z = head(h)
        if scale:
            z = z * scale
        if divide:
            z = z / divide
        if cap:
            z = torch.tanh(z / cap) * cap
        return z

    return decoder, logits


def token_logprobs_from_hidden(
    hidden: Tensor, logits_fn: Callable[[Tensor], Tensor], tokens: Tensor, support: Tensor, temperature: float,
    *, chunk_tokens: int | None = None, vocab: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`token_logprobs` from hidden states ``[N, H]``: the LM head runs inside each chunk."""
    chunk_tokens = chunk_tokens or _rows_per_chunk(vocab or 32_000)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    if temperature <= 0:
        support = torch.zeros_like(support)

    def chunk(h: Tensor, tok: Tensor, sup: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _chunk(logits_fn(h), tok, sup, inv_t)

    outs = []
    n = hidden.shape[0]
    for i in range(0, n, chunk_tokens):
        sl = slice(i, i + chunk_tokens)
        args = (hidden[sl], tokens[sl], support[sl])
        # the last chunk keeps its activations: its backward runs first, so they never coexist
        # with another chunk's; a checkpoint would only recompute its LM head (_recompute)
        recompute = torch.is_grad_enabled() and _recompute(i, n, chunk_tokens)
        outs.append(checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args))
    if not outs:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    logp, ent, outside = (torch.cat(parts) for parts in zip(*outs, strict=True))
    return logp, ent, outside
