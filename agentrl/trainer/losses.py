"""Policy-gradient losses for off-policy (async) training — pure functions over flat tensors.

Every function works on a *flat* token axis so packed/padded micro-batches need no special
casing.  Inputs, all shape ``[T]``: ``logp`` (log π_θ, with grad), ``mu`` (the behaviour
logprob μ the engine sampled with), ``mask`` (1 = sampled token that counts), ``adv`` (the
advantage of the token's trajectory), ``weight`` (its aggregation weight,
:func:`token_weights`); optional ``prox_logp`` (log π_prox, the trainer's own no-grad
forward before this step's updates) and ``seq`` (which trajectory each token belongs to).
The loss returned is ``Σ_t weight_t · mask_t · l_t``: summing it over micro-batches gives the
batch loss, so gradient accumulation is exact.  With r = π_θ/μ (log-ratios clamped to ±20):

====================  ==================================================================================
``icepop`` (default)  l = −1[r ∈ [lo, hi]] · r · A. Tokens outside the trust band are dropped (not
                      clipped) and keep their share of the denominator (AReaL's N_orig).
``ppo``               bypass PPO: l = −min(r·A, clip(r, 1−ε, 1+ε_h)·A).
``decoupled_ppo``     AReaL: l = −w · min(u·A, clip(u, 1−ε, 1+ε_h)·A), u = π_θ/π_prox,
                      w = π_prox/μ, tokens with w outside [lo, hi] dropped.
``tis``               truncated IS (REINFORCE): l = −sg(min(r, C)) · A · log π_θ, C = ``tis_cap``.
``cispo``             MiniMax-M1: l = −sg(min(r, 1+ε_h)) · A · log π_θ — capped from above only;
                      every token keeps a gradient.
``gspo``              GSPO-token: s_i = exp(mean_{t∈i} log r) per trajectory i,
                      s_{i,t} = sg(s_i)·π_θ/sg(π_θ), l = −min(s·A, clip(s, 1−ε, 1+ε_h)·A).
``topr``              TOPR (tapered off-policy REINFORCE): l = −A · log π_θ where A ≥ 0, and
                      l = −sg(min(ρ_i, 1)) · A · log π_θ where A < 0, ρ_i = Π_{t∈i} r (trajectory ratio).
====================  ==================================================================================

Options for every loss: ``kl_coef`` adds κ·k3(log r) = κ·(r − 1 − log r) on the tokens inside the
trust band (a few tokens with huge r never dominate); ``seq_rejection`` drops whole trajectories
whose ratio to the behaviour policy is off (MILES off-policy sequence masking / verl's
rollout-correction rejection): ``geo`` keeps exp(mean log ρ) ∈ [seq_low, seq_high], ``k3`` keeps
mean(ρ − 1 − log ρ) ≤ seq_high, ``veto`` drops a trajectory with any ρ_t < seq_low, where ρ = π_prox/μ.
The README's "The gradient" section shows the default's formula and its options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # ratios are clamped to [e^-20, e^20] before exp (verl's safety clamp)
LOSSES = ("icepop", "ppo", "decoupled_ppo", "tis", "cispo", "gspo", "topr")
NEEDS_PROX = ("decoupled_ppo",)  # losses that need π_prox from a forward before the update


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
    seq_rejection: str = "none"  # none | geo | k3 | veto
    seq_low: float = 0.5
    seq_high: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> LossSpec:
        return cls(
            name=cfg.name, trust_low=cfg.trust_low, trust_high=cfg.trust_high, clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
            seq_rejection=cfg.seq_rejection, seq_low=cfg.seq_low, seq_high=cfg.seq_high,
        )  # fmt: skip

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def needs_prox(self) -> bool:
        return self.name in NEEDS_PROX or self.seq_rejection != "none"


# ----------------------------------------------------------------------------- aggregation weights


def token_weights(traj_lens: list[int], aggregation: str) -> list[float]:
    """Per trajectory, the weight of each of its loss tokens, for one optimizer update.

    ``traj_lens`` are the loss-token counts of every *trajectory* in the update (all its
    sequences together, however the chat template split it).  ``token_mean``: 1/N_tokens;
    ``seq_mean_token_mean``: 1/(n_traj·len); ``seq_mean_token_sum``: 1/n_traj.  Masked-out
    tokens keep their weight (the denominator is the original token count).
    """
    n_traj = sum(1 for n in traj_lens if n > 0)
    n_tok = sum(traj_lens)
    if n_tok == 0:
        return [0.0 for _ in traj_lens]
    if aggregation == "token_mean":
        return [1.0 / n_tok for _ in traj_lens]
    if aggregation == "seq_mean_token_mean":
        return [1.0 / (n_traj * n) if n else 0.0 for n in traj_lens]
    if aggregation == "seq_mean_token_sum":
        return [1.0 / n_traj if n else 0.0 for n in traj_lens]
    raise ValueError(f"unknown aggregation {aggregation!r}")


# ----------------------------------------------------------------------------- the loss


def k3(log_ratio: Tensor) -> Tensor:
    """k3 estimator of KL(μ‖π) from samples of μ: r − 1 − log r, with log r = log π − log μ."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def _per_traj(values: Tensor, mask: Tensor, seq: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of ``values`` over each trajectory's loss tokens, token count) indexed by ``seq``."""
    n = int(seq.max().item()) + 1 if seq.numel() else 0
    total = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, values * mask)
    count = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, seq, mask)
    return total, count


