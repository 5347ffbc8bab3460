"""Golden tests: every loss's value and gradient on a fixed tiny batch equal an independent,
plain-torch implementation of the published formula written here, trajectory by trajectory
(no call into agentrl.trainer.losses beyond the functions under test: ``policy_loss`` and
``token_weights``).

The batch: 3 trajectories (7 loss tokens + 1 masked token), ratios on both sides of every
threshold, advantages of both signs, one token outside the trainer's top-K support (π_θ = 0
under the replayed distribution, and outside π_prox's too), under every aggregation.

The support-replay rule the references encode: a token with π = 0 gives no gradient and no loss
term but keeps its weight in the denominator, and any sequence-level ratio over its trajectory is
0 (exp of a mean or sum that holds log 0 = −inf).
"""

import math

import pytest
import torch

from agentrl.trainer.losses import LossSpec, policy_loss, token_weights

MU = [-1.0, -0.5, -2.0, -0.3, -1.2, -0.8, -0.1, -0.7]
LOG_R = [0.0, 1.2, -0.9, 0.1, 0.05, -0.2, 0.8, 0.3]  # log π_θ/μ: r from 0.41 to 3.3
PROX_SHIFT = [0.1, 0.5, -0.4, 0.0, 0.02, 0.1, 0.2, 0.1]  # log π_prox = μ + shift
MASK = [1, 1, 1, 1, 1, 1, 1, 0]
TRAJ = [0, 0, 0, 1, 1, 2, 2, 2]
OUTSIDE = [0, 0, 0, 0, 1, 0, 0, 0]  # token 4 fell out of the top-K support (π_θ and π_prox)
ADV = {0: 1.0, 1: -0.5, 2: -1.0}
N = sum(MASK)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def log_r(i):
    return -math.inf if OUTSIDE[i] else LOG_R[i]


def log_rho(i):
    return -math.inf if OUTSIDE[i] else PROX_SHIFT[i]


def weight_of(i, aggregation):
    """Written out from the definitions: 1/N, 1/(n_traj·len), 1/n_traj."""
    n_traj = len(ADV)
    length = len(traj_tokens(TRAJ[i]))
    return {"token_mean": 1 / N, "seq_mean_token_mean": 1 / (n_traj * length), "seq_mean_token_sum": 1 / n_traj}[
        aggregation]


def inputs(aggregation):
    mu = torch.tensor(MU, dtype=torch.float64)
    logp = (mu + torch.tensor(LOG_R, dtype=torch.float64)).clone().requires_grad_(True)
    prox = mu + torch.tensor(PROX_SHIFT, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    seq = torch.tensor(TRAJ)
    adv = torch.tensor([ADV[t] for t in TRAJ], dtype=torch.float64)
    per_traj = token_weights([len(traj_tokens(t)) for t in sorted(ADV)], aggregation)
    weight = torch.tensor([per_traj[t] for t in TRAJ], dtype=torch.float64)
    return logp, mu, prox, mask, seq, adv, weight


def ours(spec, aggregation="token_mean"):
    logp, mu, prox, mask, seq, adv, weight = inputs(aggregation)
    outside = torch.tensor(OUTSIDE, dtype=torch.bool)
    loss, _ = policy_loss(spec, logp, mu, mask, adv, weight, prox_logp=prox, seq=seq, outside=outside,
                          prox_outside=outside)
    loss.backward()
    return loss.item(), logp.grad.clone()


def reference(per_token, aggregation):
    """Σ over loss tokens of weight · per_token(i, logp), with autograd on an independent leaf; a
    token outside the support adds nothing (π = 0: no gradient, no loss term)."""
    logp = torch.tensor([m + r for m, r in zip(MU, LOG_R, strict=True)], dtype=torch.float64, requires_grad=True)
    terms = [weight_of(i, aggregation) * per_token(i, logp) for i in range(8) if MASK[i] and not OUTSIDE[i]]
    loss = sum(terms)
    loss.backward()
    return loss.item(), logp.grad.clone()


def r_of(i, logp):
    return torch.exp(logp[i] - MU[i])


def traj_tokens(t):
    return [i for i in range(8) if TRAJ[i] == t and MASK[i]]


def check(spec, per_token):
    for aggregation in AGGREGATIONS:
        got, want = ours(spec, aggregation), reference(per_token, aggregation)
        assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-12), aggregation
        assert torch.allclose(got[1], want[1], atol=1e-12), (aggregation, got[1], want[1])


def test_icepop_drops_tokens_outside_the_band():
    def tok(i, logp):  # INTELLECT-3's IcePop form: M(r)·A with M(r) = r inside [α, β], 0 outside
        r = r_of(i, logp)
        return -(r * ADV[TRAJ[i]]) if 0.5 <= r.item() <= 2.0 else 0.0 * r

    check(LossSpec("icepop", trust_low=0.5, trust_high=2.0), tok)


