"""The built-in game/gym/reasoning-gym environments against a real embedded engine on a tiny
model: real tokenizer and chat template, token-exact multi-turn sequences, rubric in range."""

import math

import pytest

from agentrl.inference import start_embedded_engine
from agentrl.inference.client import PolicyClient
from agentrl.plugins import load_environment
from agentrl.tiny_model import build_tiny_model
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048


def teach_demonstrations(model_dir, envs, steps: int = 80) -> None:
    """A short SFT on the envs' own demonstrations (assistant tokens only), so the tiny model
    writes short, well-formed turns that end with its end-of-turn token: the episodes then
    really go back and forth instead of running out of tokens on turn one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batches = []
    for env in envs:
        for demo in env.demonstrations(2):
            enc = tok.apply_chat_template(
                [m.to_dict() for m in demo], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = torch.tensor([enc["input_ids"]])
            labels = ids.clone()
            labels[0, torch.tensor(enc["assistant_masks"]) == 0] = -100
            batches.append((ids, labels))
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        ids, labels = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("builtin") / "tiny", layers=2, hidden=64, heads=2, max_position=MAX_MODEL_LEN
    )
    teach_demonstrations(model_dir, _envs())
    with start_embedded_engine(model_dir, max_batch_size=8, max_model_len=MAX_MODEL_LEN, device="cpu") as eng:
        yield eng


def _envs():
    return [
        load_environment("guess", num_train=4, num_eval=5, max_turns=3),
        load_environment("gym-text", game="frozenlake", num_tasks=2, num_eval_tasks=1, max_turns=3),
        load_environment("gym-text", game="blackjack", num_tasks=2, num_eval_tasks=1, max_turns=2),
        load_environment("reasoning-gym", task="leg_counting", size=2, eval_size=1),
    ]


async def test_episodes_against_the_embedded_engine(engine):
    client = PolicyClient(engine.base_url, engine.model)
    sampling = SamplingParams(max_tokens=24, temperature=1.0, seed=0)
    for env in _envs():
        task = next(iter(env.dataset()))
        traj = await env.rollout(client, task, sampling)
        await env.rubric.score(traj)
        assert traj.error is None, (env.name, traj.error)
        assert traj.stop_reason in {"done", "max_turns", "length"}, (env.name, traj.stop_reason)
        assert traj.turns and traj.metrics["template_breaks"] == 0
        # the taught model ends its turns itself, so game episodes really go back and forth
        assert all(t.finish_reason == "stop" for t in traj.turns), (env.name, traj.turns[-1].completion_text)
        if env.name == "guess":
            assert len(traj.turns) >= 2 or traj.metrics["solved"] == 1.0
        # one token-exact sample: the sampled tokens are exactly what the engine returned per turn
        (seq,) = traj.sequences
        seq.validate()
        assert [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m] == [
            i for turn in traj.turns for i in turn.completion_ids
        ]
        assert all(v >= 0 for v in seq.sampled_versions())
        lo, hi = env.reward_range
        assert math.isfinite(traj.reward) and lo <= traj.reward <= hi
        # each model reply got an env reply, except possibly the last
        assistant = [m for m in traj.completion if m.role == "assistant"]
        assert len(assistant) == len(traj.turns)


async def test_evaluate_writes_json_results_for_the_builtin_envs(engine, tmp_path):
    from agentrl.recipes.eval import evaluate, read_results

    client = PolicyClient(engine.base_url, engine.model)
    sampling = SamplingParams(max_tokens=24, temperature=1.0)
    for env in _envs():
        out = tmp_path / env.name
        summary = await evaluate(env, client, model=engine.model, out_dir=out, num_tasks=1, rollouts=2,
                                 concurrency=4, sampling=sampling)
        recs = list(read_results(out).values())
        assert summary.episodes == 2 and summary.error_rate == 0.0, (env.name, [r["error"] for r in recs])
        assert len(recs) == 2 and all(r["env"] == env.name and r["completion_tokens"] > 0 for r in recs)
