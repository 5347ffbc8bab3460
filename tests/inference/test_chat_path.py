"""The chat path against OpenAI-like servers that are not vLLM: one that refuses unknown
fields with HTTP 400 as the OpenAI API does, one that returns logprobs without token ids,
one that wants ``max_completion_tokens``.  ``agentrl eval --chat`` must work on all of them and
record the servers' ``usage``; training must say which capabilities it misses."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from testkit import serve_app
from threaded_app import ThreadedApp

from agentrl.errors import EndpointError, EndpointProbeError
from agentrl.inference import PolicyClient
from agentrl.plugins import load_environment
from agentrl.recipes.eval import evaluate, read_results
from agentrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
OPENAI_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
    "logprobs", "top_logprobs", "tools", "tool_choice", "stream", "stream_options", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "response_format", "parallel_tool_calls",
}  # fmt: skip


def reply(body: dict, *, with_logprobs: bool, prompt_ids: bool = False) -> dict:
    """A calculator-using assistant: a tool call for a question, the tool's result as the answer."""
    msgs = body["messages"]
    last = msgs[-1]
    if last["role"] == "user" and body.get("tools"):
        expr = re.search(r"What is (.+)\?", last["content"]).group(1)
        call = {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": json.dumps({"expression": expr})}}
        message, finish, n_tokens = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", 17
    elif last["role"] == "tool":
        message, finish, n_tokens = {"role": "assistant", "content": f"The answer is {last['content']}."}, "stop", 6
    else:
        message, finish, n_tokens = {"role": "assistant", "content": "Hello"}, "length", 1
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if with_logprobs and body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}] * n_tokens}
    prompt_tokens = 11 * len(msgs)
    out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice],
           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                     "total_tokens": prompt_tokens + n_tokens}}  # fmt: skip
    if prompt_ids:
        out["prompt_token_ids"] = list(range(prompt_tokens))
    return out


class FakeServer:
    """An OpenAI-like server in its own thread (usable by in-process clients and CLI children).

    ``kind``: ``strict`` refuses fields the OpenAI API does not know (HTTP 400, OpenAI's
    message); ``no_ids`` accepts anything and returns logprobs but never token ids;
    ``new_openai`` is strict and also refuses ``max_tokens`` as newer OpenAI models do.
    """

    def __init__(self, kind: str):
        self.kind, self.requests, self.refusals = kind, [], 0

    def _app(self) -> web.Application:
        app = web.Application()

        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests.append(body)
            if self.kind in ("strict", "new_openai"):
                unknown = sorted(set(body) - OPENAI_FIELDS)
                if unknown:
                    self.refusals += 1
                    s = "s" if len(unknown) > 1 else ""
                    return web.json_response({"error": {"message": f"Unrecognized request argument{s} supplied: "
                                              f"{', '.join(unknown)}", "type": "invalid_request_error", "param": None,
                                              "code": None}}, status=400)  # fmt: skip
            if self.kind == "new_openai" and "max_tokens" in body:
                self.refusals += 1
                return web.json_response({"error": {"message": "Unsupported parameter: 'max_tokens' is not supported "
                                          "with this model. Use 'max_completion_tokens' instead.",
                                          "type": "invalid_request_error", "param": "max_tokens",
                                          "code": "unsupported_parameter"}}, status=400)  # fmt: skip
            return web.json_response(reply(body, with_logprobs=True))

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "gpt-fake", "object": "model"}]})

        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        return app

    def __enter__(self) -> FakeServer:
        self._server = ThreadedApp(self._app()).__enter__()
        self.url = self._server.url
        return self

    def __exit__(self, *exc) -> None:
        self._server.__exit__(*exc)


def calc_env():
    return load_environment(str(ROOT / "environments/calc"), num_train=20, show_tools=True)


