"""Policy-gradient losses for off-policy (async) training — pure functions over flat tensors.

Every function works on a *flat* token axis so packed/padded micro-batches need no special
casing.  Inputs, all shape ``[T]``: ``logp`` (log π_θ, with grad), ``mu`` (the behaviour
logprob μ the engine sampled with), ``mask`` (1 = sampled token that counts), ``adv`` (the
advantage of the token's trajectory), ``weight`` (its aggregation weight,
:func:`token_weights`); optional ``prox_logp`` (log π_prox, the trainer's own no-grad
forward before this step's updates), ``seq`` (which trajectory each token belongs to) and
``outside`` / ``prox_outside`` (the token is outside the trainer's own top-K support under
π_θ / π_prox, see below).  The loss returned is ``Σ_t weight_t · mask_t · l_t``: summing it
over micro-batches gives the batch loss, so gradient accumulation is exact.  With r = π_θ/μ
(log-ratios clamped to ±20), the registered losses (:data:`LOSSES`):

====================  ==================================================================================
``icepop`` (default)  INTELLECT-3's form of IcePop: l = −1[r ∈ [lo, hi]] · r · A, one ratio to μ (no
                      π_old, no PPO clip).  Tokens outside the trust band are dropped (not clipped)
                      and keep their share of the denominator (AReaL's N_orig).  With several updates
                      per batch the band is its only trust region.
``ppo``               bypass PPO: l = −min(r·A, clip(r, 1−ε, 1+ε_h)·A).
``decoupled_ppo``     AReaL: l = −w · min(u·A, clip(u, 1−ε, 1+ε_h)·A), u = π_θ/π_prox,
                      w = π_prox/μ, tokens with w outside [lo, hi] dropped.
``tis``               truncated IS (REINFORCE): l = −sg(min(r, C)) · A · log π_θ, C = ``tis_cap``.
``cispo``             MiniMax-M1: l = −sg(min(r, 1+ε_h)) · A · log π_θ — capped from above only;
                      every token keeps a gradient.
``gspo``              GSPO-token: s_i = exp(mean_{t∈i} log r) per trajectory i,
                      s_{i,t} = sg(s_i)·π_θ/sg(π_θ), l = −min(s·A, clip(s, 1−ε, 1+ε_h)·A); by default
                      the paper's ε = 3e-4, ε_h = 4e-4 and sequence-level aggregation.
``topr``              TOPR (tapered off-policy REINFORCE): l = −A · log π_θ where A ≥ 0, and
                      l = −sg(min(ρ_i, 1)) · A · log π_θ where A < 0, ρ_i = Π_{t∈i} r (trajectory ratio).
====================  ==================================================================================

A new loss is one function and one registration (:func:`register_loss`); the config, the
trainer and the docs table of ``agentrl run --help`` find it in :data:`LOSSES`.

**Support replay.**  π_θ is the trainer's softmax renormalised over its own top K (the
engine's support, :mod:`agentrl.trainer.logprobs`).  After an update a sampled token can fall
outside that set: under the replayed distribution its probability is 0, so r = 0.  Such a token
gives no gradient and no loss term but keeps its weight in the denominator; it counts as
masked (r = 0 is outside every band) and in the mismatch KL with log r at the clamp (−20); and
every sequence-level ratio over its trajectory is 0 — GSPO's s_i (the trajectory gives no
gradient), TOPR's taper (a negative trajectory gives none), and ``seq_rejection`` rejects the
trajectory (ρ = π_prox/μ: a token outside π_prox's support has ρ = 0).

Options for every loss: ``kl_coef`` adds κ·k3(log r) = κ·(r − 1 − log r) on the tokens inside the
trust band (a few tokens with huge r never dominate); ``seq_rejection`` drops whole trajectories
whose ratio to the behaviour policy is off (MILES off-policy sequence masking / verl's
rollout-correction rejection): ``geo`` keeps exp(mean log ρ) ∈ [seq_low, seq_high], ``k3`` keeps
mean(ρ − 1 − log ρ) ≤ seq_high, ``veto`` drops a trajectory with any ρ_t < seq_low, where ρ = π_prox/μ.
The README's "The gradient" section shows the default's formula and its options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # ratios are clamped to [e^-20, e^20] before exp (verl's safety clamp)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass(frozen=True)
class Tokens:
    """What a per-token loss sees: flat ``[T]`` tensors of one micro-batch (module docstring)."""

    logp: Tensor  # log π_θ with grad (an outside token holds μ: finite, and masked)
    mu: Tensor
    adv: Tensor
    mask: Tensor  # loss tokens still in π_θ's support
    seq: Tensor  # trajectory index per token
    log_r: Tensor  # log π_θ/μ, clamped (0 at an outside token)
    r: Tensor  # π_θ/μ with grad (0 at an outside token)
    r_d: Tensor  # r detached
    in_band: Tensor  # 1 where r ∈ [trust_low, trust_high]
    seq_zero: Tensor  # 1 where the token's trajectory holds an outside token: its sequence ratio is 0
    prox: Tensor | None  # log π_prox, detached (losses registered with needs_prox)
    prox_zero: Tensor | None  # 1 where π_prox of the token is 0 (outside π_prox's support)

    def per_traj(self, values: Tensor) -> Tensor:
        """Σ of ``values`` over each token's trajectory's loss tokens, broadcast back to the tokens."""
        total, _ = _per_traj(values, self.mask, self.seq)
        return total[self.seq]

    def per_traj_mean(self, values: Tensor) -> Tensor:
        total, count = _per_traj(values, self.mask, self.seq)
        return (total / count.clamp(min=1.0))[self.seq]


PerToken = Callable[["LossSpec", Tokens], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Loss:
    """A registered policy loss: its per-token function and its defaults."""

    name: str
    per_token: PerToken  # (per-token loss, clipped-by-the-loss indicator, trust-band indicator)
    formula: str  # one line, for docs and errors
    needs_prox: bool = False  # needs π_prox from a no-grad forward before the update
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: clip_eps
    aggregation: str = "token_mean"


LOSSES: dict[str, Loss] = {}


def register_loss(name: str, formula: str, *, needs_prox: bool = False, clip_eps: float = 0.2,
                  clip_eps_high: float | None = None, aggregation: str = "token_mean") -> Callable[[PerToken], PerToken]:
    """Decorator: make ``fn(spec, tokens) -> (per-token loss, clipped, in band)`` the loss ``name``."""

    def add(fn: PerToken) -> PerToken:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"loss {name!r}: unknown aggregation {aggregation!r}")
        LOSSES[name] = Loss(name, fn, formula, needs_prox, clip_eps, clip_eps_high, aggregation)
        return fn

    return add


def get_loss(name: str) -> Loss:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")
    return LOSSES[name]


@dataclass(frozen=True)
class LossSpec:
    """The knobs of a policy loss (mirrors ``config.LossConfig``); None = the loss's own default."""

    name: str = "icepop"
    trust_low: float = 0.5
    trust_high: float = 2.0
    clip_eps: float | None = None
    clip_eps_high: float | None = None
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    seq_rejection: str = "none"  # none | geo | k3 | veto
    seq_low: float = 0.5
    seq_high: float = 2.0
    aggregation: str | None = None

    @classmethod
    def from_config(cls, cfg) -> LossSpec:
        return cls(
            name=cfg.name, trust_low=cfg.trust_low, trust_high=cfg.trust_high, clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
            seq_rejection=cfg.seq_rejection, seq_low=cfg.seq_low, seq_high=cfg.seq_high, aggregation=cfg.aggregation,
        )  # fmt: skip

    @property
    def loss(self) -> Loss:
        return get_loss(self.name)

    @property
    def eps_low(self) -> float:
        return self.loss.clip_eps if self.clip_eps is None else self.clip_eps

    @property
    def eps_high(self) -> float:
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        if self.clip_eps is not None:  # the user's ε, both ways
            return self.clip_eps
        return self.loss.clip_eps if self.loss.clip_eps_high is None else self.loss.clip_eps_high

    @property
    def reduce(self) -> str:
        """The aggregation in force (the loss's own unless set)."""
        return self.loss.aggregation if self.aggregation is None else self.aggregation

    @property
    def needs_prox(self) -> bool:
        return self.loss.needs_prox or self.seq_rejection != "none"


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


