"""HarnessEnv against the real embedded engine: unchanged ``openai`` SDK programs (a sync
subprocess with tools and streaming, an in-process async agent with concurrent calls) on a
tiny model taught one tool call; every call's ids, μ and versions are the engine's."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest
from tool_call_model import TOOL_PROMPT, TOOLS

from agentrl.envs import HarnessEnv
from agentrl.inference import PolicyClient
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
SAMPLING = SamplingParams(max_tokens=40, temperature=1.0, seed=0)
ROWS = [{"id": "q", "prompt": TOOL_PROMPT[0]["content"], "answer": "42"}]


@pytest.fixture(scope="module")
def served(engine, model_dir):
    """The session's engine on the tiny model taught one tool call (tests/inference/conftest.py)."""
    return engine, model_dir


def check_record(traj, client_prompts: list[list[int]]) -> None:
    """Each call: its prompt is its sequence's prefix; its sampled ids carry the engine's μ and version."""
    for seq in traj.sequences:
        seq.validate()
        sampled = [(lp, v) for lp, v, m in zip(seq.logprobs, seq.versions, seq.loss_mask, strict=True) if m]
        assert sampled and all(math.isfinite(lp) and lp <= 0 and v == 0 for lp, v in sampled)
    assert sum(s.num_sampled for s in traj.sequences) == sum(len(t.completion_ids) for t in traj.turns)
    for prompt in client_prompts:
        assert any(s.token_ids[: len(prompt)] == prompt for s in traj.sequences)


async def test_a_sync_sdk_program_with_tools_and_streaming(served, tmp_path):
    eng, path = served
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent(f"""
        import json, os
        from openai import OpenAI
        task = json.loads(os.environ["AGENTRL_TASK"])
        tools = {TOOLS!r}
        client = OpenAI()
        messages = list(task["prompt"])
        first = client.chat.completions.create(model="gpt-4o", messages=messages, tools=tools)
        msg = first.choices[0].message
        print("finish", first.choices[0].finish_reason)
        messages.append(msg)
        for call in msg.tool_calls or []:
            messages.append({{"role": "tool", "tool_call_id": call.id,
                              "content": str(eval(json.loads(call.function.arguments)["expression"]))}})
        text = ""
        for chunk in client.chat.completions.create(model="gpt-4o", messages=messages, tools=tools, stream=True):
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        print(json.dumps(msg.tool_calls[0].function.name if msg.tool_calls else None))
    """))
    env = HarnessEnv([sys.executable, str(agent)], dataset=ROWS)
    async with PolicyClient(eng.base_url, eng.model, tokenizer=str(path)) as client:
        prompts = []
        complete = client.complete

        async def recording(prompt_ids, sampling, n=1):
            prompts.append(list(prompt_ids))
            return await complete(prompt_ids, sampling, n)

        client.complete = recording
        try:
            traj = await env.rollout(client, env.dataset()[0], SAMPLING)
        finally:
            await env.close()
        assert traj.error is None, traj.error
        assert traj.state["result"] == json.dumps("calculator")  # the taught call came back parsed
        assert len(traj.turns) == 2 and traj.turns[0].finish_reason == "stop"
        # the first prompt is exactly the template's rendering of what the program sent
        first = await client.tokenize(messages=TOOL_PROMPT, tools=TOOLS)
        assert prompts[0] == first
        check_record(traj, prompts)
        # the tool result was bridged onto the sampled call: one sequence, nothing re-tokenized
        assert traj.metrics["template_breaks"] == 0 and len(traj.sequences) == 1
        (seq,) = traj.sequences
        assert seq.token_ids[len(first) : len(first) + len(traj.turns[0].completion_ids)] == traj.turns[0].completion_ids


async def test_an_in_process_async_agent_with_concurrent_calls(served):
    eng, path = served

    async def agent(client, task):
        import asyncio

        async def ask(extra):
            r = await client.chat.completions.create(
                model="m", messages=task["prompt"] + [{"role": "user", "content": extra}], max_tokens=12)
            return r.choices[0].message.content

        answers = await asyncio.gather(*(ask(f"variant {k}") for k in range(3)))
        return str(len(answers))

    env = HarnessEnv(agent=agent, dataset=ROWS)
    async with PolicyClient(eng.base_url, eng.model, tokenizer=str(path)) as client:
        try:
            traj = await env.rollout(client, env.dataset()[0], SAMPLING)
        finally:
            await env.close()
    assert traj.error is None, traj.error
    assert traj.state["result"] == "3" and len(traj.turns) == 3
    assert len(traj.sequences) == 3 and traj.metrics["template_breaks"] == 2
    texts = [str(s.token_ids) for s in traj.sequences]
    assert len(set(texts)) == 3
    check_record(traj, [])
