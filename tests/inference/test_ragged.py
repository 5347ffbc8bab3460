"""Ragged batches and n-gram speculation (issue 28): one forward per engine step, and draft
tokens that change how many forwards tokens take, never which tokens or which μ."""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.errors import EngineStartError
from agentrl.inference import ragged
from agentrl.inference.engine import Engine
from agentrl.inference.sampling import EngineSampling
from agentrl.inference.speculation import NgramDrafter
from agentrl.tiny_model import build_family_model

# ---------------------------------------------------------------------------- the drafter


def test_the_drafter_proposes_what_followed_the_same_tokens_last():
    d = NgramDrafter(n=2, k=3)
    d.learn([1, 2, 3, 4, 5, 6])
    assert d.propose([9, 1, 2], limit=3) == (3, 4, 5)
    assert d.propose([1, 2], limit=2) == (3, 4)
    assert d.propose([2, 1], limit=3) == ()  # never seen
    assert d.propose([2], limit=3) == ()  # shorter than n
    assert d.propose([1, 2], limit=0) == ()
    d.learn([7, 1, 2, 9, 9, 9])  # the latest continuation wins
    assert d.propose([1, 2], limit=3) == (9, 9, 9)


def test_a_sequences_short_tail_never_replaces_a_full_continuation():
    d = NgramDrafter(n=1, k=3)
    d.learn([5, 6, 7, 8])
    d.learn([0, 5, 6])  # 5 -> (6,) only: its sequence ended
    assert d.propose([5], limit=3) == (6, 7, 8)
    d.learn([0, 4, 1])
    assert d.propose([4], limit=3) == (1,)  # new: the short one is all there is


def test_learning_from_start_skips_earlier_continuations_and_the_table_is_bounded():
    d = NgramDrafter(n=1, k=1, capacity=3)
    d.learn([1, 2, 3, 4], start=2)  # continuations starting at index 2 and 3 only
    assert d.propose([1], 1) == () and d.propose([2], 1) == (3,) and d.propose([3], 1) == (4,)
    d.learn([10, 11, 12, 13])  # 5 entries: the newest capacity // 2 stay
    assert len(d) == 1 and d.propose([12], 1) == (13,) and d.propose([2], 1) == ()
    d = NgramDrafter(n=1, k=1, capacity=4)
    d.learn([1, 2, 3, 4])  # 1, 2, 3
    d.learn([1, 2])  # rewritten: now the newest
    d.learn([7, 8, 9])  # 7, 8: five entries, the newest two stay
    assert len(d) == 2 and d.propose([8], 1) == (9,) and d.propose([1], 1) == ()
    d.learn([1, 2, 6])  # 4 entries: nothing goes
    assert len(d) == 4 and d.propose([1], 1) == (2,) and d.propose([7], 1) == (8,)
    with pytest.raises(ValueError, match="n >= 1 and k >= 1"):
        NgramDrafter(n=0, k=2)


# ---------------------------------------------------------------------------- ragged vs padded


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family_model(tmp_path_factory.mktemp("m") / "llama", "llama")  # grouped-query attention


def make(path, **kw) -> Engine:
    return Engine(path, device="cpu", dtype="float32", **{"max_batch_size": 16, "max_model_len": 192, **kw})


def record_forwards(engine: Engine) -> list[tuple[int, int, int]]:
    """(decode rows, draft tokens, segments) of every ragged forward the engine runs from now on."""
    calls: list[tuple[int, int, int]] = []
    inner = engine._ragged_logits

    def spy(decode, drafts, segments, keep):
        calls.append((len(decode), sum(len(d) for d in drafts), len(segments)))
        return inner(decode, drafts, segments, keep)

    engine._ragged_logits = spy
    return calls


def staggered(engine: Engine, prompts: list[list[int]], sp: EngineSampling, n: int = 1) -> list:
    """Submit the prompts a few engine steps apart, so new prompts prefill while others decode."""
    futs = []
    for p in prompts:
        futs.append(engine.submit(p, sp, n=n))
        start = engine.steps
        while engine.steps < start + 3 and not all(f.done() for f in futs):
            threading.Event().wait(0.001)
    return [r for f in futs for r in f.result(timeout=120)]


