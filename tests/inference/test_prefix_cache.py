"""Prefix reuse in the embedded engine: fewer prefill tokens, same outputs, never stale K/V."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import torch

from agentrl.inference.client import PolicyClient
from agentrl.inference.engine import Engine
from agentrl.inference.kv_cache import SlotCache
from agentrl.inference.prefix_cache import PrefixCache
from agentrl.inference.sampling import EngineSampling
from agentrl.tiny_model import build_family_model
from agentrl.types import SamplingParams

BS = 16  # prefix_block_size


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    # peaked random weights: a stale or misplaced K/V changes the greedy tokens, not only 1e-6 of a logprob
    return build_family_model(tmp_path_factory.mktemp("prefix") / "llama", "llama")


def make_engine(path, **kw) -> Engine:
    return Engine(path, device="cpu", max_batch_size=16, max_model_len=256, prefix_block_size=BS, **kw)


def greedy(max_tokens: int = 12) -> EngineSampling:
    return EngineSampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def seeded(seed: int, max_tokens: int = 12) -> EngineSampling:
    return EngineSampling(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


def counters(engine: Engine) -> tuple[int, int]:
    return engine.prefill_tokens, engine.prefix_hit_tokens


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def conversation(engine: Engine, sampling, turns: int = 3, seed: int = 0) -> list:
    """A multi-turn episode: each turn's prompt is the last prompt + completion + a 'tool output'."""
    prompt, out = tokens(40, seed), []
    for t in range(turns):
        r = engine.submit(prompt, sampling).result(timeout=60)[0]
        out.append(r)
        prompt = prompt + r.token_ids + tokens(25, seed * 100 + t)
    return out


def assert_same(a, b) -> None:
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for x, y in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5


def test_a_second_turn_prefills_only_its_new_tokens(family_dir):
    engine = make_engine(family_dir)
    try:
        prompt = tokens(50, 1)
        first = engine.submit(prompt, greedy(20)).result(timeout=60)[0]
        assert counters(engine) == (50, 0)
        tool_output = tokens(30, 2)
        turn = prompt + first.token_ids + tool_output
        engine.submit(turn, greedy()).result(timeout=60)
        # K/V of the prompt and every completion token but the last (never fed) are kept, in whole blocks
        kept = (len(prompt) + len(first.token_ids) - 1) // BS * BS
        prefill, hit = counters(engine)
        assert hit == kept == 64
        assert prefill - 50 == len(turn) - kept  # the new tokens + the tail of the last partial block
        assert prefill - 50 < len(tool_output) + 1 + BS
    finally:
        engine.close()


def test_a_group_prefills_its_prompt_once(family_dir):
    engine = make_engine(family_dir)
    try:
        prompt, g = tokens(70, 3), 8
        futures = [engine.submit(prompt, seeded(i)) for i in range(g)]  # a group arrives at once
        results = [f.result(timeout=60)[0] for f in futures]
        prefill, hit = counters(engine)
        shared = len(prompt) // BS * BS
        assert hit == (g - 1) * shared
        assert prefill == len(prompt) + (g - 1) * (len(prompt) - shared)
        assert len({tuple(r.token_ids) for r in results}) > 1  # still G different episodes
    finally:
        engine.close()


@pytest.mark.parametrize("sampling", [greedy(), seeded(5)], ids=["greedy", "seeded"])
def test_outputs_are_identical_with_and_without_the_cache(family_dir, sampling):
    cached, plain = make_engine(family_dir), make_engine(family_dir, enable_prefix_caching=False)
    try:
        for seed in range(2):
            assert_same(conversation(cached, sampling, seed=seed), conversation(plain, sampling, seed=seed))
        group = tokens(45, 9)
        a = [f.result(timeout=60)[0] for f in [cached.submit(group, sampling, n=2), cached.submit(group, sampling)]]
        b = [f.result(timeout=60)[0] for f in [plain.submit(group, sampling, n=2), plain.submit(group, sampling)]]
        assert_same(a, b)
        assert cached.prefix_hit_tokens > 0 and plain.prefix_hit_tokens == 0
        assert cached.prefill_tokens < plain.prefill_tokens
    finally:
        cached.close()
        plain.close()


def test_eviction_under_a_small_cache_keeps_results_correct(family_dir):
    cached = make_engine(family_dir, prefix_cache_tokens=5 * BS)  # 5 blocks: every conversation evicts
    plain = make_engine(family_dir, enable_prefix_caching=False)
    try:
        for seed in range(4):
            assert_same(conversation(cached, greedy(), seed=seed), conversation(plain, greedy(), seed=seed))
        prefix = cached.prefix
        assert prefix.evicted_blocks > 0 and prefix.used_blocks <= 5
        assert cached.prefix_hit_tokens > 0
        ids = {b.id for b in prefix._lru.values()}
        assert all(parent in ids or parent == 0 for parent, _ in prefix._by_key)  # no chain with a hole
    finally:
        cached.close()
        plain.close()