def sequence_keep(spec: LossSpec, prox_logp: Tensor, mu: Tensor, mask: Tensor, seq: Tensor) -> Tensor:
    """Per token: 1 if its trajectory passes ``spec.seq_rejection`` (ρ = π_prox/μ), else 0."""
    if spec.seq_rejection == "none":
        return torch.ones_like(mask)
    log_rho = torch.clamp(prox_logp.detach() - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if spec.seq_rejection == "geo":
        total, count = _per_traj(log_rho, mask, seq)
        geo = torch.exp(total / count.clamp(min=1.0))
        ok = (geo >= spec.seq_low) & (geo <= spec.seq_high)
    elif spec.seq_rejection == "k3":
        total, count = _per_traj(k3(log_rho), mask, seq)
        ok = total / count.clamp(min=1.0) <= spec.seq_high
    elif spec.seq_rejection == "veto":
        low, _ = _per_traj((log_rho < torch.log(torch.tensor(spec.seq_low))).to(mask.dtype), mask, seq)
        ok = low == 0
    else:
        raise ValueError(f"unknown seq_rejection {spec.seq_rejection!r}")
    return ok.to(mask.dtype)[seq]


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
    """Loss (to minimise) and summed statistics for one micro-batch (module docstring).

    ``stats`` are *sums* over loss tokens (``tokens``, ``masked``, ``clipped``, ``kl``, ``r``,
    ``r_sq``, ``seq_rejected``) so micro-batches add up and :func:`summarize` turns them into means.
    """
    mask = mask.to(logp.dtype)
    if seq is None:
        seq = torch.zeros_like(mask, dtype=torch.long)
    if spec.needs_prox and prox_logp is None:
        raise ValueError(f"loss {spec.name!r} with seq_rejection {spec.seq_rejection!r} needs prox_logp")
    keep_seq = sequence_keep(spec, prox_logp, mu, mask, seq) if spec.seq_rejection != "none" else None
    log_r = torch.clamp(logp - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_r)
    r_d = r.detach()
    in_band = ((r_d >= spec.trust_low) & (r_d <= spec.trust_high)).to(logp.dtype)
    per_tok, clipped, in_band = _per_token(spec, logp, mu, adv, mask, seq, log_r, r, r_d, in_band, prox_logp)
    if spec.kl_coef > 0:
        per_tok = per_tok + spec.kl_coef * in_band * k3(log_r)
    counted = mask if keep_seq is None else mask * keep_seq
    loss = (per_tok * weight * counted).sum()
    stats = {
        "tokens": float(mask.sum()),
        "masked": float(((1.0 - in_band) * mask).sum()),
        "clipped": float((clipped * mask).sum()),
        "kl": float((k3(log_r.detach()) * mask).sum()),
        "r": float((r_d * mask).sum()),
        "r_sq": float((r_d * r_d * mask).sum()),
        "seq_rejected": float((mask - counted).sum()),
    }
    return loss, stats


def _per_token(
    spec: LossSpec, logp: Tensor, mu: Tensor, adv: Tensor, mask: Tensor, seq: Tensor, log_r: Tensor, r: Tensor,
    r_d: Tensor, in_band: Tensor, prox_logp: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss, clipped/masked-by-the-loss indicator, trust-band indicator) for ``spec.name``."""
    name, lo, hi = spec.name, 1.0 - spec.clip_eps, 1.0 + spec.eps_high
    if name == "icepop":
        return -(in_band * r * adv), 1.0 - in_band, in_band
    if name == "ppo":
        per_tok, clipped = _ppo_clip(r, adv, lo, hi)
        return per_tok, clipped, in_band
    if name == "decoupled_ppo":
        assert prox_logp is not None
        prox = prox_logp.detach()
        behav_w = torch.exp(torch.clamp(prox - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = ((behav_w >= spec.trust_low) & (behav_w <= spec.trust_high)).to(logp.dtype)
        u = torch.exp(torch.clamp(logp - prox, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        per_tok, clipped = _ppo_clip(u, adv, lo, hi)
        return keep * behav_w * per_tok, torch.maximum(clipped, 1.0 - keep), keep
    if name == "tis":
        return -(torch.clamp(r_d, max=spec.tis_cap) * adv * logp), (r_d > spec.tis_cap).to(logp.dtype), in_band
    if name == "cispo":
        return -(torch.clamp(r_d, max=hi) * adv * logp), (r_d > hi).to(logp.dtype), in_band
    if name == "gspo":
        total, count = _per_traj(log_r.detach(), mask, seq)
        s_seq = torch.exp(total / count.clamp(min=1.0))[seq]  # sg[s_i] broadcast to its tokens
        s_tok = s_seq * torch.exp(logp - logp.detach())  # value s_i, gradient of log π_θ(y_t)
        per_tok, clipped = _ppo_clip(s_tok, adv, lo, hi)
        return per_tok, clipped, in_band
    if name == "topr":
        total, _ = _per_traj(log_r.detach(), mask, seq)
        taper = torch.exp(torch.clamp(total, max=0.0))[seq]  # min(Π r, 1), in log space
        w = torch.where(adv >= 0, torch.ones_like(taper), taper)
        return -(w * adv * logp), ((adv < 0) & (taper < 1)).to(logp.dtype), in_band
    raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")


def _ppo_clip(ratio: Tensor, adv: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """−min(ratio·A, clip(ratio, lo, hi)·A) and where the clipped branch was taken."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, lo, hi) * adv
    took_clip = (clipped < unclipped).to(ratio.dtype)
    return -torch.minimum(unclipped, clipped), took_clip.detach()


def summarize(stats: dict[str, float]) -> dict[str, float]:
    """Summed micro-batch stats → per-step means.

    ``mismatch_kl``: mean k3 KL(μ‖π_θ) per loss token; ``masked_frac``: share of tokens
    outside the trust band; ``clip_frac``: share clipped/masked by the loss; ``ess``:
    normalised effective sample size (Σr)²/(N·Σr²) ∈ (0, 1]; ``seq_rejected_frac``: share of
    tokens in trajectories dropped by ``seq_rejection``.
    """
    n = stats.get("tokens", 0.0)
    if n <= 0:
        return {"mismatch_kl": 0.0, "masked_frac": 0.0, "clip_frac": 0.0, "ess": 1.0, "seq_rejected_frac": 0.0}
    r_sq = stats["r_sq"]
    return {
        "mismatch_kl": stats["kl"] / n,
        "masked_frac": stats["masked"] / n,
        "clip_frac": stats["clipped"] / n,
        "ess": (stats["r"] ** 2) / (n * r_sq) if r_sq > 0 else 1.0,
        "seq_rejected_frac": stats.get("seq_rejected", 0.0) / n,
    }


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
    return total
