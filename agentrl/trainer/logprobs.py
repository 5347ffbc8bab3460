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

Precision (a bf16 trainer, :func:`low_precision_logits`): the LM head's product runs in bf16
(on a CPU with native bf16, SmolLM2-135M's head forward and backward take 168 ms where float32
takes 220, per 183 positions), but bf16 rounds each logit to 8 significant bits, which on SmolLM2 about doubled the
error of log π_θ against a float32 model (mean 0.017 → 0.034 nats on 400 tokens of text).  So
the sampled token's logit and the largest ones per row, which make up the logsumexp, are
recomputed in float32: the error is back to 0.018, and against a bf16 engine's μ the trainer
is as close as with a float32 head (mean |log π_θ − log μ| 0.0387 vs 0.0385; bf16 head alone
0.0419).  The softmax and everything after it stay float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from agentrl import support as support_rule


def _chunk(logits: Tensor, tokens: Tensor, support: Tensor, inv_t: float,
           rank: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(log π_θ of ``tokens``, entropy over the support, token outside the support) for one chunk.

    ``rank``: logits of one precision to decide a truncated support on, where ``logits`` mixes
    two (:func:`low_precision_logits`: a bf16-rounded neighbour must not outrank a float32 value)."""
    z = logits.float() * inv_t  # [n, V]
    v = z.shape[-1]
    chosen = z.gather(-1, tokens[:, None]).squeeze(-1)
    truncated = bool((~support_rule.full(support, v)).any())
    if truncated:
        # the top-K set's logsumexp, the set as the engine built it (agentrl.support: ties at the boundary kept)
        r = z.detach() if rank is None else rank.detach().float() * inv_t
        kth = support_rule.boundary(r.sort(dim=-1, descending=True).values, support)
        kept = r >= kth
        lse = torch.logsumexp(z.masked_fill(~kept, float("-inf")), dim=-1)
        outside = r.gather(-1, tokens[:, None]).squeeze(-1) < kth.squeeze(-1)
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


EXACT_TOP = 16  # largest logits per row recomputed in float32 by low_precision_logits
# fewer positions than this in a chunk and casting the head's weight to bf16 (and its gradient back)
# costs more than the bf16 product saves (SmolLM2: ~60 ms of casts against ~0.6 ms saved per position)
LOW_PRECISION_MIN_ROWS = 128


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


class Head:
    """Hidden states → logits exactly as the model computes them: its LM head, then the
    final-logit processing HF causal LMs apply (``logit_scale`` multiplied, ``logits_scaling``
    divided, ``final_logit_softcapping`` as a tanh cap), each elementwise per logit."""

    def __init__(self, linear: torch.nn.Module, scale: float | None, divide: float | None, cap: float | None) -> None:
        self.linear, self.scale, self.divide, self.cap = linear, scale, divide, cap

    def __call__(self, h: Tensor) -> Tensor:
        return self.post(self.linear(h))

    def post(self, z: Tensor) -> Tensor:
        if self.scale:
            z = z * self.scale
        if self.divide:
            z = z / self.divide
        if self.cap:
            z = torch.tanh(z / self.cap) * self.cap
        return z

    def is_plain(self) -> bool:
        """A plain linear head with plain tensors (not an adapter, a quantized weight or a DTensor
        shard; FSDP's unsharded weight is plain): what :meth:`exact` reads rows of."""
        return isinstance(self.linear, torch.nn.Linear) and all(
            t is None or type(t) in (Tensor, torch.nn.Parameter) for t in (self.linear.weight, self.linear.bias))

    @torch.no_grad()
    def exact(self, h: Tensor, idx: Tensor) -> Tensor:
        """Logits ``[n, k]`` of the vocabulary entries ``idx`` ``[n, k]`` in float32, row by row."""
        with torch.autocast(h.device.type, enabled=False):  # float32 even inside a caller's autocast
            z = torch.einsum("nh,nkh->nk", h.float(), self.linear.weight[idx].float())
            if self.linear.bias is not None:
                z = z + self.linear.bias[idx].float()
            return self.post(z)


def head_of(model: torch.nn.Module) -> tuple[torch.nn.Module, Head]:
    """(the decoder that returns hidden states, its :class:`Head`: hidden → logits as the model computes them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model
    cfg = base.config
    head = Head(base.get_output_embeddings(), getattr(cfg, "logit_scale", None), getattr(cfg, "logits_scaling", None),
                getattr(cfg, "final_logit_softcapping", None))  # fmt: skip
    return getattr(base, base.base_model_prefix), head


class _Replace(torch.autograd.Function):
    """``z`` with the entries ``idx`` set to ``values``; the gradient passes to ``z`` unchanged
    (the values are a more exact computation of the same entries, not a separate input)."""

    @staticmethod
    def forward(ctx, z: Tensor, idx: Tensor, values: Tensor) -> Tensor:  # noqa: ANN001
        # column 0 last: where it repeats a later column its value wins, on any device
        out = z.scatter(-1, idx[:, 1:], values[:, 1:].to(z.dtype))
        return out.scatter_(-1, idx[:, :1], values[:, :1].to(z.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return grad, None, None


def low_precision_logits(head: Head, h: Tensor, tokens: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Logits ``[n, V]`` from the LM head run in ``dtype`` (bf16 autocast), float32 where it counts,
    and the bf16 logits alone (detached: a truncated support is ranked on them).

    A bf16 product rounds every logit to 8 significant bits, which about doubles the error of
    log π_θ against a float32 head (module docstring).  The entries that carry it are the sampled
    token's logit and the largest ones, which make up the logsumexp: those
    (``tokens`` and the top :data:`EXACT_TOP` per row) are recomputed in float32 from the
    float32 weight, rows of ``[k, H]``.  The gradient is the bf16 product's.  ``tokens`` is
    column 0 of the recomputed entries (:class:`_Replace` lets it win a repeat).
    """
    with torch.autocast(h.device.type, dtype=dtype):
        z = head.linear(h)
    z = head.post(z.float())
    with torch.no_grad():
        idx = torch.cat([tokens[:, None], z.topk(min(EXACT_TOP, z.shape[-1]), dim=-1).indices], dim=-1)
        values = head.exact(h, idx)
    return _Replace.apply(z, idx, values), z.detach()


def token_logprobs_from_hidden(
    hidden: Tensor, logits_fn: Callable[[Tensor], Tensor], tokens: Tensor, support: Tensor, temperature: float,
    *, chunk_tokens: int | None = None, vocab: int | None = None, head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`token_logprobs` from hidden states ``[N, H]``: the LM head runs inside each chunk.

    ``head_dtype`` (bf16): a :class:`Head` with a plain weight runs its product in that type, its
    largest logits and the sampled token's recomputed in float32 (:func:`low_precision_logits`),
    in chunks of at least :data:`LOW_PRECISION_MIN_ROWS` positions (smaller ones stay float32)."""
    low = head_dtype if isinstance(logits_fn, Head) and logits_fn.is_plain() else None
    chunk_tokens = chunk_tokens or _rows_per_chunk(vocab or 32_000)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    if temperature <= 0:
        support = torch.zeros_like(support)

    def chunk(h: Tensor, tok: Tensor, sup: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if low is not None and h.shape[0] >= LOW_PRECISION_MIN_ROWS:
            logits, rank = low_precision_logits(logits_fn, h, tok, low)
            return _chunk(logits, tok, sup, inv_t, rank=rank)
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
