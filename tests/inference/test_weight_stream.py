"""A weight push from a stream of buckets (what a sharded trainer's gather hands out): the manifest comes from the
specs, each transport writes every bucket into its place as it arrives and commits once, on a real engine.

Catches: bytes of a later bucket written at the wrong offset or dropped (greedy tokens differ from the pushed
model's), a stream that ends short or sends tensors out of order being committed (the engine would serve a mix)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from testkit import perturbed_state

from agentrl.auth import auth_headers
from agentrl.errors import WeightSyncError
from agentrl.inference import start_embedded_engine
from agentrl.weights import make_weight_sync
from agentrl.weights.sync import meta_like

KEY = "arl-weight-stream-test-key"
PROMPT = [1, 40, 41, 42]


def _greedy(model: torch.nn.Module, n: int = 6) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


async def _served(eng) -> tuple[list[int], int]:
    body = {"model": eng.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=60, headers=auth_headers(KEY)) as http:
        r = (await http.post(eng.base_url + "/completions", json=body)).json()
        version = (await http.get(eng.root_url + "/get_weight_version")).json()["weight_version"]
    return r["choices"][0]["token_ids"], version


async def _buckets(items: list[tuple[str, torch.Tensor]], per: int):
    for i in range(0, len(items), per):  # a few tensors at a time, as a gather hands them out
        await asyncio.sleep(0)
        yield dict(items[i : i + per])


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "disk", "http"])
def test_a_push_from_many_buckets_serves_exactly_the_pushed_weights(small_model, tmp_path, transport):
    engine = start_embedded_engine(small_model, max_batch_size=4, max_model_len=64, device="cpu",
                                   env={"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "AGENTRL_API_KEY": KEY})  # fmt: skip
    try:

        async def scenario() -> None:
            sync = make_weight_sync([engine.base_url], transport, local_urls=[], bucket_mb=0.0625, api_key=KEY)
            state, ref = perturbed_state(small_model, seed=1)
            items = list(state.items())
            specs = [(n, meta_like(t)) for n, t in items]
            before = await _served(engine)
            with pytest.raises(WeightSyncError, match="stopped after"):  # the gather failed part-way
                await sync.push_stream(specs, _buckets(items[:-1], 2), 1)
            with pytest.raises(WeightSyncError, match="arrived as"):
                await sync.push_stream(specs, _buckets(items[1:] + items[:1], 2), 1)
            assert await _served(engine) == before  # nothing was committed
            await sync.push_stream(specs, _buckets(items, 2), 2)
            if transport == "http":
                assert sync.last_stats["chunks"] > 1, "the model spans several chunks"
            assert await _served(engine) == (_greedy(ref), 2)
            await sync.close()

        asyncio.run(scenario())
    finally:
        engine.stop()


@pytest.mark.parametrize("lora", [0, 4])
def test_the_trainers_specs_are_what_it_hands_out_in_order(small_model, lora):
    # a streamed push's manifest is built from the specs before any data: names, dtypes and shapes must be exactly
    # those of the tensors the gather hands out (LoRA merged weights, and the adapters alone)
    from agentrl.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    trainer = Trainer(small_model, TrainerConfig(device="cpu", lora_rank=lora), None)
    cases = [(trainer.weight_specs(), trainer.named_tensors())]
    if lora:
        cases.append((trainer.weight_specs(adapters=True), trainer.adapter_tensors()))
    for specs, tensors in cases:
        assert all(t.is_meta for _, t in specs)
        assert [(n, t.dtype, t.shape) for n, t in specs] == [(n, t.dtype, t.shape) for n, t in tensors.items()]