@pytest.mark.parametrize("kind", ["strict", "no_ids", "new_openai"])
async def test_eval_works_on_openai_like_servers_and_records_usage(kind, tmp_path):
    with FakeServer(kind) as srv:
        async with PolicyClient(srv.url, "gpt-fake") as pc:
            await pc.probe(token_path=False)
            summary = await evaluate(calc_env(), pc, model="gpt-fake", out_dir=tmp_path, num_tasks=3, rollouts=2,
                                     token_exact=False)
            caps = pc.endpoints[0].chat_caps
    assert summary.error_rate == 0.0 and summary.mean_reward == 1.0 and summary.mean_turns == 2.0
    recs = list(read_results(tmp_path).values())
    assert len(recs) == 6
    for r in recs:  # the server's usage: 11 tokens a message; turn 1 sees 1 message, turn 2 sees 3
        assert r["prompt_tokens"] == 11 and r["completion_tokens"] == 17 + 6 and r["num_tool_calls"] == 1
        assert r["usage"] == {"prompt_tokens": 11 + 33, "completion_tokens": 23}
    assert caps.token_ids is False and caps.logprobs is True
    episode_requests = srv.requests[-12:]  # 6 episodes × 2 turns, after the probe
    assert all("logprobs" not in b for b in episode_requests)  # no token ids: logprobs are not asked for again
    if kind == "no_ids":
        assert srv.refusals == 0 and all(b["top_k"] == -1 and b["return_token_ids"] for b in episode_requests)
    else:
        assert all(set(b) <= OPENAI_FIELDS for b in episode_requests)
        assert srv.refusals == (1 if kind == "strict" else 2)  # learned once, in the probe
        assert caps.rejected == {"top_k", "min_p", "return_token_ids", "skip_special_tokens"}
    if kind == "new_openai":
        assert all("max_completion_tokens" in b and "max_tokens" not in b for b in episode_requests)
        assert "uses max_completion_tokens" in pc.capabilities()[0]


async def test_without_a_probe_the_first_call_learns_what_the_server_accepts():
    with FakeServer("strict") as srv:
        async with PolicyClient(srv.url, "gpt-fake") as pc:
            outs = await asyncio.gather(*(pc.chat([{"role": "user", "content": "Hi"}], SamplingParams()) for _ in range(8)))
    assert all(c.text == "Hello" and c.token_ids == [] and c.logprobs == [] for (c,) in outs)
    assert all(c.prompt_tokens == 11 and c.completion_tokens == 1 for (c,) in outs)
    assert srv.refusals == 1  # one probe for all eight concurrent first calls


async def test_a_sampling_setting_the_server_refuses_is_an_error_not_a_silent_change():
    with FakeServer("strict") as srv:
        async with PolicyClient(srv.url, "gpt-fake", max_retries=0) as pc:
            with pytest.raises(EndpointError, match="does not accept 'top_k'.*top_k=20"):
                await pc.chat([{"role": "user", "content": "Hi"}], SamplingParams(top_k=20))


async def test_token_ids_and_logprobs_come_back_together_or_not_at_all():
    from agentrl.inference.chat import ChatCaps, read_reply

    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    no_ids = read_reply(reply(body, with_logprobs=True), 1, ChatCaps(), 0)[0]
    assert no_ids.token_ids == [] and no_ids.logprobs == [] and no_ids.completion_tokens == 1
    vllm_like = reply(body, with_logprobs=True, prompt_ids=True)
    vllm_like["choices"][0]["token_ids"] = [7]
    (c,) = read_reply(vllm_like, 1, ChatCaps(), 3)
    assert c.token_ids == [7] and c.logprobs == [-0.25] and c.versions == [3] and c.prompt_token_ids == list(range(11))


async def test_training_says_which_capabilities_the_endpoint_lacks():
    class Tok:  # a local tokenizer: prompts are rendered here, the probe needs no /tokenize
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            return [5, 6]

    with FakeServer("strict") as srv:
        async with PolicyClient(srv.url, "gpt-fake", tokenizer=Tok()) as pc:
            with pytest.raises(EndpointProbeError, match="training samples token-id prompts on /v1/completions.*HTTP 404"):
                await pc.probe(token_path=True, training=True)

    app = web.Application()

    async def completions(request):
        return web.json_response({"choices": [{"index": 0, "text": "a", "finish_reason": "length",
                                               "logprobs": {"token_logprobs": [-1.0]}}]})

    async def models(_):
        return web.json_response({"data": [{"id": "m"}]})

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner, port = await serve_app(app)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        async with PolicyClient(url, "m", tokenizer=Tok()) as pc:
            with pytest.raises(EndpointProbeError, match="training needs the sampled token ids"):
                await pc.probe(token_path=True, training=True)
    finally:
        await runner.cleanup()


def test_agentrl_eval_chat_against_a_strict_server(tmp_path):
    """The exact command of README "Evaluate a hosted model"."""
    out = tmp_path / "out"
    with FakeServer("strict") as srv:
        r = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "eval", "calc", "--model", "gpt-fake", "--base-url", srv.url,
             "--api-key", "sk-test", "--chat", "-n", "3", "-r", "2", "--out", str(out),
             "--env-args", '{"show_tools": true}'],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vLLM extensions: none accepted; token ids: no; logprobs: yes" in r.stderr
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(x["error"] is None and x["reward"] == 1.0 for x in recs)
    assert all(x["usage"] == {"prompt_tokens": 44, "completion_tokens": 23} for x in recs)
