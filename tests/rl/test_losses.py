"""Loss functions against values computed by hand."""

import math

import pytest
import torch

from agentrl.trainer.losses import LossSpec, policy_loss, summarize, token_weights
from agentrl.types import Group, Message, Task, Trajectory


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def _ratio_setup(ratios, mu=None):
    """logp/mu pairs with the given π/μ ratios (μ = log 0.5 unless given)."""
    mu = _t(mu if mu is not None else [math.log(0.5)] * len(ratios))
    logp = _leaf([float(m) + math.log(r) for m, r in zip(mu, ratios, strict=True)])
    return logp, mu


def test_icepop_masks_tokens_outside_the_band_and_keeps_the_denominator():
    logp, mu = _ratio_setup([1.0, 3.0, 0.25])
    ones = _t([1, 1, 1])
    loss, stats = policy_loss(LossSpec("icepop"), logp, mu, ones, ones, ones / 3)
    assert loss.item() == pytest.approx(-1 / 3)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 3, 0.0, 0.0])
    s = summarize(stats)
    assert s["masked_frac"] == pytest.approx(2 / 3)
    k3 = [0.0, 3 - 1 - math.log(3), 0.25 - 1 - math.log(0.25)]
    assert s["mismatch_kl"] == pytest.approx(sum(k3) / 3)
    assert s["ess"] == pytest.approx(4.25**2 / (3 * (1 + 9 + 0.0625)))


def test_icepop_ignores_tokens_outside_the_loss_mask():
    logp, mu = _ratio_setup([1.0, 1.0])
    mask = _t([1, 0])
    loss, stats = policy_loss(LossSpec("icepop"), logp, mu, mask, _t([2.0, 5.0]), _t([1.0, 1.0]))
    assert loss.item() == pytest.approx(-2.0)
    assert stats["tokens"] == 1


def test_kl_term_gradient_is_r_minus_one():
    logp, mu = _ratio_setup([1.5])
    loss, _ = policy_loss(LossSpec("icepop", kl_coef=0.1), logp, mu, _t([1]), _t([0.0]), _t([1.0]))
    assert loss.item() == pytest.approx(0.1 * (1.5 - 1 - math.log(1.5)))
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.1 * 0.5)


def test_ppo_clip_takes_the_pessimistic_branch():
    logp, mu = _ratio_setup([1.5, 0.5])
    loss, stats = policy_loss(LossSpec("ppo", clip_eps=0.2), logp, mu, _t([1, 1]), _t([1.0, -1.0]), _t([0.5, 0.5]))
    assert loss.item() == pytest.approx(0.5 * (-1.2 + 0.8))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0])
    assert summarize(stats)["clip_frac"] == pytest.approx(1.0)


def test_ppo_unclipped_gradient_is_minus_r_times_a():
    logp, mu = _ratio_setup([1.1])
    loss, _ = policy_loss(LossSpec("ppo", clip_eps=0.2), logp, mu, _t([1]), _t([2.0]), _t([1.0]))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.1 * 2.0)


def test_tis_truncates_the_importance_weight():
    logp, mu = _ratio_setup([3.0, 0.5])
    loss, stats = policy_loss(LossSpec("tis", tis_cap=2.0), logp, mu, _t([1, 1]), _t([1.0, 1.0]), _t([1.0, 1.0]))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, -0.5])
    assert stats["clipped"] == 1


def test_cispo_caps_the_weight_from_above_only_and_every_token_keeps_gradient():
    logp, mu = _ratio_setup([3.0, 0.5, 1.1])
    ones = _t([1, 1, 1])
    loss, _ = policy_loss(LossSpec("cispo", clip_eps=0.2), logp, mu, ones, ones, ones)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.2, -0.5, -1.1])  # capped from above only


def test_gspo_uses_the_sequence_geometric_ratio():
    # seq 0: log r = [ln 2, 0] → s = √2 > 1.2 with A = +1: clipped, no gradient.
    # seq 1: log r = [0.1, -0.1] → s = 1, A = −1: gradient −A·s = +1 per token.
    mu = _t([math.log(0.5)] * 4)
    logp = _leaf([mu[0].item() + math.log(2), mu[1].item(), mu[2].item() + 0.1, mu[3].item() - 0.1])
    seq = torch.tensor([0, 0, 1, 1])
    adv = _t([1.0, 1.0, -1.0, -1.0])
    loss, _ = policy_loss(LossSpec("gspo", clip_eps=0.2), logp, mu, _t([1, 1, 1, 1]), adv, _t([1.0] * 4), seq=seq)
    assert loss.item() == pytest.approx(2 * -1.2 + 2 * 1.0)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])


def test_decoupled_ppo_weights_by_prox_over_behaviour_and_masks_outside_band():
    logp, mu = _ratio_setup([1.5, 4.0])
    prox = logp.detach().clone()  # one optimizer step per batch: π_prox = π_θ
    loss, stats = policy_loss(
        LossSpec("decoupled_ppo"), logp, mu, _t([1, 1]), _t([1.0, 1.0]), _t([1.0, 1.0]), prox_logp=prox
    )
    assert loss.item() == pytest.approx(-1.5)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.5, 0.0])
    assert stats["masked"] == 1


def test_group_advantages_mean_baseline_and_std_norm():
    r = _t([1.0, 0.0, 0.0, 1.0])
    def advantages(rewards, **kw):
        g = Group(Task([Message("user", "q")]), [Trajectory(Task([Message("user", "q")]), reward=x) for x in rewards])
        g.assign_advantages(**kw)
        return [t.advantage for t in g.trajectories]

    assert advantages(r.tolist()) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert advantages(r.tolist(), std_normalize=True) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert advantages([1.0, 1.0]) == [0.0, 0.0]


def test_token_weights_aggregations():
    assert token_weights([2, 4], "token_mean") == pytest.approx([1 / 6, 1 / 6])
    assert token_weights([2, 4], "seq_mean_token_mean") == pytest.approx([1 / 4, 1 / 8])
    assert token_weights([2, 4], "seq_mean_token_sum") == pytest.approx([1 / 2, 1 / 2])
    with pytest.raises(ValueError):
        token_weights([1], "bogus")


def test_a_new_loss_is_one_function_and_one_registration(tmp_path):
    """The README's example: registered, the config accepts its name and the trainer runs it."""
    from agentrl.config import ConfigError, load_config
    from agentrl.trainer.losses import LOSSES, Tokens, register_loss

    @register_loss("reinforce_test", "−A·log π_θ")
    def _reinforce(spec: LossSpec, t: Tokens):
        return -(t.adv * t.logp), torch.zeros_like(t.logp), t.in_band

    try:
        cfg = load_config([], ["--trainer.loss.name=reinforce_test"])
        spec = LossSpec.from_config(cfg.trainer.loss)
        logp = _leaf([-1.0, -2.0])
        loss, _ = policy_loss(spec, logp, _t([-1.0, -2.0]), _t([1, 1]), _t([2.0, -1.0]), _t([0.5, 0.5]))
        loss.backward()
        assert loss.item() == pytest.approx(-(0.5 * 2.0 * -1.0 + 0.5 * -1.0 * -2.0))
        assert logp.grad.tolist() == pytest.approx([-1.0, 0.5])
        with pytest.raises(ValueError, match="registered twice"):
            register_loss("reinforce_test", "again")(_reinforce)
    finally:
        LOSSES.pop("reinforce_test")
    with pytest.raises(ConfigError, match="unknown loss 'icepp'; did you mean 'icepop'"):
        load_config([], ["--trainer.loss.name=icepp"])
