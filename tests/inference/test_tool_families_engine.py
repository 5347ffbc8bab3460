"""Each tool-call family on the embedded engine: a random-weight tiny model with the family's
tokenizer and chat template, taught the scripted episode's three turns (greedy decoding then
replays them), served with the parser detected from its template."""

from __future__ import annotations

import json

import pytest
from chat_families import (
    FAMILIES,
    FamilyClient,
    build_family_model,
    family_tokenizer,
    make_env,
    scripted,
    teach,
)

from agentrl.inference import PolicyClient, start_embedded_engine
from agentrl.types import SamplingParams, messages_to_dicts


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
async def test_a_tool_episode_and_the_chat_route_on_the_embedded_engine(family, tmp_path):
    env = make_env()
    (task,) = env.dataset()
    # the scripted episode: every prompt the model will see and the turn it must write
    script = FamilyClient(family_tokenizer(family), scripted(family, env), tool_parser=family)
    assert (await env.rollout(script, task, SamplingParams(max_tokens=200))).error is None
    model_dir = build_family_model(tmp_path / family, family)
    teach(model_dir, list(zip(script.prompts, script.samples, strict=True)))

    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    with start_embedded_engine(model_dir, device="cpu", max_model_len=1024, max_batch_size=4) as eng:
        async with PolicyClient(eng.base_url, eng.model, tokenizer=str(model_dir)) as pc:
            assert pc.tool_parser == family  # detected from the model's own template
            await pc.probe(token_path=True, training=True)
            traj = await env.rollout(pc, task, greedy)
            # the chat route splits the first call with the parser the server detected
            (reply,) = await pc.chat(messages_to_dicts(task.prompt), greedy, tools=env.tool_schemas())
    await env.rubric.score_group([traj])
    assert traj.error is None and traj.reward == 1.0 and traj.metrics["template_breaks"] == 0
    assert [t.completion_ids for t in traj.turns] == script.samples
    assert traj.sequences[0].token_ids == script.prompts[-1] + script.samples[-1]
    assert [m.content for m in traj.messages if m.role == "tool"] == ["42", "84"]
    assert reply.finish_reason == "tool_calls" and reply.token_ids == script.samples[0]
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("calculator", {"expression": "12+30"})]
