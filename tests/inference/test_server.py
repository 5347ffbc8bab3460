"""The embedded engine driven over HTTP by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch


@pytest.fixture(scope="module")
def client(engine):
    with openai.OpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def aclient_factory(engine):
    return lambda: openai.AsyncOpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0)


def reference_logprobs(model, prompt_ids, gen_ids, temperature=1.0, top_k=-1, top_p=1.0) -> list[float]:
    """Teacher-forced logprobs of gen_ids on the documented basis: logits/T → top-k → top-p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + gen_ids])).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(gen_ids)]
    out = []
    for row, tok in zip(rows, gen_ids, strict=True):
        z = row / temperature
        if top_k > 0:
            z = torch.where(z < z.topk(top_k).values[-1], torch.tensor(float("-inf")), z)
        if top_p < 1.0:
            probs = torch.softmax(z, -1)
            order = probs.argsort(descending=True).tolist()
            keep, mass = [], 0.0
            for i in order:
                if mass >= top_p:
                    break
                keep.append(i)
                mass += probs[i].item()
            mask = torch.full_like(z, float("-inf"))
            mask[keep] = 0.0
            z = z + mask
        out.append(torch.log_softmax(z, -1)[tok].item())
    return out


def test_models_health_metrics(engine, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model]
    r = httpx.get(engine.root_url + "/health")
    assert r.status_code == 200
    m = httpx.get(engine.root_url + "/metrics", headers=engine.headers).json()
    assert {"queue_depth", "running", "tokens_per_s", "version"} <= m.keys()


def test_chat_with_tools_returns_parsed_tool_call(engine, client, tools, tool_prompt):
    r = client.chat.completions.create(
        model=engine.model, messages=tool_prompt, tools=tools, temperature=0, max_tokens=60,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12+30"}
    assert call.id and call.type == "function"
    # the terminating <|im_end|> was sampled, so it is in token_ids (with a logprob)
    assert choice.token_ids[-1] == 2
    # without tools the same text comes back as plain content
    r2 = client.chat.completions.create(model=engine.model, messages=tool_prompt, temperature=0, max_tokens=60)
    assert r2.choices[0].message.tool_calls is None
    assert "<tool_call>" in r2.choices[0].message.content


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 40},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 100, "top_p": 0.8},
    ],
)
async def test_logprobs_match_teacher_forced_forward(engine, aclient_factory, hf_model, tokenizer, params):
    """Concurrent, batched, n>1 requests: every sampled token's μ equals the reference."""
    async with aclient_factory() as ac:
        prompts = [[{"role": "user", "content": f"question {i}: what is {i}*7?"}] for i in range(3)]
        extra = {"return_token_ids": True, **{k: v for k, v in params.items() if k == "top_k"}}
        kw = {k: v for k, v in params.items() if k != "top_k"}
        resps = await asyncio.gather(
            *(
                ac.chat.completions.create(
                    model=engine.model, messages=p, max_tokens=24 + 8 * i, n=2, logprobs=True, seed=i,
                    extra_body=extra, **kw,
                )  # fmt: skip
                for i, p in enumerate(prompts)
            )
        )
    for p, r in zip(prompts, resps, strict=True):
        text = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        assert r.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
        for ch in r.choices:
            got = [c.logprob for c in ch.logprobs.content]
            assert len(got) == len(ch.token_ids) > 0
            ref = reference_logprobs(
                hf_model, r.prompt_token_ids, ch.token_ids, params["temperature"], params.get("top_k", -1),
                params.get("top_p", 1.0),
            )  # fmt: skip
            assert all(math.isfinite(x) for x in ref), "a token outside the top-k/top-p support was sampled"
            assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3
            assert ch.token_versions == [0] * len(ch.token_ids)


