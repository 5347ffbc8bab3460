"""Golden test of the trainer's wiring: with minibatches, micro-batches and groups of different
lengths, each optimizer update's gradient equals an independent reference — one plain forward per
sequence, the published per-token formula, the aggregation weights written out here.

μ is the model's own logprob shifted per token (ratios on both sides of every threshold), so the
proximal pass (decoupled PPO), the sequence ratios (GSPO, TOPR) and the weights all matter.
"""

import math

import pytest
import torch

from agentrl.config import TrainerConfig
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

SHIFTS = [0.0, 0.9, -0.8, 0.3, -0.1, 1.2, 0.05, -0.4]  # log π/μ, cycled over the loss tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=2, hidden=64, heads=4)


def _own_logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _groups(model):
    """Two groups of different lengths (prompt and completions), rewards of both signs."""
    shapes = [([1, 5, 6], [[40, 41], [50, 51, 52], [60]], [1.0, 0.0, 0.5]),
              ([1, 7, 8, 9, 10, 11], [[20, 21, 22, 23, 24, 25], [30, 31, 32, 33], [70, 71, 72, 73, 74]], [0.0, 1.0, 1.0])]
    groups, k = [], 0
    for prompt, completions, rewards in shapes:
        trajs = []
        for comp, reward in zip(completions, rewards, strict=True):
            own = _own_logprobs(model, prompt + comp)[len(prompt) - 1:]
            mu = []
            for lp in own:
                mu.append(lp - SHIFTS[k % len(SHIFTS)])
                k += 1
            s = TokenSequence()
            s.extend_forced(prompt)
            s.extend_sampled(comp, mu, [0] * len(comp))
            trajs.append(Trajectory(task=Task(prompt=[Message("user", "q")]), sequences=[s], reward=reward))
        g = Group(task=trajs[0].task, trajectories=trajs)
        g.assign_advantages()
        groups.append(g)
    return groups


def _weights(lens, aggregation):
    """Per trajectory, its tokens' weight: written out from the definitions."""
    if aggregation == "token_mean":
        return [1 / sum(lens)] * len(lens)
    if aggregation == "seq_mean_token_mean":
        return [1 / (len(lens) * n) for n in lens]
    return [1 / len(lens)] * len(lens)  # seq_mean_token_sum


def _reference_loss(name, model, groups, aggregation):
    """The loss of one update over ``groups`` (π_prox = the weights before it: the test never steps)."""
    trajs = [t for g in groups for t in g.trajectories]
    weights = _weights([t.sequences[0].num_sampled for t in trajs], aggregation)
    total = 0.0
    for t, w in zip(trajs, weights, strict=True):
        s = t.sequences[0]
        ids = s.token_ids
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        lp_all = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        pos = [i - 1 for i in range(1, len(ids)) if s.loss_mask[i]]
        logp = lp_all[pos]
        mu = torch.tensor([s.logprobs[i + 1] for i in pos], dtype=torch.float64)
        a = t.advantage
        r = torch.exp(logp - mu)
        if name == "icepop":  # −1[r ∈ [0.5, 2]]·r·A
            band = ((r.detach() >= 0.5) & (r.detach() <= 2.0)).double()
            terms = -(band * r * a)
        elif name == "decoupled_ppo":  # AReaL: w = π_prox/μ in band, u = π_θ/π_prox clipped at 0.2
            prox = logp.detach()
            wgt = torch.exp(prox - mu)
            keep = ((wgt >= 0.5) & (wgt <= 2.0)).double()
            u = torch.exp(logp - prox)
            terms = keep * wgt * torch.maximum(-a * u, -a * torch.clamp(u, 0.8, 1.2))
        elif name == "gspo":  # s_i = exp(mean log r), the paper's clip 3e-4 / 4e-4
            s_i = torch.exp((logp - mu).mean()).detach()
            s_it = s_i * torch.exp(logp - logp.detach())
            terms = -torch.minimum(s_it * a, torch.clamp(s_it, 1 - 3e-4, 1 + 4e-4) * a)
        else:  # topr
            taper = min(math.exp(float((logp - mu).sum())), 1.0) if a < 0 else 1.0
            terms = -(taper * a * logp)
        total = total + w * terms.sum()
    return total


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("name", ["icepop", "decoupled_ppo", "gspo", "topr"])
def test_each_update_of_a_minibatched_step_has_the_reference_gradient(tiny, monkeypatch, name, aggregation):
    cfg = TrainerConfig.model_validate({"lr": 1e-3, "minibatches": 2, "micro_batch_tokens": 40,
                                        "loss": {"name": name, "aggregation": aggregation}})
    tr = Trainer(tiny, cfg)
    groups = _groups(tr.model)
    got: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(tr.optimizer, "step", lambda: got.append(
        {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(1.0))  # no clip
    stats = tr.step(groups)
    assert stats["updates"] == 2 and not stats.get("skipped_ids")
    # the proximal pass pads a short group's rows to a long group's length, the update that trains
    # them does not (this crashed decoupled PPO and sequence rejection with minibatches > 1)
    rows = tr._rows(groups[0], 0) + tr._rows(groups[1], 3)
    assert any(len({r.traj < 3 for r in mb}) == 2 for mb in tr._micro_batches(rows))
    for update, part in zip(got, ([groups[0]], [groups[1]]), strict=True):  # one group per minibatch
        tr.model.zero_grad()
        _reference_loss(name, tr.model, part, aggregation).backward()
        for n, p in tr.model.named_parameters():
            assert torch.allclose(update[n], p.grad.float(), atol=1e-6, rtol=1e-4), (name, aggregation, n)
