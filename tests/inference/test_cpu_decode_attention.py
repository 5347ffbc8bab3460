"""The CPU decode-attention kernel (agentrl/inference/cpu_decode_attention.py) against the
published formula, softmax(q·kᵀ·scale over the visible keys)·v, written here in float64 one
query at a time; and the engine's use of it and its fallback to torch's sdpa."""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from agentrl.errors import EngineStartError
from agentrl.inference import cpu_decode_attention as cda
from agentrl.inference.engine import Engine
from agentrl.inference.sampling import EngineSampling
from agentrl.tiny_model import build_family_model

pytestmark = pytest.mark.skipif(cda.kernel() is None, reason=f"kernel not built here: {cda.unavailable_reason()}")


def reference(query, key, value, index, positions, slot0, window, scale):
    """out[token, head] for each named query, in float64: its own slot's keys 0..p (p - window < j)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    out = {}
    for r in range(index.shape[0]):
        for t in range(index.shape[1]):
            tok, p = int(index[r, t]), int(positions[r, t])
            lo = max(0, p - window + 1) if window else 0
            for h in range(heads):
                kh = h // (heads // kv_heads)
                k = key[slot0 + r, kh, lo : p + 1].double()
                v = value[slot0 + r, kh, lo : p + 1].double()
                w = torch.softmax(k @ query[tok, h].double() * scale, dim=0)
                out[tok, h] = w @ v
    return out


def case(rows, t_max, heads, kv_heads, dim, slot0, seed):
    """Random queries in a strided [tokens, heads, dim] view, a slot cache, and rows of 1..t_max
    queries at consecutive positions, flat tokens in shuffled order, padded by repeating the last."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    columns = 40
    key = torch.randn(slot0 + rows + 1, kv_heads, columns, dim, generator=g)
    value = torch.randn(slot0 + rows + 1, kv_heads, columns, dim, generator=g)
    counts = [rng.randint(1, t_max) for _ in range(rows)]
    tokens = list(range(sum(counts) + 3))  # 3 tokens no row names (a segment's, say)
    rng.shuffle(tokens)
    index, positions, k = [], [], 0
    for n in counts:
        first = rng.randint(0, columns - n)  # position 0 (one key) and the last column both occur
        toks, pos = tokens[k : k + n], list(range(first, first + n))
        k += n
        index.append(toks + [toks[-1]] * (t_max - n))
        positions.append(pos + [pos[-1]] * (t_max - n))
    query = torch.randn(heads, len(tokens), dim, generator=g).transpose(0, 1)  # as the model's query[0].T
    return query, key, value, torch.tensor(index), torch.tensor(positions)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (9, 3, 64), (6, 2, 48), (2, 1, 128), (4, 2, 16)])
@pytest.mark.parametrize("t_max,window", [(1, None), (3, None), (1, 7), (4, 5)])
def test_the_kernel_matches_the_formula(heads, kv_heads, dim, t_max, window):
    query, key, value, index, positions = case(rows=11, t_max=t_max, heads=heads, kv_heads=kv_heads, dim=dim,
                                               slot0=2, seed=dim + t_max)  # fmt: skip
    scale = 0.7 / dim**0.5
    out = torch.full((query.shape[0], heads, dim), float("nan"))
    cda.attend(query, key, value, out, index, positions, 2, window, scale)
    want = reference(query, key, value, index, positions, 2, window, scale)
    named = {int(t) for t in index.flatten()}
    for (tok, h), w in want.items():
        assert torch.allclose(out[tok, h].double(), w, rtol=1e-5, atol=1e-5), (tok, h)
    for tok in set(range(query.shape[0])) - named:
        assert torch.isnan(out[tok]).all()  # a token no row names is never written


