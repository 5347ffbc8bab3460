"""Any local HF causal-LM directory: safetensors (sharded too), its dtype, its generation config's EOS set."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from agentrl.errors import EngineStartError
from agentrl.inference import start_embedded_engine
from agentrl.inference.engine import Engine
from agentrl.inference.sampling import EngineSampling
from agentrl.tiny_model import IM_END, build_family_model, build_tiny_model

PROMPT = [5, 77, 300, 41, 9, 120]


def make_engine(path, **kw) -> Engine:
    return Engine(path, device="cpu", max_batch_size=4, max_model_len=64, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_checkpoints_dtype_is_served_unless_engine_args_say_otherwise(tmp_path, dtype):
    path = build_family_model(tmp_path / "m", "qwen2", dtype=dtype)
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    engine = make_engine(path)
    try:
        assert engine.dtype == getattr(torch, dtype) and engine._cache.k.dtype == engine.dtype
        r = engine.submit(PROMPT, EngineSampling(max_tokens=4, temperature=0, ignore_eos=True)).result(timeout=60)[0]
        assert len(r.token_ids) == 4
    finally:
        engine.close()
    engine = make_engine(path, dtype="float32")
    assert engine.dtype == torch.float32 and engine.self_check_delta < 1e-4
    engine.close()


def test_a_sharded_safetensors_checkpoint_loads(tmp_path):
    path = build_family_model(tmp_path / "m", "mistral")
    model = AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "sharded" / f).write_bytes((path / f).read_bytes())
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    a, b = make_engine(path), make_engine(tmp_path / "sharded")
    try:
        sp = EngineSampling(max_tokens=6, temperature=0, ignore_eos=True)
        assert a.submit(PROMPT, sp).result(timeout=60)[0].token_ids == b.submit(PROMPT, sp).result(timeout=60)[0].token_ids
    finally:
        a.close()
        b.close()


def test_an_unknown_dtype_is_refused_in_one_line(tmp_path):
    path = build_family_model(tmp_path / "m", "llama")
    with pytest.raises(EngineStartError, match=r"^dtype must be auto, float32, bfloat16, float16; got 'int8'$"):
        make_engine(path, dtype="int8")


def test_every_eos_of_the_generation_config_ends_a_sequence(tmp_path):
    path = build_family_model(tmp_path / "m", "llama")
    engine = make_engine(path)
    greedy = EngineSampling(max_tokens=8, temperature=0)
    try:
        free = engine.submit(PROMPT, EngineSampling(max_tokens=8, temperature=0, ignore_eos=True)).result(timeout=60)[0]
    finally:
        engine.close()
    im_end = engine.tokenizer.convert_tokens_to_ids(IM_END)
    assert im_end not in free.token_ids[:3]
    extra = free.token_ids[2]  # a token this model emits third: make it an eos of the model
    GenerationConfig(eos_token_id=[im_end, extra]).save_pretrained(path)
    engine = make_engine(path)
    try:
        assert {im_end, extra} <= engine.eos_ids
        r = engine.submit(PROMPT, greedy).result(timeout=60)[0]
        stop = free.token_ids.index(extra)
        assert r.token_ids == free.token_ids[: stop + 1] and r.finish_reason == "stop"
    finally:
        engine.close()


@pytest.mark.slow
def test_the_launcher_reports_a_refusal_in_one_line(tmp_path):
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 64}  # fmt: skip
    path = build_family_model(tmp_path / "m", "phi3", rope_parameters=rope, original_max_position_embeddings=64)
    with pytest.raises(EngineStartError) as e:
        start_embedded_engine(path, max_model_len=128, max_batch_size=2, device="cpu", startup_timeout=120)
    assert str(e.value).startswith("the engine cannot serve 'phi3' exactly: no support for rope_type 'longrope'")
    assert "\n" not in str(e.value)


def _slice_before_5_2x(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' ``logits_to_keep`` before per-row index tensors (5.17, say): an int keeps the
    last ``keep`` positions, any tensor indexes the sequence axis of every row alike."""
    if isinstance(keep, int):
        return hidden[:, -keep:, :] if keep else hidden
    return hidden[:, keep, :]


@pytest.mark.parametrize("ragged", [False, True])
def test_the_engine_serves_exactly_under_the_older_logits_to_keep(tmp_path, monkeypatch, ragged):
    # the engine's forwards must mean the same on every supported transformers: a per-row index
    # tensor once read as [R, 1] positions shared by all rows, and every model was refused
    import transformers.models.llama.modeling_llama as llama

    calls: list[str] = []

    def older(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
        calls.append("tensor" if isinstance(keep, torch.Tensor) else "int")
        return _slice_before_5_2x(hidden, keep)

    monkeypatch.setattr(llama, "slice_logits_to_keep", older)
    path = build_tiny_model(tmp_path / "tiny", layers=2, hidden=64, heads=2)
    engine = make_engine(path, ragged_batches=ragged, num_speculative_tokens=0, dtype="float32")
    try:
        assert engine.ragged == ragged
        assert engine.self_check_delta < 1e-4
        # the engine's forwards went through the older reading (else this test proves nothing)
        assert "int" in calls and (not ragged or "tensor" in calls)
        engine.pause()  # this thread drives the forwards
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        prompts = [PROMPT, PROMPT[:3], PROMPT[:5] + [17, 18, 19]]  # unequal lengths: a padded prefill
        logits = engine._prefill_logits(0, prompts, [0] * len(prompts))
        # then rows continued on their cached K/V from unequal starts (the prefix-cache path)
        more = [[30, 31], [32, 33, 34, 35, 36], [37]]
        later = engine._prefill_logits(0, more, [len(p) for p in prompts])
        for first, second, p, m in zip(logits, later, prompts, more, strict=True):
            for got, ids in ((first, p), (second, p + m)):
                want = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                assert torch.allclose(got, want, atol=1e-4)
    finally:
        engine.close()
