"""The support rule: which tokens a truncated sampling distribution keeps, for the engine and the trainer alike.

Every filter the engine applies (min-p, top-k, top-p) keeps a *prefix* of the tokens sorted by
scaled logit, so its kept set is described by one number, the support size ``K``.  A tie at the
boundary is kept whole: the support is every token whose scaled logit is at least the ``K``-th
largest, and ``K`` is reported as the size of that set.  (vLLM's top-k keeps ties the same way;
without the rule the engine would keep exactly ``K`` tokens by sort order and the trainer every
tied one, so π_θ/μ ≠ 1 at identical weights whenever logits tie — common with bf16 logits.)

Both sides call :func:`boundary` and :func:`kept`: the engine (``agentrl.inference.sampling``) to
build the distribution it samples from and the ``K`` it reports, the trainer
(``agentrl.trainer.logprobs``) to rebuild that distribution from ``K``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def full(k: Tensor, vocab: int) -> Tensor:
    """Rows whose support is the whole vocabulary (``K ≤ 0`` or ``K ≥ V`` means untruncated)."""
    return (k <= 0) | (k >= vocab)


def boundary(sorted_desc: Tensor, k: Tensor) -> Tensor:
    """The ``K``-th largest value per row, ``[n, 1]``, from values sorted in descending order
    (``K`` outside ``[1, V]``: the smallest value, i.e. everything is kept)."""
    v = sorted_desc.shape[-1]
    idx = torch.where(full(k, v), torch.full_like(k, v), k) - 1
    return sorted_desc.gather(-1, idx[:, None].long())


def kept(z: Tensor, k: Tensor, sorted_desc: Tensor | None = None) -> Tensor:
    """Boolean ``[n, V]``: the support of each row of scaled logits ``z`` for sizes ``k`` (ties at
    the boundary kept).  ``sorted_desc``: ``z`` sorted in descending order, if already at hand."""
    if sorted_desc is None:
        sorted_desc = z.detach().sort(dim=-1, descending=True).values
    return z >= boundary(sorted_desc, k)
