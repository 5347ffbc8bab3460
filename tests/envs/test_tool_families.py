"""A multi-turn tool episode stays token-exact with each family's chat template, and the
family's parser (named by the client) reaches the env's parse step."""

from __future__ import annotations

import pytest
from chat_families import FAMILIES, FamilyClient, family_tokenizer, make_env, scripted

from agentrl.render import render_chat_text
from agentrl.types import SamplingParams, messages_to_dicts


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_multi_turn_tool_episode_is_token_exact_with_the_family_template(family):
    tok, env = family_tokenizer(family), make_env()
    client = FamilyClient(tok, scripted(family, env), tool_parser=family)
    (task,) = env.dataset()
    traj = await env.rollout(client, task, SamplingParams(max_tokens=200))
    await env.rubric.score_group([traj])
    assert traj.error is None and traj.stop_reason == "done" and traj.reward == 1.0
    assert traj.metrics["template_breaks"] == 0 and len(traj.sequences) == 1 and len(traj.turns) == 3
    calls = [(tc.name, tc.arguments) for m in traj.messages for tc in m.tool_calls]
    assert calls == [("calculator", '{"expression": "12+30"}'), ("calculator", '{"expression": "42*2"}')]
    assert [m.content for m in traj.messages if m.role == "tool"] == ["42", "84"]
    seq = traj.sequences[0]
    seq.validate()
    # every prompt the client saw extends the previous one and the tokens sampled after it
    for k in range(1, len(client.prompts)):
        assert client.prompts[k][: len(client.prompts[k - 1]) + len(client.samples[k - 1])] == (
            client.prompts[k - 1] + client.samples[k - 1])
    assert seq.token_ids == client.prompts[-1] + client.samples[-1]
    # and it spells the template's rendering of the whole conversation (up to the glue after the last turn)
    spelled = tok.decode(seq.token_ids, skip_special_tokens=False)
    whole = render_chat_text(tok, messages_to_dicts(traj.messages), env.tool_schemas(), add_generation_prompt=False)
    assert whole.startswith(spelled) and whole[len(spelled):].strip() == ""
    assert [i for i, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m] == sum(client.samples, [])


@pytest.mark.parametrize("family", ["llama3_json", "mistral", "pythonic"])
async def test_with_the_wrong_parser_the_calls_are_lost(family):
    """What happened before named parsers: a non-Hermes model's calls were read as plain text."""
    tok, env = family_tokenizer(family), make_env()
    client = FamilyClient(tok, scripted(family, env), tool_parser="hermes")
    traj = await env.rollout(client, env.dataset()[0], SamplingParams(max_tokens=200))
    assert traj.error is None and len(traj.turns) == 1 and not traj.messages[-1].tool_calls


async def test_setup_may_choose_the_parser_itself():
    tok, env = family_tokenizer("pythonic"), make_env()
    original = env.setup

    async def setup(task):
        state = await original(task)
        state["tool_parser"] = "pythonic"
        return state

    env.setup = setup
    client = FamilyClient(tok, scripted("pythonic", env), tool_parser="hermes")
    traj = await env.rollout(client, env.dataset()[0], SamplingParams(max_tokens=200))
    assert traj.error is None and len(traj.turns) == 3