@pytest.mark.parametrize("dim,t_max,window", [(64, 1, None), (32, 3, 6), (48, 2, None)])
def test_bf16_is_computed_in_float32_and_rounded_once(dim, t_max, window):
    """bf16 queries, keys and values: the formula on their exact values in float64; each output
    element within half a bf16 step (2⁻⁸ relative) of it, as one rounding to nearest allows
    (truncating or rounding up moves thousands of them a whole step)."""
    query, key, value, index, positions = case(rows=9, t_max=t_max, heads=6, kv_heads=2, dim=dim, slot0=1, seed=dim)
    query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    out = torch.full((query.shape[0], 6, dim), float("nan"), dtype=torch.bfloat16)
    cda.attend(query, key, value, out, index, positions, 1, window, dim**-0.5)
    for (tok, h), w in reference(query, key, value, index, positions, 1, window, dim**-0.5).items():
        err = (out[tok, h].double() - w).abs()
        assert (err <= 2**-8 * w.abs() + 1e-5 * w.abs().max()).all(), (tok, h)


def test_bf16_output_ties_round_to_even():
    """Two keys of equal score: the output is (v0 + v1) / 2, exactly halfway between two bf16
    values; round-to-nearest-even picks the even one (torch's own float → bf16 rounding)."""
    query = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    key = torch.zeros(1, 1, 4, 32, dtype=torch.bfloat16)
    value = torch.zeros(1, 1, 4, 32, dtype=torch.bfloat16)
    value[0, 0, 0] = 1.0
    value[0, 0, 1] = torch.tensor([1 + 2**-7 * (1 + 2 * (i % 2)) for i in range(32)]).bfloat16()  # 1+2⁻⁷, 1+3·2⁻⁷
    out = torch.empty(1, 1, 32, dtype=torch.bfloat16)
    cda.attend(query, key, value, out, torch.tensor([[0]]), torch.tensor([[1]]), 0, None, 1.0)
    assert torch.equal(out[0, 0], ((value[0, 0, 0].float() + value[0, 0, 1].float()) / 2).bfloat16())


def test_scores_far_apart_give_the_top_key_all_the_weight():
    """Scores 200 apart: the softmax's exp underflows to 0 for all but one key, without NaN."""
    query, key, value, index, positions = case(rows=3, t_max=1, heads=2, kv_heads=2, dim=32, slot0=0, seed=5)
    positions[:] = 9
    key[:, :, :10] = 0
    key[:, :, 4] = query[0, 0] * 400 / query[0, 0].square().sum()  # row 0, head 0: key 4 scores 400
    out = torch.zeros(query.shape[0], 2, 32)
    cda.attend(query, key, value, out, index, positions, 0, None, 1.0)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[int(index[0, 0]), 0], value[0, 0, 4])


