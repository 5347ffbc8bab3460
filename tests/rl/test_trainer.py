"""Trainer step on a real tiny model: direction, exact accumulation, LoRA push, checkpoints."""

import copy
import math

import pytest
import torch

from agentrl.config import TrainerConfig
from agentrl.trainer.checkpoint import MARKER, latest_checkpoint, load_checkpoint, save_checkpoint
from agentrl.trainer.losses import LOSSES
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory


def _traj(prompt, completion, reward, mu=-1.0):
    s = TokenSequence()
    s.extend_forced(prompt)
    s.extend_sampled(completion, [mu] * len(completion), [0] * len(completion))
    return Trajectory(task=Task(prompt=[Message("user", "q")]), sequences=[s], reward=reward)


def _groups():
    good, bad = [40, 41, 42], [50, 51, 52]
    g = Group(task=Task(prompt=[Message("user", "q")]),
              trajectories=[_traj([1, 5, 6], good, 1.0), _traj([1, 5, 6], bad, 0.0),
                            _traj([1, 5, 6, 7, 8], good + [43], 1.0), _traj([1, 5], bad, 0.0)])
    g.assign_advantages()  # as the buffer does when the group is scored
    return [g]


def _seq_logp(tr, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(tr.model(input_ids=ids).logits[0, :-1], -1)
    tgt = ids[0, 1:]
    return lp.gather(-1, tgt[:, None]).squeeze(-1)[len(prompt) - 1:].sum().item()


def _cfg(**kw):
    # ppo loss: the bypass ratio is well defined even though μ here is made up
    base = dict(lr=5e-3, steps=10, loss={"name": "ppo", "clip_eps": 10.0})
    base.update(kw)
    return TrainerConfig.model_validate(base)


def test_a_step_moves_probability_toward_rewarded_completions(tiny_model):
    tr = Trainer(tiny_model, _cfg())
    before = _seq_logp(tr, [1, 5, 6], [40, 41, 42]) - _seq_logp(tr, [1, 5, 6], [50, 51, 52])
    for _ in range(3):
        stats = tr.step(_groups())
    after = _seq_logp(tr, [1, 5, 6], [40, 41, 42]) - _seq_logp(tr, [1, 5, 6], [50, 51, 52])
    assert after > before + 0.1
    assert stats["grad_norm"] > 0 and stats["entropy"] > 0 and 0 < stats["ess"] <= 1


def test_micro_batching_accumulates_the_same_gradient(tiny_model, monkeypatch):
    big = Trainer(tiny_model, _cfg(micro_batch_tokens=4096))
    small = Trainer(tiny_model, _cfg(micro_batch_tokens=16))
    assert len(small._micro_batches(small._rows(_groups()[0], 0))) > 1
    for tr in (big, small):  # keep the accumulated gradients for inspection
        monkeypatch.setattr(tr.optimizer, "step", lambda: None)
        monkeypatch.setattr(tr.optimizer, "zero_grad", lambda set_to_none=True: None)
    a, b = big.step(_groups()), small.step(_groups())
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for (n, p), (_, q) in zip(big.model.named_parameters(), small.model.named_parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), n


def test_lora_trains_adapters_only_and_pushes_merged_adapted_weights(tiny_model):
    tr = Trainer(tiny_model, _cfg(lora_rank=4, lora_alpha=8))
    before = {k: v.clone() for k, v in tr.named_tensors().items()}
    tr.step(_groups())
    after = tr.named_tensors()
    merged = tr.merged_model().state_dict()
    assert set(after) == set(before) == set(merged), "every tensor of the plain model, named as there"
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed), "only adapted matrices move"
    for k in after:
        assert torch.allclose(merged[k], after[k], atol=1e-6), k


