"""The engine benchmarks' one client round (benchmarks/completions_round.py) against a real engine."""

from __future__ import annotations

import asyncio

import pytest
from benchmark_module import load_benchmark

from agentrl.errors import AgentrlError
from agentrl.inference import start_embedded_engine
from agentrl.tiny_model import build_tiny_model

KEY = "arl-test-key-bench-rounds-0123"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real engine on a small untrained model (the rounds need tokens, not sense)."""
    model = build_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", layers=1, hidden=32, heads=2)
    with start_embedded_engine(model, max_batch_size=4, max_model_len=64, device="cpu", api_key=KEY) as eng:
        yield eng


def test_both_engine_benchmarks_send_their_rounds_through_one_function():
    """engine_http_cost.http_round was a copy of engine_vs_vllm.one_round but for two body fields."""
    http_cost, vs_vllm = load_benchmark("engine_http_cost"), load_benchmark("engine_vs_vllm")
    assert http_cost.completions_round is vs_vllm.completions_round
    assert http_cost.workload is vs_vllm.workload


def test_a_round_counts_every_token_and_refuses_a_short_or_refused_request(engine):
    rounds = load_benchmark("completions_round")
    run_body = load_benchmark("engine_http_cost").RUN_BODY  # what a run asks for besides the tokens
    prompts = rounds.workload(200, 4, 6, seed=0)
    seconds, tokens = asyncio.run(rounds.completions_round(engine.root_url, engine.model, KEY,
                                                           prompts, 5, run_body))  # fmt: skip
    assert tokens == 4 * 5 and seconds > 0
    with pytest.raises(AgentrlError, match="made 2 tokens, not 5"):  # the extra body wins: a short completion
        asyncio.run(rounds.completions_round(engine.root_url, engine.model, KEY, prompts, 5,
                                             {"max_tokens": 2}))  # fmt: skip
    with pytest.raises(AgentrlError, match="answered 401"):
        asyncio.run(rounds.completions_round(engine.root_url, engine.model, "wrong", prompts, 5))