def test_greedy_reports_raw_logprobs(engine, client, hf_model):
    r = client.completions.create(
        model=engine.model, prompt=[1, 50, 60, 70], max_tokens=12, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    ch = r.choices[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([[1, 50, 60, 70] + ch.token_ids])).logits[0]
    assert ch.token_ids == logits[3:-1].argmax(-1).tolist()
    ref = reference_logprobs(hf_model, [1, 50, 60, 70], ch.token_ids)
    assert max(abs(a - b) for a, b in zip(ch.logprobs.token_logprobs, ref, strict=True)) < 1e-3


def test_token_list_prompts_round_trip(engine, client, tools, tool_prompt, max_model_len):
    tok = httpx.post(
        engine.root_url + "/tokenize", json={"messages": tool_prompt, "tools": tools, "add_generation_prompt": True}
    ).json()
    ids = tok["tokens"]
    assert tok["count"] == len(ids) and tok["max_model_len"] == max_model_len
    chat = client.chat.completions.create(
        model=engine.model, messages=tool_prompt, tools=tools, max_tokens=8, seed=3, extra_body={"return_token_ids": True}
    )
    assert chat.prompt_token_ids == ids
    comp = client.completions.create(
        model=engine.model, prompt=ids, max_tokens=8, seed=3, logprobs=0, extra_body={"return_token_ids": True}
    )
    ch = comp.choices[0]
    assert ch.prompt_token_ids == ids
    assert ch.token_ids == chat.choices[0].token_ids  # same seed, same tokens, whichever route
    detok = httpx.post(engine.root_url + "/detokenize", json={"tokens": ch.token_ids}).json()["prompt"]
    assert detok.replace("<|im_end|>", "") == ch.text
    # a prompt given as text tokenizes to the same ids
    text = httpx.post(engine.root_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    again = client.completions.create(
        model=engine.model, prompt=text, max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert again.choices[0].prompt_token_ids == ids


def test_seed_stop_and_length(engine, client, max_model_len):
    def run(**kw):
        return client.completions.create(
            model=engine.model, prompt=[1, 5, 9], logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True}, **kw
        ).choices

    a, b = run(max_tokens=20, seed=11)[0], run(max_tokens=20, seed=11)[0]
    assert a.token_ids == b.token_ids and a.finish_reason == "length" and len(a.token_ids) == 20
    c = run(max_tokens=20, seed=12)[0]
    assert c.token_ids != a.token_ids
    stop = a.text[5:8]
    s = run(max_tokens=20, seed=11, stop=[stop])[0]
    assert s.finish_reason == "stop" and stop not in s.text and a.text.startswith(s.text)
    # max_tokens beyond the context window is clamped to what fits
    long = run(max_tokens=10_000, seed=1, temperature=1.0)[0]
    assert long.finish_reason == "length" and len(long.token_ids) == max_model_len - 3


async def test_short_requests_do_not_wait_for_long_ones(engine, aclient_factory):
    async with aclient_factory() as ac:
        long = asyncio.create_task(
            ac.completions.create(model=engine.model, prompt=[1, 2], max_tokens=250, extra_body={"ignore_eos": True})
        )
        async with httpx.AsyncClient(headers=engine.headers) as http:
            while (await http.get(engine.root_url + "/metrics")).json()["running"] == 0:
                await asyncio.sleep(0.01)
        shorts = await asyncio.gather(
            *(ac.completions.create(model=engine.model, prompt=[1, 3 + i], max_tokens=4, extra_body={"ignore_eos": True})
              for i in range(4))
        )  # fmt: skip
        assert not long.done(), "short requests should finish while the long one is still decoding"
        assert all(len(r.choices[0].text) >= 0 and r.choices[0].finish_reason == "length" for r in shorts)
        assert (await long).usage.completion_tokens == 250


@pytest.mark.parametrize(
    "kwargs, status, code",
    [
        ({"model": "no-such-model"}, 404, "model_not_found"),
        ({"max_tokens": -1}, 400, None),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"messages": [{"content": "no role"}]}, 400, None),
        ({"messages": []}, 400, None),
        ({"messages": [{"role": "user", "content": "x " * 400}]}, 400, "context_length_exceeded"),
        ({"n": 1000}, 400, None),
        ({"temperature": -1}, 400, None),
    ],
)
def test_bad_chat_requests_get_openai_errors(engine, client, kwargs, status, code):
    req = {"model": engine.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**req)
    assert info.value.status_code == status
    assert info.value.body["message"]
    if code:
        assert info.value.body["code"] == code
    assert httpx.get(engine.root_url + "/health").status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": None, "prompt": [1, 10**9], "max_tokens": 2}),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}),
        ("/v1/completions", {"prompt": list(range(3, 500)), "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", "{not json"),
        ("/v1/completions", "[" * 100_000),  # nested past json's recursion limit
        ("/tokenize", {}),
        ("/detokenize", {"tokens": [-5]}),
        ("/update_weights_from_disk", {"model_path": "/no/such/weights"}),
        ("/pause?mode=abort", None),
    ],
)
def test_bad_raw_requests_are_4xx(engine, path, body):
    if isinstance(body, dict) and "model" in body and body["model"] is None:
        body = {**body, "model": engine.model}
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    kw.setdefault("headers", {}).update(engine.headers)  # past the key: the route's own check answers
    r = httpx.post(engine.root_url + path, **kw)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]
    assert httpx.get(engine.root_url + "/health").status_code == 200
    assert httpx.get(engine.root_url + "/get_weight_version", headers=engine.headers).json()["weight_version"] == 0


async def test_client_disconnect_aborts_the_request_in_the_engine(engine):
    """A client that goes away (timeout, cancelled episode) must not keep engine slots busy."""
    async with httpx.AsyncClient(base_url=engine.root_url, timeout=30, headers=engine.headers) as http:

        async def stats() -> dict:
            return (await http.get("/metrics")).json()

        before = await stats()
        await http.post("/pause")  # hold the request in the queue so it cannot finish first
        try:
            body = {"model": engine.model, "prompt": [1, 2], "max_tokens": 200, "ignore_eos": True}
            doomed = asyncio.create_task(httpx.AsyncClient(base_url=engine.base_url, timeout=30).post("/completions", json=body))
            while (await stats())["queue_depth"] == 0:
                await asyncio.sleep(0.01)
            doomed.cancel()  # closes the connection mid-request
            await asyncio.gather(doomed, return_exceptions=True)
            for _ in range(500):  # the server notices the disconnect and cancels the queued request
                if (await stats())["queue_depth"] == 0:
                    break
                await asyncio.sleep(0.01)
        finally:
            await http.post("/resume")
        for _ in range(500):  # the engine drops the cancelled request at its next step
            s = await stats()
            if s["requests_aborted"] > before["requests_aborted"] and not s["queue_depth"] and not s["running"]:
                break
            await asyncio.sleep(0.01)
        assert s["requests_aborted"] == before["requests_aborted"] + 1
        assert s["total_generated_tokens"] == before["total_generated_tokens"], "an aborted request generated tokens"
        # and the server still serves
        r = await http.post("/v1/completions", json={**body, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