def perturb(seed: int):
    def apply(model: torch.nn.Module) -> None:
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)

    return apply


@pytest.mark.parametrize("keep", [False, True], ids=["invalidated", "kept-on-request"])
@pytest.mark.slow
def test_a_weight_push_invalidates_the_cache(family_dir, keep):
    engine = make_engine(family_dir, keep_prefix_cache_on_weight_update=keep)
    fresh = make_engine(family_dir, enable_prefix_caching=False)
    try:
        prompt = tokens(80, 4)
        engine.submit(prompt, greedy()).result(timeout=60)
        engine.update_weights(perturb(1))
        fresh.update_weights(perturb(1))
        hit0 = engine.prefix_hit_tokens
        after = engine.submit(prompt, greedy()).result(timeout=60)[0]
        truth = fresh.submit(prompt, greedy()).result(timeout=60)[0]
        stale = max(abs(a - b) for a, b in zip(after.logprobs, truth.logprobs, strict=True))
        if keep:  # the user asked to keep K/V of the old weights: reused, and visibly not exact
            assert engine.prefix_hit_tokens > hit0 and stale > 1e-2
        else:
            assert engine.prefix_hit_tokens == hit0
            assert after.token_ids == truth.token_ids and stale < 1e-5
    finally:
        engine.close()
        fresh.close()


def test_a_sequence_running_across_a_push_is_not_cached(family_dir):
    engine = make_engine(family_dir)
    try:
        prompt = tokens(40, 6)
        fut = engine.submit(prompt, greedy(150))
        while engine.total_generated < 5:
            time.sleep(0.01)
        engine.update_weights(perturb(2))  # its K/V now mix two weight versions
        r = fut.result(timeout=60)[0]
        assert len(set(r.versions)) == 2
        hit0 = engine.prefix_hit_tokens
        engine.submit(prompt + r.token_ids + tokens(5, 7), greedy(2)).result(timeout=60)
        assert engine.prefix_hit_tokens == hit0
    finally:
        engine.close()


def test_metrics_and_reset_over_http(engine):
    with httpx.Client(base_url=engine.root_url, timeout=60, headers=engine.headers) as http:
        body = {"model": engine.model, "prompt": tokens(40, 8), "max_tokens": 2, "temperature": 0}
        http.post("/v1/completions", json=body).raise_for_status()
        before = http.get("/metrics").json()
        http.post("/v1/completions", json=body).raise_for_status()
        after = http.get("/metrics").json()
        assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 32
        assert after["prefill_tokens"] - before["prefill_tokens"] == 8
        assert after["prompt_tokens"] - before["prompt_tokens"] == 40
        assert http.post("/reset_prefix_cache").json() == {"success": True}
        assert http.get("/metrics").json()["prefix_cache_blocks"] == 0
        http.post("/v1/completions", json=body).raise_for_status()
        assert http.get("/metrics").json()["prefix_hit_tokens"] == after["prefix_hit_tokens"]


def test_the_least_recent_block_is_always_a_leaf():
    slots = SlotCache(1, 2, 1, 32, 2, torch.float32, torch.device("cpu"))
    slots.k.copy_(torch.randn(slots.k.shape))
    slots.v.copy_(torch.randn(slots.v.shape))
    cache = PrefixCache(slots, num_blocks=4, block_size=4)
    a, b = list(range(12)), list(range(100, 108))
    assert cache.store(a, 0, 12) == 3
    want = slots.k[:, 0, :, :8].clone()
    assert cache.store(b, 1, 8) == 2  # one block must go: a's last one, not its root
    assert len(cache.match(a)) == 2 and len(cache.match(b)) == 2 and cache.evicted_blocks == 1
    chain = cache.match(a + [7])
    cache.load(chain, 1)
    assert torch.equal(slots.k[:, 1, :, :8], want)
    assert cache.next_key(a, chain) == (chain[-1].id, tuple(a[8:12]))
    # a chain longer than the pool keeps what fits instead of evicting itself
    assert cache.store(list(range(200, 224)), 0, 24) <= 4 and len(cache.match(list(range(200, 224)))) >= 1


async def test_a_pinned_group_over_http_prefills_its_prompt_once(engine):
    # what the rollout does for a group: G concurrent calls with one prompt, pinned to one endpoint
    prompt, g = tokens(70, 12), 6
    async with PolicyClient(engine.base_url, engine.model) as client, httpx.AsyncClient(base_url=engine.root_url, headers=engine.headers) as http:
        before = (await http.get("/metrics")).json()
        pin = client.pin(g)
        try:
            calls = (pin.complete(prompt, SamplingParams(max_tokens=3, seed=i)) for i in range(g))
            assert len(await asyncio.gather(*calls)) == g
        finally:
            pin.release()
        after = (await http.get("/metrics")).json()
    shared = len(prompt) // BS * BS  # the server's default block size is 16 too
    assert after["prompt_tokens"] - before["prompt_tokens"] == g * len(prompt)
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) + (g - 1) * (len(prompt) - shared)
