"""π_θ of sampled tokens on the sampler's own basis, computed in chunks.

The engine reports, per sampled token, μ and the size ``K`` of the kept set it was drawn
from (temperature, then top-k / top-p / min-p, which always keep the top ``K`` tokens by
scaled logit: :mod:`agentrl.inference.sampling`).  The trainer mirrors that distribution:

    log π_θ(y) = z_y / T − logsumexp_{top K of z / T}       (K = 0 or K ≥ V: the full vocabulary)

where ``z`` are the trainer's logits.  With identical weights this equals μ exactly, so the
ratio π_θ/μ is 1 at any temperature, top-k, top-p and min-p.  When the weights differ the
trainer's own top ``K`` may no longer contain ``y``: such a token has no probability under
the replayed distribution and is reported in ``outside`` (the loss masks it).

Memory: only the loss positions' logits are read, ``chunk_tokens`` rows at a time, each chunk
under activation checkpointing, so the ``[N, V]`` float32 log-softmax (and the sort a
truncated support needs) never exists for more than one chunk, in the forward or the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk(logits: Tensor, tokens: Tensor, support: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log π_θ of ``tokens``, entropy over the support, token outside the support) for one chunk."""
    z = logits.float() * inv_t  # [n, V]
    v = z.shape[-1]
    chosen = z.gather(-1, tokens[:, None]).squeeze(-1)
    k = torch.where((support <= 0) | (support >= v), torch.full_like(support, v), support)
    if bool((k < v).any()):
        z_sorted, _ = z.sort(dim=-1, descending=True)
        ranks = torch.arange(v, device=z.device)[None, :]
        kept = ranks < k[:, None]
        z_kept = z_sorted.masked_fill(~kept, float("-inf"))
        lse = torch.logsumexp(z_kept, dim=-1)
        # rank of the chosen token among the trainer's scaled logits (ties count as kept)
        outside = (z > chosen[:, None]).sum(-1) >= k
        logp_all = z_kept - lse[:, None]
    else:
        lse = torch.logsumexp(z, dim=-1)
        outside = torch.zeros_like(chosen, dtype=torch.bool)
        logp_all = z - lse[:, None]
    p = logp_all.exp()
    entropy = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return chosen - lse, entropy.detach(), outside


def token_logprobs(
    logits: Tensor, tokens: Tensor, support: Tensor, temperature: float, *, chunk_tokens: int = 2048
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits`` ``[N, V]``: (log π_θ(token) with grad, entropy, outside-support mask).

    ``temperature <= 0`` (greedy sampling) uses T = 1 over the full vocabulary, as the engine
    reports for greedy tokens.
    """
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    if temperature <= 0:
        support = torch.zeros_like(support)
    outs: list[tuple[Tensor, Tensor, Tensor]] = []
    for i in range(0, logits.shape[0], chunk_tokens):
        sl = slice(i, i + chunk_tokens)
        args = (logits[sl], tokens[sl], support[sl])
        if logits.requires_grad:
            outs.append(checkpoint(_chunk, *args, inv_t, use_reentrant=False))
        else:
            outs.append(_chunk(*args, inv_t))
    if not outs:
        empty = logits.new_zeros((0,), dtype=torch.float32)
        return empty, empty, torch.zeros(0, dtype=torch.bool, device=logits.device)
    logp, ent, outside = (torch.cat(parts) for parts in zip(*outs, strict=True))
    return logp, ent, outside
