"""Policy-gradient losses for off-policy (async) training — pure functions over flat tensors.

Every function works on a *flat* token axis so packed/padded micro-batches need no
special casing: ``logp`` (π_θ, with grad), ``mu`` (the engine's sampling logprob),
``mask`` (1 = sampled token that counts), ``adv`` (the advantage of the token's
sequence) and ``weight`` (the aggregation weight of each token, see
:func:`token_weights`) are all shape ``[T]``; ``seq`` maps each token to its sequence
(needed only by GSPO).  The loss returned is ``Σ_t weight_t · l_t``: summing it over
micro-batches gives the batch loss, so gradient accumulation is exact.

Default (``icepop``): one ratio r = π_θ/μ per token corrects both staleness and
train/inference mismatch; tokens with r outside [trust_low, trust_high] are masked
(dropped, not clipped) and keep their share of the denominator (AReaL's N_orig), plus
an optional k3 KL on log r.  Options: ``ppo`` (bypass PPO clip on π_θ/μ),
``decoupled_ppo`` (AReaL: clip on π_θ/π_prox, weighted by π_prox/μ masked to the trust
band), ``tis`` (truncated IS, REINFORCE-style), ``cispo`` (clipped IS weight, every
token keeps a gradient), ``gspo`` (sequence-level geometric ratio, token variant).
Formulas: shared/reference/losses-staleness-weight-sync.md §1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # ratios are clamped to [e^-20, e^20] before exp (verl's safety clamp)


@dataclass(frozen=True)
class LossSpec:
    """The knobs of a policy loss (mirrors ``config.LossConfig``)."""

    name: str = "icepop"
    trust_low: float = 0.5
    trust_high: float = 2.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    tis_cap: float = 2.0
    kl_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> LossSpec:
        return cls(
            name=cfg.name,
            trust_low=cfg.trust_low,
            trust_high=cfg.trust_high,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            tis_cap=cfg.tis_cap,
            kl_coef=cfg.kl_coef,
        )

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """GRPO-style advantages within one group: reward − group mean (÷ group std if asked)."""
    adv = rewards - rewards.mean()
    if std_normalize and rewards.numel() > 1:
        adv = adv / (rewards.std(unbiased=False) + eps)
    return adv


def token_weights(seq_lens: list[int], aggregation: str) -> list[float]:
    """Per-sequence weight of each of its loss tokens, for the whole optimizer batch.

    ``seq_lens`` are the loss-token counts of every sequence in the batch (all
    micro-batches).  ``token_mean``: 1/N_tokens; ``seq_mean_token_mean``: 1/(n_seq·len);
    ``seq_mean_token_sum``: 1/n_seq.  Masked-out tokens keep their weight (the
    denominator is the original token count).
    """
    n_seq = sum(1 for n in seq_lens if n > 0)
    n_tok = sum(seq_lens)
    if n_tok == 0:
        return [0.0 for _ in seq_lens]
    if aggregation == "token_mean":
        return [1.0 / n_tok for _ in seq_lens]
    if aggregation == "seq_mean_token_mean":
        return [1.0 / (n_seq * n) if n else 0.0 for n in seq_lens]
    if aggregation == "seq_mean_token_sum":
        return [1.0 / n_seq if n else 0.0 for n in seq_lens]
    raise ValueError(f"unknown aggregation {aggregation!r}")


# ----------------------------------------------------------------------------- the loss


def k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(μ‖π) from samples of μ: r − 1 − log r, with log r = log π − log μ."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def policy_loss(
    spec: LossSpec,
    logp: Tensor,
    mu: Tensor,
    mask: Tensor,
    adv: Tensor,
    weight: Tensor,
    *,
    prox_logp: Tensor | None = None,
    seq: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Loss (to minimise) and summed statistics for one micro-batch.

    Returns ``(loss, stats)``; ``stats`` are *sums* over loss tokens (``tokens``,
    ``masked``, ``clipped``, ``kl``, ``r``, ``r_sq``) so micro-batches can be added and
    turned into means by :func:`summarize`.
    """
    mask = mask.to(logp.dtype)
    log_r = torch.clamp(logp - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_r)
    r_d = r.detach()
    in_band = ((r_d >= spec.trust_low) & (r_d <= spec.trust_high)).to(logp.dtype)
    name = spec.name
    clipped = torch.zeros_like(mask)

    if name == "icepop":
        per_tok = -(in_band * r * adv)
        clipped = 1.0 - in_band
    elif name == "ppo":
        per_tok, clipped = _ppo_clip(r, adv, 1.0 - spec.clip_eps, 1.0 + spec.eps_high)
    elif name == "decoupled_ppo":
        if prox_logp is None:
            raise ValueError("decoupled_ppo needs prox_logp (the proximal policy's logprobs)")
        prox_logp = prox_logp.detach()
        behav_w = torch.exp(torch.clamp(prox_logp - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = ((behav_w >= spec.trust_low) & (behav_w <= spec.trust_high)).to(logp.dtype)
        u = torch.exp(torch.clamp(logp - prox_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        per_tok, clipped = _ppo_clip(u, adv, 1.0 - spec.clip_eps, 1.0 + spec.eps_high)
        per_tok = keep * behav_w * per_tok
        in_band = keep
    elif name == "tis":
        w = torch.clamp(r_d, max=spec.tis_cap)
        per_tok = -(w * adv * logp)
        clipped = (r_d > spec.tis_cap).to(logp.dtype)
    elif name == "cispo":
        lo, hi = 1.0 - spec.clip_eps, 1.0 + spec.eps_high
        w = torch.clamp(r_d, lo, hi)
        per_tok = -(w * adv * logp)
        clipped = ((r_d < lo) | (r_d > hi)).to(logp.dtype)
    elif name == "gspo":
        if seq is None:
            raise ValueError("gspo needs seq (the sequence index of every token)")
        n_seq = int(seq.max().item()) + 1 if seq.numel() else 0
        sum_lr = torch.zeros(n_seq, dtype=logp.dtype).index_add(0, seq, (log_r * mask).detach())
        cnt = torch.zeros(n_seq, dtype=logp.dtype).index_add(0, seq, mask).clamp(min=1.0)
        s_seq = torch.exp(sum_lr / cnt)[seq]  # sg[s_i] broadcast to tokens
        s_tok = s_seq * torch.exp(logp - logp.detach())  # value s_i, gradient of log π_θ(y_t)
        per_tok, clipped = _ppo_clip(s_tok, adv, 1.0 - spec.clip_eps, 1.0 + spec.eps_high)
    else:
        raise ValueError(f"unknown loss {name!r}")

    if spec.kl_coef > 0:
        per_tok = per_tok + spec.kl_coef * k3(log_r)

    loss = (per_tok * weight * mask).sum()
    stats = {
        "tokens": float(mask.sum()),
        "masked": float(((1.0 - in_band) * mask).sum()),
        "clipped": float((clipped * mask).sum()),
        "kl": float((k3(log_r.detach()) * mask).sum()),
        "r": float((r_d * mask).sum()),
        "r_sq": float((r_d * r_d * mask).sum()),
    }
    return loss, stats


def _ppo_clip(ratio: Tensor, adv: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """−min(ratio·A, clip(ratio, lo, hi)·A) and where the clipped branch was taken."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, lo, hi) * adv
    took_clip = (clipped < unclipped).to(ratio.dtype)
    return -torch.minimum(unclipped, clipped), took_clip.detach()


def summarize(stats: dict[str, float]) -> dict[str, float]:
    """Summed micro-batch stats → per-step means.

    ``mismatch_kl``: mean k3 KL(μ‖π_θ) per loss token; ``masked_frac``: share of tokens
    outside the trust band; ``clip_frac``: share clipped/masked by the loss;
    ``ess``: normalised effective sample size (Σr)²/(N·Σr²) ∈ (0, 1].
    """
    n = stats.get("tokens", 0.0)
    if n <= 0:
        return {"mismatch_kl": 0.0, "masked_frac": 0.0, "clip_frac": 0.0, "ess": 1.0}
    r_sq = stats["r_sq"]
    return {
        "mismatch_kl": stats["kl"] / n,
        "masked_frac": stats["masked"] / n,
        "clip_frac": stats["clipped"] / n,
        "ess": (stats["r"] ** 2) / (n * r_sq) if r_sq > 0 else 1.0,
    }


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
    return total
