"""Every embedded-engine setting can be set from ``[inference]`` and reaches the running engine
(issue 23: 6 of the 9 engine settings, dtype and the prefix cache among them, could not)."""

from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest

from agentrl.config import InferenceConfig, load_config
from agentrl.inference import EngineArgs
from agentrl.recipes.engines import open_engines


def test_the_inference_section_has_every_engine_setting_with_its_default():
    assert {f.name for f in fields(EngineArgs)} <= set(InferenceConfig.model_fields)
    assert InferenceConfig().engine_args() == EngineArgs()


@pytest.mark.slow
async def test_inference_settings_reach_the_engine(tiny_model):
    cfg = load_config([], ["--inference.dtype=bfloat16", "--inference.max_batch_size=4",
                           "--inference.prefix_cache_tokens=512", "--inference.prefix_block_size=8",
                           "--inference.num_speculative_tokens=3", "--inference.device=cpu"])
    engines = await asyncio.to_thread(open_engines, cfg, tiny_model, 1)
    try:
        stats = await engines.client.endpoints[0].get("/metrics")
    finally:
        await engines.close()
    assert stats["dtype"] == "bfloat16" and stats["max_batch_size"] == 4
    assert stats["prefix_cache_capacity_blocks"] == 512 // 8
    assert stats["ragged_batches"] is True and stats["num_speculative_tokens"] == 3

    off = load_config([], ["--inference.enable_prefix_caching=false", "--inference.ragged_batches=false",
                           "--inference.device=cpu"])
    engines = await asyncio.to_thread(open_engines, off, tiny_model, 1)
    try:
        stats = await engines.client.endpoints[0].get("/metrics")
    finally:
        await engines.close()
    assert stats["prefix_cache_capacity_blocks"] == 0 and stats["dtype"] == "float32"
    assert stats["ragged_batches"] is False and stats["num_speculative_tokens"] == 0