def test_adapter_push_merges_to_the_same_weights_and_never_accumulates(tiny_model):
    from transformers import AutoModelForCausalLM

    from agentrl.errors import RequestError as EngineRequestError
    from agentrl.weights.lora import AdapterMerger

    tr = Trainer(tiny_model, _cfg(lora_rank=4, lora_alpha=8))
    served = AutoModelForCausalLM.from_pretrained(tiny_model)  # what the engine holds: the base
    merger = AdapterMerger()
    for _ in range(2):  # two pushes: each is W0 + B·A, not (W0 + B·A) + B·A
        tr.step(_groups())
        adapters = tr.adapter_tensors()
        merged = tr.named_tensors()
        assert merger.apply(served, adapters.items()) == len(adapters) // 2
        state = served.state_dict()
        for k, v in merged.items():
            assert torch.allclose(state[k], v, atol=1e-6), k
    sent = sum(t.numel() for t in adapters.values())
    assert sent < sum(t.numel() for t in merged.values()) / 3  # only the factors travel

    name = next(iter(adapters)).removesuffix(".lora_A").removesuffix(".lora_B")
    before = served.state_dict()[name + ".weight"].clone()
    with pytest.raises(EngineRequestError, match="needs both"):
        merger.apply(served, [(name + ".lora_A", adapters[name + ".lora_A"])])
    with pytest.raises(EngineRequestError, match="do not fit"):
        merger.apply(served, [(name + ".lora_A", torch.zeros(4, 3)), (name + ".lora_B", adapters[name + ".lora_B"])])
    with pytest.raises(EngineRequestError, match="unknown adapted matrix"):
        merger.apply(served, [("nope.lora_A", torch.zeros(1, 1)), ("nope.lora_B", torch.zeros(1, 1))])
    assert torch.equal(served.state_dict()[name + ".weight"], before)  # refused pushes change nothing


