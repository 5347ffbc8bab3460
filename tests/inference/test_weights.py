"""Live weight updates: pause → load → version+1 → resume, with requests in flight."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from testkit import SERVER_PROCESS, perturbed_state

from agentrl.auth import auth_headers
from agentrl.inference import start_embedded_engine
from agentrl.weights import WeightSync, WeightSyncError, make_weight_sync

KEY = "arl-weights-test-key"  # the engine's key: every push is signed with it


@pytest.fixture(scope="module")
def wengine(model_dir):
    """An engine of its own: these tests change its weights."""
    with start_embedded_engine(model_dir, max_batch_size=8, max_model_len=256, device="cpu",
                               env={"AGENTRL_API_KEY": KEY}, server_process=SERVER_PROCESS) as eng:
        yield eng


def control() -> httpx.AsyncClient:
    """A client of the engine's control routes (they need its key)."""
    return httpx.AsyncClient(headers=auth_headers(KEY))


async def greedy(ac, eng, prompt, n_tokens):
    r = await ac.completions.create(
        model=eng.model, prompt=prompt, max_tokens=n_tokens, temperature=0, logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    return r.choices[0]


async def wait_for_tokens(eng, at_least: int, running: int = 0) -> None:
    """Until ``at_least`` tokens were generated in all, with at least ``running`` requests decoding
    (a request that reached the engine late must not be still queued when the test pauses it)."""
    async with control() as http:
        while True:
            m = (await http.get(eng.root_url + "/metrics")).json()
            if m["total_generated_tokens"] >= at_least and m["running"] >= running:
                return
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("transport", ["shm", "disk"])
async def test_update_during_inflight_requests(wengine, model_dir, transport):
    sync = make_weight_sync(wengine.base_url, transport, api_key=KEY)
    assert isinstance(sync, WeightSync)
    async with openai.AsyncOpenAI(base_url=wengine.base_url, api_key=KEY, max_retries=0) as ac, control() as http:
        v0 = (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"]
        prompt = [1, 40, 41, 42]
        before = await greedy(ac, wengine, prompt, 16)
        start = (await http.get(wengine.root_url + "/metrics")).json()["total_generated_tokens"]
        inflight = [asyncio.create_task(greedy(ac, wengine, [1, 30 + i], 200)) for i in range(3)]
        await wait_for_tokens(wengine, start + 30, running=3)
        await http.post(wengine.root_url + "/pause")  # freeze them mid-flight; push() resumes
        assert (await http.get(wengine.root_url + "/metrics")).json()["running"] == 3
        state, new_model = perturbed_state(model_dir, seed=7 + v0)
        seconds = await sync.push(state, version=v0 + 1)
        assert seconds > 0
        results = await asyncio.gather(*inflight)
        after = await greedy(ac, wengine, prompt, 16)
        assert (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"] == v0 + 1
        assert not (await http.get(wengine.root_url + "/is_paused")).json()["is_paused"]
    await sync.close()

    for r in results:
        vs = r.token_versions
        assert len(vs) == 200 and vs == sorted(vs), "versions never go backwards"
        assert vs[0] == v0 and vs[-1] == v0 + 1, "a request in flight spans both versions"
    assert before.token_versions == [v0] * 16 and after.token_versions == [v0 + 1] * 16
    assert after.token_ids != before.token_ids, "new weights change the output"
    # tokens generated entirely after the push come from exactly the pushed weights
    with torch.no_grad():
        logits = new_model(torch.tensor([prompt + after.token_ids])).logits[0]
    assert after.token_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    ref_lp = ref.gather(1, torch.tensor(after.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(after.logprobs.token_logprobs), ref_lp, atol=1e-3)


async def test_bad_push_is_refused_and_engine_keeps_serving(wengine):
    sync = make_weight_sync(wengine.root_url, "shm", api_key=KEY)
    async with control() as http:
        v = (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"]
        with pytest.raises(WeightSyncError, match="unknown weight name"):
            await sync.push({"not.a.weight": torch.zeros(3)}, version=v + 1)
        with pytest.raises(WeightSyncError, match="shape mismatch"):
            await sync.push({"model.norm.weight": torch.zeros(3)}, version=v + 1)
        assert (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"] == v
        assert not (await http.get(wengine.root_url + "/is_paused")).json()["is_paused"]
    await sync.close()
    async with openai.AsyncOpenAI(base_url=wengine.base_url, api_key=KEY, max_retries=0) as ac:
        assert len((await greedy(ac, wengine, [1, 2, 3], 5)).token_ids) == 5


async def test_pause_holds_generation_until_resume(wengine):
    async with control() as http, openai.AsyncOpenAI(base_url=wengine.base_url, api_key=KEY) as ac:
        assert (await http.post(wengine.root_url + "/pause")).json() == {"is_paused": True}
        assert (await http.get(wengine.root_url + "/is_paused")).json()["is_paused"]
        before = (await http.get(wengine.root_url + "/metrics")).json()["total_generated_tokens"]
        task = asyncio.create_task(greedy(ac, wengine, [1, 7], 5))
        while (await http.get(wengine.root_url + "/metrics")).json()["queue_depth"] == 0:
            await asyncio.sleep(0.01)
        for _ in range(5):  # several polls while paused: nothing is generated
            m = (await http.get(wengine.root_url + "/metrics")).json()
            assert m["total_generated_tokens"] == before and m["queue_depth"] == 1 and not task.done()
            await asyncio.sleep(0.02)
        await http.post(wengine.root_url + "/resume")
        assert len((await task).token_ids) == 5


@pytest.mark.parametrize("transport", ["shm", "disk"])
async def test_adapter_only_push_is_merged_by_the_engine(wengine, model_dir, transport):
    """lora=True sends only LoRA factors; the engine serves exactly W0 + B·A, push after push."""
    sync = make_weight_sync(wengine.base_url, transport, api_key=KEY)
    async with control() as http, openai.AsyncOpenAI(base_url=wengine.base_url, api_key=KEY) as ac:
        v = (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"]
        base_state, ref = perturbed_state(model_dir, seed=100)
        await sync.push(base_state, version=v + 1)  # a known base W0 (a full push resets adapters)
        modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
        prompt = [1, 40, 41, 42]
        for k, seed in enumerate((1, 2)):  # the second push replaces the first, never adds to it
            g = torch.Generator().manual_seed(seed)
            factors, merged = {}, dict(base_state)
            for m in modules:
                out_f, in_f = base_state[m + ".weight"].shape
                a, b = torch.randn(4, in_f, generator=g), torch.randn(out_f, 4, generator=g)
                factors[m + ".lora_A"], factors[m + ".lora_B"] = a, b
                merged[m + ".weight"] = base_state[m + ".weight"] + b @ a
            await sync.push(factors, version=v + 2 + k, lora=True)
            assert sync.last_stats["bytes"] < 0.1 * sum(t.numel() * 4 for t in base_state.values())
            ref.load_state_dict(merged)
            out = await greedy(ac, wengine, prompt, 12)
            assert out.token_versions == [v + 2 + k] * 12
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + out.token_ids])).logits[0]
            assert out.token_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        bad = {modules[0] + ".lora_A": torch.zeros(4, 3), modules[0] + ".lora_B": torch.zeros(3, 4)}
        with pytest.raises(WeightSyncError, match="do not fit"):
            await sync.push(bad, version=v + 9, lora=True)
        assert (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"] == v + 3
    await sync.close()


async def test_a_push_that_fails_on_one_engine_leaves_no_engine_paused(wengine):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    sync = make_weight_sync([wengine.root_url, dead], "shm", api_key=KEY)
    async with control() as http:
        v = (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"]
        with pytest.raises(WeightSyncError, match="weights/begin"):
            await sync.push({"model.norm.weight": torch.ones(64)}, version=v + 1)
        assert not (await http.get(wengine.root_url + "/is_paused")).json()["is_paused"]
        assert (await http.get(wengine.root_url + "/get_weight_version")).json()["weight_version"] == v
    await sync.close()