def test_rows_split_across_threads_give_the_same_bits():
    query, key, value, index, positions = case(rows=40, t_max=2, heads=6, kv_heads=2, dim=64, slot0=1, seed=3)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            out = torch.zeros(query.shape[0], 6, 64)
            cda.attend(query, key, value, out, index, positions, 1, None, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_a_long_row_keeps_its_precision():
    """1,500 keys: the running max, the float32 sums and the score buffer over a long row."""
    query, key, value, index, positions = case(rows=2, t_max=2, heads=4, kv_heads=2, dim=64, slot0=0, seed=9)
    key, value = key.repeat(1, 1, 40, 1), value.repeat(1, 1, 40, 1)  # 1,600 columns
    positions = torch.tensor([[1499, 1500], [1200, 1200]])
    key[:, :, 700:900] *= 3  # a block of larger scores in the middle
    out = torch.empty(query.shape[0], 4, 64)
    cda.attend(query, key, value, out, index, positions, 0, None, 0.125)
    for (tok, h), w in reference(query, key, value, index, positions, 0, None, 0.125).items():
        assert torch.allclose(out[tok, h].double(), w, rtol=1e-5, atol=1e-5), (tok, h)


def test_tensors_the_kernel_does_not_cover_stay_with_sdpa():
    query, key, value, index, positions = case(rows=2, t_max=1, heads=2, kv_heads=2, dim=32, slot0=0, seed=1)
    assert cda.supported(query, key, value)
    other_layout = value.transpose(0, 1).contiguous().transpose(0, 1)
    for args in ((query, key, other_layout), (query.double(), key, value), (query[..., :16], key, value),
                 (query, key.transpose(-1, -2), value.transpose(-1, -2)), (query.half(), key.half(), value.half()),
                 (query.bfloat16(), key, value)):  # fmt: skip
        assert not cda.supported(*args)
    assert cda.supported(query.bfloat16(), key.bfloat16(), value.bfloat16())
    with pytest.raises(ValueError, match="does not cover these tensors"):
        cda.attend(query, key, other_layout, torch.empty(query.shape[0], 2, 32), index, positions, 0, None, 1.0)


def _threaded_attend_in_child(conn):
    torch.set_num_threads(2)
    query, key, value, index, positions = case(rows=40, t_max=1, heads=2, kv_heads=2, dim=32, slot0=0, seed=2)
    out = torch.zeros(query.shape[0], 2, 32)
    cda.attend(query, key, value, out, index, positions, 0, None, 0.2)
    conn.send(float(out.abs().sum()))


def test_a_forked_child_runs_the_threaded_split():
    """The parent's thread pool does not exist in a forked child: the child builds its own."""
    import multiprocessing

    query, key, value, index, positions = case(rows=40, t_max=1, heads=2, kv_heads=2, dim=32, slot0=0, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cda.attend(query, key, value, torch.zeros(query.shape[0], 2, 32), index, positions, 0, None, 0.2)
        assert cda._executor is not None  # the parent's pool exists
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_threaded_attend_in_child, args=(child,))
        proc.start()
        assert parent.poll(60), "the forked child hung in the threaded split"
        assert parent.recv() > 0
        proc.join(10)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- build and cache


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as before its first build, its cache under tmp_path."""
    monkeypatch.setattr(cda, "_tried", False)
    monkeypatch.setattr(cda, "_lib", None)
    monkeypatch.setattr(cda, "_reason", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "agentrl" / "kernels"


def test_the_build_is_cached_privately_and_reused(fresh):
    assert cda.kernel() is not None
    (lib,) = fresh.glob("decode_attention-*.so")
    assert fresh.stat().st_mode & 0o777 == 0o700
    mtime = lib.stat().st_mtime_ns
    cda._tried = False
    assert cda.kernel() is not None and lib.stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_a_cache_directory_others_can_write_is_refused(fresh):
    fresh.mkdir(parents=True)
    fresh.chmod(0o777)
    assert cda.kernel() is None and "writable by others" in cda.unavailable_reason()
    assert not list(fresh.glob("*.so"))


def test_a_directory_above_the_cache_that_others_can_write_is_refused(fresh):
    """Another user who can rename entries above the cache could swap it between build and load."""
    fresh.parent.mkdir(parents=True)
    fresh.parent.chmod(0o777)  # agentrl/: not sticky
    assert cda.kernel() is None and "writable by others" in cda.unavailable_reason()
    fresh.parent.chmod(0o1777)  # sticky, as /tmp, with our own entry below it: fine
    cda._tried = False
    assert cda.kernel() is not None


def test_a_cached_library_others_can_write_is_never_loaded(fresh, monkeypatch):
    assert cda.kernel() is not None
    (lib,) = fresh.glob("decode_attention-*.so")
    lib.chmod(0o666)
    with pytest.raises(PermissionError, match="not a file only this user can write"):
        cda._load(lib)
    cda._tried, cda._lib = False, None
    assert cda.kernel() is not None and lib.stat().st_mode & 0o022 == 0  # built again, then loaded


def _replace(path, data: bytes) -> None:
    """New bytes under the same name, as a new file (the loader caches an inode it loaded once)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_corrupt_cached_library_is_built_again(fresh):
    """In a fresh process: this one keeps the library it loaded under that name."""
    assert cda.kernel() is not None
    (lib,) = fresh.glob("decode_attention-*.so")
    _replace(lib, b"\x7fELF truncated")
    code = "from agentrl.inference import cpu_decode_attention as c; print(c.kernel() is not None, c.unavailable_reason())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.stdout.split() == ["True", "None"], done.stderr[-2000:]
    assert lib.stat().st_size > 1000


def test_without_a_compiler_the_engine_keeps_sdpa_and_says_why(fresh, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    path = build_family_model(tmp_path / "m", "llama")
    with caplog.at_level(logging.WARNING, logger="agentrl.inference.engine"):
        engine = Engine(path, device="cpu", dtype="float32", max_batch_size=4, max_model_len=64)
    try:
        assert engine.stats()["cpu_attention"] == "sdpa" and engine.stats()["ragged_batches"] is True
        assert "cpu_attention = kernel unavailable (FileNotFoundError" in caplog.text
        out = engine.submit([5, 6, 7], EngineSampling(max_tokens=4, temperature=0, ignore_eos=True)).result(60)[0]
        assert len(out.token_ids) == 4
    finally:
        engine.close()


# ---------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("family,drafts", [("llama", 0), ("qwen2-sliding", 3)])
def test_the_engine_gives_sdpas_tokens_and_logprobs_with_the_kernel(family, drafts, tmp_path):
    path = build_family_model(tmp_path / "m", family)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))] for _ in range(12)]
    sp = EngineSampling(max_tokens=40, temperature=0, ignore_eos=True)
    results = {}
    for setting in ("sdpa", "kernel"):
        engine = Engine(path, device="cpu", dtype="float32", max_batch_size=8, max_model_len=128,
                        cpu_attention=setting, num_speculative_tokens=drafts)  # fmt: skip
        try:
            assert engine.stats()["cpu_attention"] == setting
            futures = [engine.submit(p, sp) for p in prompts]  # more than the slots: prefills join decodes
            results[setting] = [f.result(timeout=120)[0] for f in futures]
        finally:
            engine.close()
    for a, b in zip(results["sdpa"], results["kernel"], strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_an_unknown_cpu_attention_is_refused(tmp_path):
    path = build_family_model(tmp_path / "m", "llama")
    with pytest.raises(EngineStartError, match=re.escape("cpu_attention must be kernel | sdpa; got 'fast'")):
        Engine(path, device="cpu", dtype="float32", max_batch_size=2, max_model_len=64, cpu_attention="fast")


@pytest.mark.parametrize("family,dtype", [("llama", "float16"), ("gemma2", "float32")])
def test_a_float16_or_eager_engine_keeps_its_own_attention(family, dtype, tmp_path):
    path = build_family_model(tmp_path / "m", family)
    engine = Engine(path, device="cpu", dtype=dtype, max_batch_size=2, max_model_len=64)
    try:
        assert engine.stats()["cpu_attention"] == "sdpa"
    finally:
        engine.close()


def test_a_bf16_engine_runs_the_kernel_within_bf16s_rounding_of_sdpa(tmp_path):
    """bf16 engines with each setting, greedy: each sequence's logprobs agree up to where (if
    anywhere) the two paths' rounding first picks different tokens, and most never do."""
    path = build_family_model(tmp_path / "m", "qwen2-sliding")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    sp = EngineSampling(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for setting in ("sdpa", "kernel"):
        engine = Engine(path, device="cpu", dtype="bfloat16", max_batch_size=8, max_model_len=96, cpu_attention=setting)
        try:
            assert engine.stats()["cpu_attention"] == setting and engine.stats()["ragged_batches"] is True
            results[setting] = [f.result(timeout=120)[0] for f in [engine.submit(p, sp) for p in prompts]]
        finally:
            engine.close()
    same = 0
    for a, b in zip(results["sdpa"], results["kernel"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        same += n == len(a.token_ids)
        assert max((abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True)), default=0.0) < 0.1
    assert same >= len(prompts) // 2


def test_the_cache_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cda._cache_root() == tmp_path / "agentrl" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cda._cache_root() == type(tmp_path)(os.path.expanduser("~")) / ".cache" / "agentrl" / "kernels"