def _any_in_traj(flag: Tensor, mask: Tensor, seq: Tensor) -> Tensor:
    """Per token: 1 if any loss token of its trajectory has ``flag``."""
    total, _ = _per_traj(flag.to(mask.dtype), mask, seq)
    return (total > 0).to(mask.dtype)[seq]


def sequence_keep(spec: LossSpec, prox_logp: Tensor, mu: Tensor, mask: Tensor, seq: Tensor,
                  prox_outside: Tensor | None = None) -> Tensor:
    """Per token: 1 if its trajectory passes ``spec.seq_rejection`` (ρ = π_prox/μ), else 0.

    A token outside π_prox's support has ρ = 0: its trajectory fails every mode."""
    if spec.seq_rejection == "none":
        return torch.ones_like(mask)
    outside = torch.zeros_like(mask, dtype=torch.bool) if prox_outside is None else prox_outside.bool()
    log_rho = torch.clamp(torch.where(outside, mu, prox_logp.detach()) - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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
    return ok.to(mask.dtype)[seq] * (1.0 - _any_in_traj(outside, mask, seq))


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
    outside: Tensor | None = None,
    prox_outside: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Loss (to minimise) and summed statistics for one micro-batch (module docstring).

    ``stats`` are *sums* over loss tokens (``tokens``, ``masked``, ``clipped``, ``kl``, ``r``,
    ``r_sq``, ``seq_rejected``) so micro-batches add up and :func:`summarize` turns them into means.
    """
    loss_def = spec.loss
    mask = mask.to(logp.dtype)
    if seq is None:
        seq = torch.zeros_like(mask, dtype=torch.long)
    out = torch.zeros_like(mask, dtype=torch.bool) if outside is None else outside.bool()
    if spec.needs_prox and prox_logp is None:
        raise ValueError(f"loss {spec.name!r} with seq_rejection {spec.seq_rejection!r} needs prox_logp")
    keep_seq = (sequence_keep(spec, prox_logp, mu, mask, seq, prox_outside)
                if spec.seq_rejection != "none" else None)  # fmt: skip
    live = mask * (~out).to(mask.dtype)  # π_θ(y) = 0 outside the support: no gradient, no loss term
    logp = torch.where(out, mu, logp)
    log_r = torch.clamp(logp - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.where(out, torch.zeros_like(log_r), torch.exp(log_r))
    r_d = r.detach()
    in_band = ((r_d >= spec.trust_low) & (r_d <= spec.trust_high)).to(logp.dtype)
    prox_zero = None
    if prox_logp is not None:
        prox_zero = torch.zeros_like(mask) if prox_outside is None else prox_outside.to(mask.dtype)
    tokens = Tokens(logp, mu, adv, live, seq, log_r, r, r_d, in_band, _any_in_traj(out, mask, seq),
                    None if prox_logp is None else prox_logp.detach(), prox_zero)  # fmt: skip
    per_tok, clipped, in_band = loss_def.per_token(spec, tokens)
    if spec.kl_coef > 0:
        per_tok = per_tok + spec.kl_coef * in_band * k3(log_r)
    counted = live if keep_seq is None else live * keep_seq
    loss = (per_tok * weight * counted).sum()
    log_r_stat = torch.where(out, torch.full_like(log_r, -LOG_RATIO_CLAMP), log_r.detach())
    stats = {
        "tokens": float(mask.sum()),
        "masked": float(((1.0 - in_band) * mask).sum()),
        "clipped": float((clipped * mask).sum()),
        "kl": float((k3(log_r_stat) * mask).sum()),
        "r": float((r_d * mask).sum()),
        "r_sq": float((r_d * r_d * mask).sum()),
        "seq_rejected": float((mask - (mask if keep_seq is None else mask * keep_seq)).sum()),
        "outside": float((out.to(mask.dtype) * mask).sum()),
    }
    return loss, stats


# ----------------------------------------------------------------------------- the registered losses


@register_loss("icepop", "−1[r ∈ [lo, hi]]·r·A (INTELLECT-3's IcePop form)")
def _icepop(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    return -(t.in_band * t.r * t.adv), 1.0 - t.in_band, t.in_band


@register_loss("ppo", "−min(r·A, clip(r, 1−ε, 1+ε_h)·A), π_old = μ")
def _ppo(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    per_tok, clipped = _ppo_clip(t.r, t.adv, 1.0 - spec.eps_low, 1.0 + spec.eps_high)
    return per_tok, clipped, t.in_band


@register_loss("decoupled_ppo", "−w·min(u·A, clip(u)·A), u = π_θ/π_prox, w = π_prox/μ in [lo, hi]", needs_prox=True)
def _decoupled_ppo(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    assert t.prox is not None and t.prox_zero is not None
    behav_w = torch.exp(torch.clamp(t.prox - t.mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * (1.0 - t.prox_zero)
    keep = ((behav_w >= spec.trust_low) & (behav_w <= spec.trust_high)).to(t.logp.dtype)
    u = torch.exp(torch.clamp(t.logp - t.prox, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    per_tok, clipped = _ppo_clip(u, t.adv, 1.0 - spec.eps_low, 1.0 + spec.eps_high)
    return keep * behav_w * per_tok, torch.maximum(clipped, 1.0 - keep), keep


@register_loss("tis", "−sg(min(r, C))·A·log π_θ")
def _tis(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    return -(torch.clamp(t.r_d, max=spec.tis_cap) * t.adv * t.logp), (t.r_d > spec.tis_cap).to(t.logp.dtype), t.in_band


@register_loss("cispo", "−sg(min(r, 1+ε_h))·A·log π_θ")
def _cispo(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    hi = 1.0 + spec.eps_high
    return -(torch.clamp(t.r_d, max=hi) * t.adv * t.logp), (t.r_d > hi).to(t.logp.dtype), t.in_band


@register_loss("gspo", "GSPO-token, s_i = exp(mean log r) over the trajectory", clip_eps=3e-4, clip_eps_high=4e-4,
               aggregation="seq_mean_token_mean")
def _gspo(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    # sg[s_i] broadcast to its tokens; a trajectory with a token outside the support has s_i = 0
    s_seq = torch.exp(t.per_traj_mean(t.log_r.detach())) * (1.0 - t.seq_zero)
    s_tok = s_seq * torch.exp(t.logp - t.logp.detach())  # value s_i, gradient of log π_θ(y_t)
    per_tok, clipped = _ppo_clip(s_tok, t.adv, 1.0 - spec.eps_low, 1.0 + spec.eps_high)
    return per_tok * (1.0 - t.seq_zero), clipped, t.in_band  # s_i = 0: no gradient, no loss term


@register_loss("topr", "−A·log π_θ (A ≥ 0); −sg(min(Π r, 1))·A·log π_θ (A < 0)")
def _topr(spec: LossSpec, t: Tokens) -> tuple[Tensor, Tensor, Tensor]:
    taper = torch.exp(torch.clamp(t.per_traj(t.log_r.detach()), max=0.0)) * (1.0 - t.seq_zero)  # min(Π r, 1)
    w = torch.where(t.adv >= 0, torch.ones_like(taper), taper)
    return -(w * t.adv * t.logp), ((t.adv < 0) & (taper < 1)).to(t.logp.dtype), t.in_band


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
    tokens in trajectories dropped by ``seq_rejection``; ``outside_frac``: share of tokens outside
    the trainer's own top-K support (r = 0, module docstring).
    """
    n = stats.get("tokens", 0.0)
    if n <= 0:
        return {"mismatch_kl": 0.0, "masked_frac": 0.0, "clip_frac": 0.0, "ess": 1.0, "seq_rejected_frac": 0.0,
                "outside_frac": 0.0}
    r_sq = stats["r_sq"]
    return {
        "mismatch_kl": stats["kl"] / n,
        "masked_frac": stats["masked"] / n,
        "clip_frac": stats["clipped"] / n,
        "ess": (stats["r"] ** 2) / (n * r_sq) if r_sq > 0 else 1.0,
        "seq_rejected_frac": stats.get("seq_rejected", 0.0) / n,
        "outside_frac": stats.get("outside", 0.0) / n,
    }


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
    return total
