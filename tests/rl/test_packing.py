"""Shared-prompt packing: the same log π_θ and gradients as one full forward per sequence."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.config import TrainerConfig
from agentrl.trainer.logprobs import head_of
from agentrl.trainer.packing import attention_mask, choose, pack, packable, plan
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory


def _model(attn: str = "sdpa", family: str = "llama", **kw):
    torch.manual_seed(0)
    size = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **kw)
    if family == "qwen3":  # a config with per-layer kinds: the model takes a dict of masks
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg, cls = Qwen3Config(head_dim=8, **size), Qwen3ForCausalLM
    else:
        cfg, cls = LlamaConfig(**size), LlamaForCausalLM
    cfg._attn_implementation = attn
    return cls(cfg).eval()


def _rows() -> list[tuple[list[int], list[int]]]:
    """A group of four sharing a 12-token prompt (multi-turn masks with forced gaps), a fifth
    with the same prompt, and two rows that share nothing with it."""
    rng = random.Random(0)
    prompt = [rng.randrange(1, 64) for _ in range(12)]
    rows = []
    for sampled, forced, more in ((4, 3, 2), (6, 0, 0), (2, 5, 5), (1, 2, 1), (9, 0, 0)):
        tail = [rng.randrange(1, 64) for _ in range(sampled + forced + more)]
        rows.append((prompt + tail, [0] * 12 + [1] * sampled + [0] * forced + [1] * more))
    other = [rng.randrange(1, 64) for _ in range(15)]
    rows.append((other, [0] * 6 + [1] * 9))
    rows.append((other[:8] + [7, 8, 9], [0] * 8 + [1] * 3))  # shares 8 tokens with `other`, but its prompt differs
    return rows


def _reference(model, rows, coef):
    """Plain path, written independently: one full forward per row, log-softmax of the logits."""
    out = []
    for ids, mask in rows:
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        out += [logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]]
    logp = torch.stack(out)
    (logp * coef).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed(model, rows, coef):
    decoder, logits_fn = head_of(model)
    pk = pack(rows, plan(rows, model.config.hidden_size), pad_id=0)
    hidden = decoder(input_ids=pk.ids, position_ids=pk.positions,
                     attention_mask=attention_mask(pk, model.config, torch.float32)).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[pk.hidden_at]
    tokens = torch.tensor([ids[t] for ids, mask in rows for t in range(1, len(ids)) if mask[t]])
    logp = torch.log_softmax(logits_fn(hidden).float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    (logp * coef).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, pk


@pytest.mark.parametrize(("attn", "family"), [("sdpa", "llama"), ("eager", "llama"), ("sdpa", "qwen3")])
def test_packed_logprobs_and_gradients_equal_one_full_forward_per_sequence(attn, family):
    rows = _rows()
    n_loss = sum(sum(m[1:]) for _, m in rows)
    coef = torch.randn(n_loss, generator=torch.Generator().manual_seed(1))
    model = _model(attn, family)
    assert packable(model.config)
    ref_logp, ref_grad = _reference(model, rows, coef)
    model.zero_grad()
    logp, grad, pk = _packed(model, rows, coef)
    assert pk.ids.shape[0] == 3  # the five that share the prompt became one pack; the other two stay apart
    real = int((pk.positions > 0).sum()) + pk.ids.shape[0]  # every non-pad column (position 0 once per pack)
    assert real == sum(len(ids) for ids, _ in rows) - 4 * 12  # the prompt's four repeats are gone
    torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=1e-5)
    for name, g in ref_grad.items():
        torch.testing.assert_close(grad[name], g, atol=2e-6, rtol=1e-4, msg=name)


def test_a_pack_takes_a_member_only_when_that_is_cheaper_than_its_own_row():
    prompt = [1, 2, 3, 4]
    rows = [(prompt + [10 + i] * 20, [0] * 4 + [1] * 20) for i in range(3)]
    # wide model: attention is cheap next to the linear layers, so the prompt is worth sharing
    assert plan(rows, hidden=100) == [(4, [0, 1, 2])]
    assert plan(rows, hidden=100, max_tokens=50) == [(4, [0, 1]), (4, [2])]
    # narrow model: one long row's attention costs more than a 4-token prompt saves
    assert plan(rows, hidden=1) == [(4, [0]), (4, [1]), (4, [2])]
    long_prompt = [(list(range(1, 41)) + [50 + i] * 4, [0] * 40 + [1] * 4) for i in range(3)]
    assert plan(long_prompt, hidden=1) == [(40, [0, 1, 2])]
    # rows share what comes before their first loss token (position 0 is never one)
    assert plan([([5, 6, 7], [0, 1, 1]), ([5, 6, 8], [0, 1, 1]), ([9, 9], [1, 1])], hidden=64) == [
        (1, [0, 1]), (1, [2])]


def test_only_full_causal_sdpa_or_eager_attention_is_packed():
    assert packable(_model("sdpa").config) and packable(_model("eager").config)
    flash = _model("sdpa").config
    flash._attn_implementation_internal = "flash_attention_2"
    assert not packable(flash)
    windowed = _model("sdpa").config
    windowed.sliding_window = 16
    assert not packable(windowed)
    mixed = _model("sdpa").config
    mixed.layer_types = ["full_attention", "sliding_attention"]
    assert not packable(mixed)
    alibi = _model("sdpa").config  # ALiBi biases by key column, not by position_ids
    alibi.alibi = True
    assert not packable(alibi)

    def no_positions(input_ids=None, attention_mask=None):
        return None

    assert not packable(_model("sdpa").config, no_positions)
    assert packable(_model("sdpa").config, _model("sdpa").model.forward)


def test_packs_are_used_only_when_the_padded_forward_costs_less():
    prompt = list(range(1, 41))
    group = [(prompt + [50 + i] * 10, [0] * 40 + [1] * 10) for i in range(8)]  # one 120-token pack of 8 rows
    assert choose(group, hidden=64) == [(40, list(range(8)))]
    # the same pack beside many short rows that share nothing: every row would be padded to 120
    loners = [([60 + i, 61 + i, 62 + i], [0, 1, 1]) for i in range(40)]
    assert choose(group + loners, hidden=64) is None
    assert choose(loners, hidden=64) is None  # nothing shared: nothing to pack


def _traj(prompt, completion, reward, mu=-1.0):
    s = TokenSequence()
    s.extend_forced(prompt)
    s.extend_sampled(completion, [mu] * len(completion), [0] * len(completion))
    s.extend_forced([9, 9])  # a tool reply, then a second turn
    s.extend_sampled(completion[:2], [mu] * 2, [0] * 2)
    return Trajectory(task=Task(prompt=[Message("user", "q")]), sequences=[s], reward=reward)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_trainer_step_is_the_same_with_and_without_prompt_sharing(tmp_path, monkeypatch, lora_rank):
    from agentrl.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=4)
    prompt = [1, 5, 6, 7, 8, 9, 10]
    groups = []
    for g in range(2):
        grp = Group(task=Task(prompt=[Message("user", "q")]),
                    trajectories=[_traj(prompt + [g], [40 + k, 41, 42 + g], float(k % 2)) for k in range(4)])
        grp.assign_advantages()
        groups.append(grp)
    import agentrl.trainer.trainer as trainer_module

    packed = []
    monkeypatch.setattr(trainer_module, "pack", lambda *a, **k: packed.append(1) or pack(*a, **k))
    stats, grads = [], []
    for share in (True, False):
        tr = Trainer(tiny, TrainerConfig.model_validate(
            {"lr": 1e-3, "share_prompt": share, "lora_rank": lora_rank, "loss": {"name": "ppo", "clip_eps": 10.0}}))
        assert tr.share_prompt is share
        monkeypatch.setattr(tr.optimizer, "step", lambda: None)  # keep the gradients to compare
        monkeypatch.setattr(tr.optimizer, "zero_grad", lambda set_to_none=True: None)
        stats.append(tr.step(groups))
        grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.requires_grad})
    assert packed  # the shared path really ran (each group's four episodes share a prompt)
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-4, abs=1e-7)
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-4)
    assert stats[0]["entropy"] == pytest.approx(stats[1]["entropy"], rel=1e-4)
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)