def test_icepop_kl_term_only_inside_the_band():
    def tok(i, logp):
        r = r_of(i, logp)
        inside = 0.5 <= r.item() <= 2.0
        policy = -(r * ADV[TRAJ[i]]) if inside else 0.0 * r
        kl = 0.1 * (r - 1 - torch.log(r)) if inside else 0.0 * r
        return policy + kl

    check(LossSpec("icepop", kl_coef=0.1), tok)


def test_bypass_ppo_clip():
    def tok(i, logp):  # PPO with π_old := μ
        r, a = r_of(i, logp), ADV[TRAJ[i]]
        return -torch.minimum(r * a, torch.clamp(r, 0.8, 1.28) * a)

    check(LossSpec("ppo", clip_eps=0.2, clip_eps_high=0.28), tok)


def test_decoupled_ppo_areal():
    def tok(i, logp):  # AReaL: w·max(−A·u, −A·clip(u)), u = π_θ/π_prox, w = π_prox/π_behav in band
        prox = MU[i] + PROX_SHIFT[i]
        u, a = torch.exp(logp[i] - prox), ADV[TRAJ[i]]
        w = math.exp(prox - MU[i])
        if not 0.5 <= w <= 2.0:
            return 0.0 * u
        return w * torch.maximum(-a * u, -a * torch.clamp(u, 0.8, 1.2))

    check(LossSpec("decoupled_ppo", clip_eps=0.2), tok)


def test_tis_truncates_the_weight():
    def tok(i, logp):  # −sg(min(r, C))·A·log π
        w = min(math.exp(LOG_R[i]), 2.0)
        return -(w * ADV[TRAJ[i]] * logp[i])

    check(LossSpec("tis", tis_cap=2.0), tok)


def test_cispo_caps_from_above_only():
    def tok(i, logp):  # MiniMax-M1 with no lower bound: −sg(min(r, 1 + ε_high))·A·log π
        w = min(math.exp(LOG_R[i]), 1.0 + 0.28)
        return -(w * ADV[TRAJ[i]] * logp[i])

    check(LossSpec("cispo", clip_eps=0.2, clip_eps_high=0.28), tok)


def test_gspo_token_uses_the_trajectory_geometric_ratio():
    def tok(i, logp):  # s_i = exp(mean_t log r) over the whole trajectory; s_it = sg(s_i)·π/sg(π)
        toks = traj_tokens(TRAJ[i])
        s = math.exp(sum(log_r(k) for k in toks) / len(toks))
        if s == 0:  # a token with π = 0: the clip's value is constant in θ, the trajectory adds nothing
            return 0.0 * logp[i]
        s_it = s * torch.exp(logp[i] - logp[i].detach())
        a = ADV[TRAJ[i]]
        return -torch.minimum(s_it * a, torch.clamp(s_it, 0.8, 1.2) * a)

    check(LossSpec("gspo", clip_eps=0.2), tok)


def test_topr_tapers_only_negative_trajectories():
    def tok(i, logp):  # TOPR: A ≥ 0 → −A·log π; A < 0 → −sg([Π_t r]_0^1)·A·log π
        a = ADV[TRAJ[i]]
        if a >= 0:
            return -(a * logp[i])
        ratio = math.exp(sum(log_r(k) for k in traj_tokens(TRAJ[i])))
        return -(min(ratio, 1.0) * a * logp[i])

    check(LossSpec("topr"), tok)


@pytest.mark.parametrize(("mode", "low", "high", "dropped"), [("geo", 0.95, 1.1, {1, 2}), ("k3", 0.0, 0.05, {0, 1}),
                                                               ("veto", 0.7, 99.0, {0, 1})])
def test_sequence_rejection_drops_whole_trajectories(mode, low, high, dropped):
    """MILES/verl rejection on ρ = π_prox/μ: geo-mean band, mean k3 bound, or a veto on any ρ_t
    (trajectory 1 holds a token outside π_prox's support, ρ = 0: every mode rejects it)."""
    spec = LossSpec("icepop", seq_rejection=mode, seq_low=low, seq_high=high)

    def keep(t):
        rho = [log_rho(k) for k in traj_tokens(t)]  # log ρ
        if mode == "geo":
            return low <= math.exp(sum(rho) / len(rho)) <= high
        if mode == "k3":
            return sum(math.exp(x) - 1 - x for x in rho) / len(rho) <= high
        return all(math.exp(x) >= low for x in rho)

    assert {t for t in ADV if not keep(t)} == dropped

    def tok(i, logp):
        r = r_of(i, logp)
        if not keep(TRAJ[i]) or not 0.5 <= r.item() <= 2.0:
            return 0.0 * r
        return -(r * ADV[TRAJ[i]])

    check(spec, tok)


def test_the_losses_differ_where_their_formulas_do():
    grads = {name: ours(LossSpec(name, clip_eps=0.2))[1] for name in ("icepop", "ppo", "decoupled_ppo", "tis", "cispo",
                                                                       "gspo", "topr")}
    names = list(grads)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            assert not torch.allclose(grads[names[a]], grads[names[b]]), (names[a], names[b])
