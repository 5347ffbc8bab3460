"""The rollout loop against real parts: the tiny model's HF chat template, and the embedded engine."""

import json
from pathlib import Path

import pytest

from agentrl.plugins import load_environment
from agentrl.types import SamplingParams, messages_to_dicts

CALC = str(Path(__file__).resolve().parents[2] / "environments/calc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def render(tok, messages, tools, gen):
    out = tok.apply_chat_template(messages_to_dicts(messages) if messages and not isinstance(messages[0], dict)
                                  else messages, tools=tools, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class HFTemplateClient:
    """Tokenizes with the real tokenizer + template; 'samples' by encoding a scripted reply."""

    def __init__(self, tok, policy):
        self.tok, self.policy, self.prompts = tok, policy, []
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def tokenize(self, *, messages=None, tools=None, prompt=None, add_generation_prompt=True):
        return render(self.tok, messages, tools, add_generation_prompt)

    async def complete(self, prompt_ids, sampling, n=1):
        from agentrl.types import Completion

        self.prompts.append(list(prompt_ids))
        text = self.policy(self.tok.decode(prompt_ids))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eot]
        return [Completion(text, ids, [-1.0] * len(ids), [3] * len(ids), "stop")]


def solver(prompt: str) -> str:
    if "<|im_start|>tool\n" in prompt:
        return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    expr = prompt.rsplit("What is ", 1)[1].split("?")[0]
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expr}})}\n</tool_call>'


@pytest.mark.parametrize("show_tools", [False, True])
async def test_tool_episode_is_token_exact_with_the_real_template(tiny, show_tools):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    env = load_environment(CALC, num_train=20, show_tools=show_tools)
    client = HFTemplateClient(tok, solver)
    trajs = [await env.rollout(client, t, SamplingParams(max_tokens=200)) for t in env.dataset()[:3]]
    await env.rubric.score_group(trajs)
    for t in trajs:
        assert t.error is None and t.reward == 1.0 and t.metrics["template_breaks"] == 0 and len(t.sequences) == 1
        whole = render(tok, t.messages, env.tool_schemas(), gen=False)
        seq = t.sequences[0]
        # one sample, equal to the template's rendering of the whole conversation (minus the final glue "\n")
        assert seq.token_ids == whole[: len(seq.token_ids)] and len(whole) - len(seq.token_ids) == 1
        assert seq.num_sampled == sum(len(turn.completion_ids) for turn in t.turns)


@pytest.mark.slow
async def test_rollouts_against_the_embedded_engine(tiny):
    from agentrl.inference.client import PolicyClient
    from agentrl.inference.launcher import start_embedded_engine

    env = load_environment(CALC, num_train=20)
    with start_embedded_engine(tiny, device="cpu") as handle:
        client = PolicyClient(handle.base_url, handle.model)
        try:
            trajs = [await env.rollout(client, t, SamplingParams(max_tokens=16)) for t in env.dataset()[:4]]
            first_prompt = await client.tokenize(messages=messages_to_dicts(env.dataset()[0].prompt))
        finally:
            await client.close()
    await env.rubric.score_group(trajs)
    for t in trajs:
        assert t.error is None and t.stop_reason in {"done", "length", "max_turns"}
        seq = t.sequences[0]
        seq.validate()
        sampled = [(i, lp, v) for i, lp, v, m in zip(seq.token_ids, seq.logprobs, seq.versions, seq.loss_mask, strict=True) if m]
        assert [i for i, _, _ in sampled] == [i for turn in t.turns for i in turn.completion_ids]
        assert all(lp <= 0.0 and v >= 0 for _, lp, v in sampled)
        assert t.reward in (0.0, 1.0)
    assert trajs[0].sequences[0].token_ids[: len(first_prompt)] == first_prompt
    assert trajs[0].turns[0].prompt_len == len(first_prompt)