def test_checkpoint_roundtrip_and_incomplete_ones_are_ignored(tiny_model, tmp_path):
    tr = Trainer(tiny_model, _cfg())
    tr.step(_groups())
    save_checkpoint(tmp_path, 1, tr.state_dict(), {"step": 1})
    ckpt2 = save_checkpoint(tmp_path, 2, tr.state_dict(), {"step": 2})
    (ckpt2 / MARKER).unlink()  # as if killed before the marker landed
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_00000001"
    ts, state = load_checkpoint(ckpt)
    fresh = Trainer(tiny_model, _cfg())
    fresh.load_state_dict(ts)
    assert state == {"step": 1}
    for p, q in zip(tr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # identical continuation: same optimizer moments and schedule
    g1, g2 = _groups(), copy.deepcopy(_groups())
    tr.step(g1)
    fresh.step(g2)
    for p, q in zip(tr.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_adamw_runs_fused_on_a_cpu_and_a_resumed_trainer_keeps_it(tiny_model, tmp_path):
    """torch's default AdamW on a CPU makes several passes per tensor (7x slower on SmolLM2); a
    checkpoint written before the fused kernel (or by another torch) must not switch it back off."""
    tr = Trainer(tiny_model, _cfg())
    assert [g["fused"] for g in tr.optimizer.param_groups] == [True]
    before = tr.model.lm_head.weight.detach().clone()
    tr.step(_groups())
    assert not torch.equal(before, tr.model.lm_head.weight)
    state = tr.state_dict()
    for g in state["optimizer"]["param_groups"]:
        g["fused"], g["foreach"] = None, None  # as an older agentrl saved it
    fresh = Trainer(tiny_model, _cfg())
    fresh.load_state_dict(state)
    assert [(g["fused"], g["foreach"]) for g in fresh.optimizer.param_groups] == [(True, None)]
    assert fresh.optimizer.state_dict()["state"].keys() == tr.optimizer.state_dict()["state"].keys()


def _mu_groups(tr):
    """Two groups whose μ are the model's own logprobs (as if sampled at T=1 by these weights)."""
    groups = _groups() + _groups()
    for g in groups:
        for t in g.trajectories:
            s = t.sequences[0]
            ids = torch.tensor([s.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(tr.model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            s.logprobs = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp, s.loss_mask[1:], strict=True)]
    return groups


@pytest.mark.slow
def test_decoupled_ppo_recomputes_the_proximal_policy_and_its_clip_acts(tiny_model):
    """Several updates per batch: π_θ moves away from π_prox, the clip engages, and the update
    differs from IcePop's (it used to be an alias: π_prox was π_θ detached)."""
    dec = Trainer(tiny_model, _cfg(loss={"name": "decoupled_ppo", "clip_eps": 0.05}, epochs=3, minibatches=2, lr=2e-2))
    ice = Trainer(tiny_model, _cfg(loss={"name": "icepop"}, epochs=3, minibatches=2, lr=2e-2))
    s_dec = dec.step(_mu_groups(dec))
    ice.step(_mu_groups(ice))
    assert s_dec["updates"] == 6 and s_dec["clip_frac"] > 0
    moved = [not torch.allclose(p, q) for p, q in zip(dec.model.parameters(), ice.model.parameters(), strict=True)]
    assert any(moved)
    # at identical weights the first pass has π_θ = μ exactly (the mismatch the metric reports)
    fresh = Trainer(tiny_model, _cfg(loss={"name": "icepop"}), seed=0)
    assert fresh.step(_mu_groups(fresh))["mismatch_kl"] < 1e-6


def _all_finite(stats):
    return all(math.isfinite(v) for k, v in stats.items() if k != "skipped_ids")


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_non_finite_mu_skips_its_episode_not_the_step_for_every_loss(tiny_model, name, bad):
    """One rule: the offending episode is left out (fate skipped, with the reason), the rest trains,
    every statistic stays finite (a NaN μ used to give IcePop/PPO a NaN loss and skip the whole
    step for CISPO/TIS/TOPR; a −inf μ set mismatch_kl to 2e7)."""
    tr = Trainer(tiny_model, _cfg(loss={"name": name}))
    groups = _mu_groups(tr)
    bad_traj = groups[0].trajectories[1]
    bad_traj.sequences[0].logprobs[-1] = bad
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    stats = tr.step(groups)
    assert stats["skipped"] == 0.0 and stats["updates"] == 1
    assert set(stats["skipped_ids"]) == {bad_traj.id} and "non-finite μ" in stats["skipped_ids"][bad_traj.id]
    assert _all_finite(stats) and stats["mismatch_kl"] < 1e-4
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())  # the rest trained


def test_a_non_finite_advantage_skips_its_episode(tiny_model):
    tr = Trainer(tiny_model, _cfg())
    groups = _groups()
    groups[0].trajectories[0].advantage = float("nan")
    stats = tr.step(groups)
    assert stats["updates"] == 1 and list(stats["skipped_ids"]) == [groups[0].trajectories[0].id]
    assert "non-finite advantage" in next(iter(stats["skipped_ids"].values())) and _all_finite(stats)


def _nan_norm_on(monkeypatch, calls):
    """clip_grad_norm_ reports a non-finite norm on these calls (0-based), as after an overflow."""
    real, n = torch.nn.utils.clip_grad_norm_, [0]

    def fake(params, max_norm):
        norm = real(params, max_norm)
        n[0] += 1
        return torch.tensor(float("nan")) if n[0] - 1 in calls else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", fake)


def test_a_non_finite_update_skips_only_its_minibatch_and_says_so(tiny_model, monkeypatch):
    """minibatches = 2, the first update non-finite: its group's episodes are skipped (they used to be
    marked trained, with skipped = 0 and a grad norm that could hide the NaN); the second trains."""
    tr = Trainer(tiny_model, _cfg(minibatches=2))
    groups = _groups() + _groups()
    _nan_norm_on(monkeypatch, {0})
    stats = tr.step(groups)
    assert (stats["updates"], stats["skipped_updates"], stats["skipped"]) == (1, 1, 0.0)
    assert set(stats["skipped_ids"]) == {t.id for t in groups[0].trajectories}
    assert _all_finite(stats) and stats["grad_norm"] > 0


def test_a_step_whose_every_update_is_non_finite_is_skipped_whole(tiny_model, monkeypatch):
    tr = Trainer(tiny_model, _cfg())
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    lr_before = tr.scheduler.get_last_lr()[0]
    _nan_norm_on(monkeypatch, {0})
    stats = tr.step(_groups())
    assert stats["skipped"] == 1.0 and stats["updates"] == 0 and _all_finite(stats)
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert tr.scheduler.last_epoch == 0 and tr.scheduler.get_last_lr()[0] == lr_before
    assert tr.step(_groups())["skipped"] == 0.0  # the next clean batch trains normally


def test_every_statistic_the_trainer_reports_reaches_the_metrics_row(tiny_model):
    """The step log used to copy a fixed key list: seq_rejected_frac, updates and skipped_updates
    never reached metrics.jsonl."""
    from agentrl.recipes.rl_steps import train_metrics

    tr = Trainer(tiny_model, _cfg(loss={"name": "icepop", "seq_rejection": "geo"}, minibatches=2))
    stats = tr.step(_mu_groups(tr))
    stats.pop("skipped_ids")
    row = train_metrics(stats)
    for key in ("seq_rejected_frac", "updates", "skipped_updates", "outside_frac", "mismatch_kl", "tokens"):
        assert f"train/{key}" in row, key
    assert row["train/updates"] == 2.0 and "train/skipped" not in row
    from agentrl.metrics import known_metric

    assert [k for k in row if not known_metric(k)] == []  # the metrics file refuses unnamed metrics