def test_ragged_steps_give_the_padded_steps_tokens_and_logprobs(llama):
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # a system prompt: later prompts hit the prefix cache
    prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for _ in range(10)]
    sp = EngineSampling(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    for on in (False, True):
        engine = make(llama, ragged_batches=on)
        try:
            assert engine.ragged is on
            calls = record_forwards(engine)
            out[on] = staggered(engine, prompts, sp, n=2)
            assert engine.prefix_hit_tokens > 0
        finally:
            engine.close()
        assert not on or any(d and s for d, _, s in calls)  # a step decoded and prefilled in one forward
    for a, b in zip(out[False], out[True], strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_a_ragged_path_that_differs_is_refused_and_the_engine_keeps_padded_batches(llama, monkeypatch, caplog):
    def leaky(decode, drafts, segments, *args):  # the new prompts' queries see the future
        plan, *rest = layout(decode, drafts, segments, *args)
        for g in plan.groups[1 if decode else 0 :]:
            g.masks = {k: torch.ones_like(m) for k, m in g.masks.items()}
        return (plan, *rest)

    layout = ragged.layout
    monkeypatch.setattr(ragged, "layout", leaky)
    with caplog.at_level(logging.WARNING, logger="agentrl.inference.engine"):
        engine = make(llama, num_speculative_tokens=2)
    try:
        assert not engine.ragged and "ragged batches refused" in caplog.text
        assert "num_speculative_tokens = 2 is ignored" in caplog.text  # the run goes on without drafts
        r = engine.submit([5, 6, 7], EngineSampling(max_tokens=4, temperature=0, ignore_eos=True)).result(60)[0]
        assert len(r.token_ids) == 4 and engine.speculation.draft_tokens == 0
    finally:
        engine.close()
    monkeypatch.undo()
    with pytest.raises(EngineStartError, match=r"^num_speculative_tokens needs ragged batches.*= 0$"):
        make(llama, num_speculative_tokens=2, ragged_batches=False)
    with pytest.raises(EngineStartError, match=r"^speculative_ngram must be >= 1, got 0$"):
        make(llama, num_speculative_tokens=2, speculative_ngram=0)


# ---------------------------------------------------------------------------- speculation


def test_greedy_speculation_gives_the_same_tokens_in_fewer_steps(llama):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    sp = EngineSampling(max_tokens=40, temperature=0, ignore_eos=True)
    base = make(llama)
    try:
        want = [f.result(120)[0] for f in [base.submit(p, sp) for p in prompts]]
    finally:
        base.close()
    engine = make(llama, num_speculative_tokens=4)
    try:
        first = [f.result(120)[0] for f in [engine.submit(p, sp) for p in prompts]]
        steps = engine.steps
        calls = record_forwards(engine)
        again = [f.result(120)[0] for f in [engine.submit(p, sp) for p in prompts]]  # the drafter knows them now
        assert engine.steps - steps < 40 / 2  # 40 tokens each, most from drafts
        assert any(dr for _, dr, _ in calls)
    finally:
        engine.close()
    for w, a, b in zip(want, first, again, strict=True):
        assert w.token_ids == a.token_ids == b.token_ids and len(b.token_ids) == 40
        assert max(abs(x - y) for x, y in zip(w.logprobs, b.logprobs, strict=True)) < 1e-4
    assert engine.speculation.accepted_draft_tokens > 0.8 * engine.speculation.draft_tokens


def test_drafts_stop_at_max_tokens_stop_strings_and_stream_every_token(llama):
    rng = random.Random(2)
    prompt = [rng.randrange(3, 500) for _ in range(12)]
    greedy = EngineSampling(max_tokens=30, temperature=0, ignore_eos=True)
    base = make(llama)
    try:
        full = base.submit(prompt, greedy).result(120)[0]
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
        want = base.submit(prompt, EngineSampling(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])).result(120)[0]
    finally:
        base.close()
    assert want.finish_reason == "stop" and len(want.token_ids) < 30
    engine = make(llama, num_speculative_tokens=6)
    try:
        engine.submit(prompt, greedy).result(120)  # teach the drafter this completion
        drafted = engine.speculation.draft_tokens
        events = []
        r = engine.submit(prompt, EngineSampling(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
                          on_tokens=events.extend).result(120)[0]  # fmt: skip
        assert (r.token_ids, r.text, r.finish_reason) == (want.token_ids, want.text, "stop")
        assert [e.token_id for e in events] == r.token_ids and events[-1].finish_reason == "stop"
        short = engine.submit(prompt, EngineSampling(max_tokens=7, temperature=0, ignore_eos=True)).result(120)[0]
        assert short.token_ids == full.token_ids[:7] and short.finish_reason == "length"
        assert engine.speculation.draft_tokens > drafted
    finally:
        engine.close()


def test_a_seed_gives_the_same_tokens_with_or_without_drafts(llama):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(6)]
    seeded = [EngineSampling(max_tokens=24, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(6)]
    base = make(llama)
    try:
        want = [base.submit(p, sp).result(120)[0].token_ids for p, sp in zip(prompts, seeded, strict=True)]
    finally:
        base.close()
    engine = make(llama, num_speculative_tokens=4, speculative_ngram=1)
    try:  # other completions teach the drafter (n = 1: a draft almost every step, most rejected at T = 1)
        for p in prompts:
            engine.submit(p, EngineSampling(max_tokens=24, temperature=1.0, ignore_eos=True)).result(120)
        drafted, kept = engine.speculation.draft_tokens, engine.speculation.accepted_draft_tokens
        got = [engine.submit(p, sp).result(120)[0].token_ids for p, sp in zip(prompts, seeded, strict=True)]
        assert engine.speculation.draft_tokens - drafted > engine.speculation.accepted_draft_tokens - kept  # drafts ran and some were rejected
    finally:
        engine.close()
    assert got == want


def _joint(engine: Engine, prompt: list[int], sp: EngineSampling, n: int) -> Counter:
    futs = [engine.submit(prompt, sp, n=8) for _ in range(n // 8)]
    return Counter(tuple(r.token_ids) for f in futs for r in f.result(300))


@pytest.mark.slow
def test_sampled_tokens_keep_the_models_joint_law_under_speculation(llama):
    """Three tokens' empirical joint law against the model's exact one (top-k 2: 8 cells), with a
    draft at the second step of every request (the drafter has seen what follows each token): a
    chi-square at p = 1e-4 (critical value 29.88 at 7 degrees of freedom).  Emitting a draft
    instead of the sampled token, or sampling the third token after a rejected draft, skews it
    far past that."""
    prompt = [17, 230, 41, 9, 300]
    temp = 2.0
    sp = EngineSampling(max_tokens=3, temperature=temp, top_k=2, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()

    def top2(ids: list[int]) -> list[tuple[int, float]]:
        p = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temp, -1).topk(2)
        return list(zip(p.indices.tolist(), (p.values / p.values.sum()).tolist(), strict=True))

    exact: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for a, pa in top2(prompt):
            for b, pb in top2(prompt + [a]):
                for c, pc in top2(prompt + [a, b]):
                    exact[(a, b, c)] = pa * pb * pc
    engine = make(llama, num_speculative_tokens=2, speculative_ngram=1, max_batch_size=64)
    try:
        _joint(engine, prompt, sp, 512)  # the drafter learns what follows each token
        drafted, kept = engine.speculation.draft_tokens, engine.speculation.accepted_draft_tokens
        n = 4096
        seen = _joint(engine, prompt, sp, n)
        drafted, kept = engine.speculation.draft_tokens - drafted, engine.speculation.accepted_draft_tokens - kept
    finally:
        engine.close()
    assert drafted > 0.9 * n and 0.1 * drafted < kept < 0.9 * drafted  # drafts ran, some kept and some not
    assert set(seen) <= set(exact)
    chi2 = sum((seen.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert chi2 < 29.88, (chi2, seen, exact)
