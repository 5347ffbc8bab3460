"""PolicyClient against the real engine: token-exact completions, errors, failover."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from agentrl.inference import (
    Completion,
    ContextLengthExceeded,
    EndpointError,
    EngineStartError,
    PolicyClient,
    start_embedded_engine,
)
from agentrl.types import Message, SamplingParams


def dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    return f"http://127.0.0.1:{port}/v1"


async def test_complete_chat_tokenize_detokenize(engine, tool_prompt, tools):
    async with PolicyClient(engine.base_url, engine.model) as pc:
        ids = await pc.tokenize(messages=tool_prompt, tools=tools)
        assert ids == await pc.tokenize(messages=[Message.from_dict(m) for m in tool_prompt], tools=tools)
        outs = await pc.complete(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=4), n=3)
        assert len(outs) == 3 and all(isinstance(c, Completion) for c in outs)
        for c in outs:
            assert c.prompt_token_ids == ids
            assert 0 < len(c.token_ids) == len(c.logprobs) == len(c.versions) <= 12
            assert all(lp <= 0 for lp in c.logprobs) and c.versions == [0] * len(c.token_ids)
            assert (await pc.detokenize(c.token_ids)).replace("<|im_end|>", "") == c.text

        (call,) = await pc.chat(tool_prompt, SamplingParams(max_tokens=60, temperature=0), tools=tools)
        assert call.finish_reason == "tool_calls" and call.prompt_token_ids == ids
        assert [tc.name for tc in call.tool_calls] == ["calculator"]
        assert call.token_ids[-1] == 2 and len(call.logprobs) == len(call.token_ids)
        # the chat route and the token route agree token for token (greedy)
        (same,) = await pc.complete(ids, SamplingParams(max_tokens=60, temperature=0))
        assert same.token_ids == call.token_ids

        digits = await pc.tokenize(prompt="12+30")
        assert len(digits) == 5 and await pc.detokenize(digits) == "12+30"


async def test_context_length_and_bad_requests(engine, max_model_len):
    async with PolicyClient(engine.base_url, engine.model, max_retries=1) as pc:
        with pytest.raises(ContextLengthExceeded):
            await pc.complete(list(range(3, 3 + max_model_len)), SamplingParams())
        with pytest.raises(ContextLengthExceeded):
            await pc.chat([Message("user", "x " * max_model_len)], SamplingParams())
    async with PolicyClient(engine.base_url, "wrong-model", max_retries=1) as pc:
        with pytest.raises(EndpointError) as info:
            await pc.complete([1, 2], SamplingParams())
        assert not isinstance(info.value, ContextLengthExceeded)


async def test_dead_endpoint_fails_over_and_all_dead_raises(engine):
    async with PolicyClient([dead_url(), engine.base_url], engine.model, max_retries=2) as pc:
        for _ in range(4):  # round robin hits the dead one; each call still succeeds
            (c,) = await pc.complete([1, 2, 3], SamplingParams(max_tokens=3))
            # 3 tokens, or fewer ending in a sampled end of sequence (the random model's p ~ 1/500 a token)
            assert len(c.token_ids) == 3 or (c.finish_reason == "stop" and 1 <= len(c.token_ids) < 3), c
    async with PolicyClient([dead_url()], engine.model, max_retries=1, timeout=5) as pc:
        with pytest.raises(EndpointError, match="failed after 2 attempts"):
            await pc.complete([1, 2, 3], SamplingParams(max_tokens=3))


@pytest.mark.slow
def test_launcher_reports_bad_model_dir(tmp_path):
    with pytest.raises(EngineStartError, match="no model"):
        start_embedded_engine(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineStartError, match="cannot load .* as a causal LM: OSError: .*not a valid JSON") as e:
        start_embedded_engine(tmp_path, startup_timeout=120)
    assert "\n" not in str(e.value)  # the engine's one-line reason, not a traceback


@pytest.mark.slow
def test_launcher_stop_ends_the_child(model_dir):
    eng = start_embedded_engine(model_dir, max_batch_size=2, max_model_len=64, device="cpu")
    assert eng.alive and eng.port > 0 and eng.base_url.endswith("/v1")
    eng.stop()
    assert not eng.alive
    eng.stop()  # idempotent


def test_an_interrupted_start_leaves_no_child_and_no_temp_dir(model_dir, monkeypatch):
    from agentrl.inference import launcher

    seen = {}

    def interrupted(proc, host, port, log_path, **kw):
        seen["proc"], seen["dir"] = proc, log_path.parent
        raise KeyboardInterrupt  # Ctrl-C while the engine loads

    monkeypatch.setattr(launcher, "wait_for_health", interrupted)
    with pytest.raises(KeyboardInterrupt):
        start_embedded_engine(model_dir, max_batch_size=2, max_model_len=64, device="cpu")
    assert seen["proc"].returncode is not None  # killed and reaped, not a zombie
    assert not seen["dir"].exists()


async def test_local_tokenizer_renders_exactly_what_the_server_renders(engine, model_dir, tool_prompt, tools):
    convo = [
        {"role": "system", "content": "Be brief."},
        *tool_prompt,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12+30"}'}}
        ]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "42"},
        {"role": "developer", "content": None},
    ]  # fmt: skip
    async with PolicyClient(engine.base_url, engine.model) as remote, PolicyClient(
        engine.base_url, engine.model, tokenizer=str(model_dir)
    ) as local:
        for _ in range(2):  # the second pass comes from the local render cache
            for k in range(1, len(convo) + 1):
                for gen in (True, False):
                    for tl in (None, tools):
                        want = await remote.tokenize(messages=convo[:k], tools=tl, add_generation_prompt=gen)
                        assert await local.tokenize(messages=convo[:k], tools=tl, add_generation_prompt=gen) == want
        assert local._renders.hits == local._renders.misses == 4 * len(convo)
        assert await local.tokenize(prompt="12+30 <tool_call>") == await remote.tokenize(prompt="12+30 <tool_call>")


async def test_a_huge_conversation_renders_off_the_event_loop(tiny_model):
    """A multi-MB message (an agent program's tool output) rendered on the run's event loop, which every
    episode shares: ~1 s per MB with nothing else served meanwhile, twice per gateway call.  It renders
    on a thread now, to the same ids; the loop keeps ticking (its longest gap far below the render's time)."""
    from transformers import AutoTokenizer

    from agentrl.render import render_chat_ids

    big = [{"role": "user", "content": "x y z " * 300_000}]  # 1.8 MB
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with PolicyClient("http://127.0.0.1:9/v1", "m", tokenizer=str(tiny_model)) as pc:
        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        ids = await pc.tokenize(messages=big)
        took = time.perf_counter() - t0
        await asyncio.sleep(0.05)  # the ticker wakes and records the gap the render left, if any
        tick.cancel()
    assert ids == render_chat_ids(AutoTokenizer.from_pretrained(tiny_model), big, None, True)
    assert max(gaps) < took / 3, (max(gaps), took)
