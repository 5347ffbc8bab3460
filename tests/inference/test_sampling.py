"""The engine's draw: tokens follow the reported distribution and never leave its support."""

from __future__ import annotations

import torch

from agentrl.inference.sampling import EngineSampling, sample


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_drawn_tokens_follow_the_filtered_distribution_on_both_generator_paths():
    # token 0 and 5 are outside the support (top-k = 4 of 6), the rest have unequal mass
    logits = torch.tensor([[-1.0, 2.0, 0.5, 1.0, 0.0, -3.0]])
    sp = EngineSampling(temperature=0.8, top_k=4)
    rows = 20_000
    draw = sample(logits.expand(rows, -1).contiguous(), [sp] * rows, [None] * rows, torch.Generator().manual_seed(0))
    kept = torch.tensor([1, 2, 3, 4])
    expect = torch.zeros(6, dtype=torch.float64)
    expect[kept] = torch.softmax(logits[0, kept].double() / 0.8, dim=-1)
    got = frequencies(draw.tokens, 6)
    assert got[0] == 0 and got[5] == 0
    assert (got - expect).abs().max() < 4 * (0.25 / rows) ** 0.5  # 4 sigma of a binomial frequency
    # every reported μ is the log of the drawn token's probability in that distribution
    assert max(abs(mu - float(expect[t].log())) for t, mu in zip(draw.tokens, draw.logprobs, strict=True)) < 1e-5

    # a seeded request draws from its own generator, one row at a time: same distribution, reproducible
    seeded = [torch.Generator().manual_seed(7) for _ in range(2)]
    n = 2_000
    runs = [[sample(logits, [sp], [g], torch.Generator()).tokens[0] for _ in range(n)] for g in seeded]
    assert runs[0] == runs[1]
    assert (frequencies(runs[0], 6) - expect).abs().max() < 4 * (0.25 / n) ** 0.5


def test_every_token_with_probability_is_drawn_on_its_own_interval_at_a_49k_vocabulary():
    """The inverse CDF at SmolLM2's vocabulary: a uniform inside token i's interval of the exact
    CDF (summed here in Python floats, independently) draws token i, for every token whose
    interval is wider than float64 rounding.  A float32 running sum lost thousands of them."""
    from agentrl.inference.sampling import invert_cdf

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(49152, generator=gen) * 3, dim=-1)
    p = probs.tolist()
    total, edges = 0.0, []
    for x in p:  # the exact (float64) running sum, one token at a time
        edges.append(total)
        total += x
    ids = [i for i, x in enumerate(p) if x > 1e-12 * total]
    mids = torch.tensor([(edges[i] + p[i] / 2) / total for i in ids], dtype=torch.float64)
    got = [t for chunk in mids.split(128) for t in invert_cdf(probs.expand(len(chunk), -1), chunk).tolist()]
    wrong = [i for i, g in zip(ids, got, strict=True) if g != i]
    assert not wrong, f"{len(wrong)} of {len(ids)} tokens are drawn as a neighbour (e.g. {wrong[:5]})"
    assert int(invert_cdf(probs[None], torch.ones(1, dtype=torch.float64))) == 49151 or p[-1] == 0


def test_the_two_level_inverse_cdf_matches_a_one_token_at_a_time_sum_across_block_edges():
    """A vocabulary that is not a multiple of the block size, with zero-probability runs at the
    ends of blocks and a zero last block: every draw is the first token whose (Python-float)
    running sum reaches u·total, never a token with p = 0, u = 1 included."""
    from agentrl.inference.sampling import BLOCK, invert_cdf

    v = 3 * BLOCK + 100
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(v, generator=gen) ** 4
    probs[BLOCK - 40 : BLOCK + 3] = 0  # a block's tail and the next block's head
    probs[2 * BLOCK : 3 * BLOCK] = 0  # a whole block
    probs[3 * BLOCK + 50 :] = 0  # the short last block's tail
    p = probs.tolist()
    total, cum = 0.0, []
    for x in p:
        total += x
        cum.append(total)
    us = torch.cat([torch.rand(4000, generator=gen, dtype=torch.float64), torch.tensor([1.0, 1e-300], dtype=torch.float64)])
    got = invert_cdf(probs.expand(len(us), -1), us).tolist()
    for u, g in zip(us.tolist(), got, strict=True):
        assert p[g] > 0, f"drew token {g} with p = 0 at u = {u}"
        target = u * total
        want = next(i for i, c in enumerate(cum) if c >= target)
        if abs(cum[want] - target) > 1e-12 * total and (want == 0 or abs(cum[want - 1] - target) > 1e-12 * total):
            assert g == want, (u, g, want)
    # u = 1 on many rows: where a block's sum and its own running sum differ in the last bit, the
    # draw is still a token of the last block with p > 0, not one past it
    rows = torch.softmax(torch.randn(2000, v, generator=gen) * 6, dim=-1)  # a wide exponent range: sums round
    rows[:, 3 * BLOCK + 50 :] = 0
    drawn = invert_cdf(rows, torch.ones(2000, dtype=torch.float64))
    assert bool((drawn >= 3 * BLOCK).all()) and bool((rows.gather(1, drawn[:, None]) > 0).all())


def test_a_row_without_filters_keeps_its_whole_vocabulary_whatever_the_batch():
    """A greedy row and a top_p = 1 row next to a top-k row: their support is still V and their μ
    and top logprobs are what they are alone (greedy: the raw log-softmax, no floor).  A float32
    running mass that reached 1.0 used to cut their tails (K = 5 of 1000 on these peaked logits),
    so the row's distribution depended on who shared its batch."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0)) * 20
    other = EngineSampling(temperature=1.0, top_k=2)
    for sp in (EngineSampling(temperature=0.0, top_logprobs=20), EngineSampling(temperature=1.0, top_logprobs=20)):
        alone = sample(logits[:1], [sp], [None], torch.Generator().manual_seed(0))
        mixed = sample(logits, [sp, other], [None, None], torch.Generator().manual_seed(0))
        assert mixed.support[0] == alone.support[0] == 1000, (sp, mixed.support, alone.support)
        assert mixed.tokens[0] == alone.tokens[0] and mixed.logprobs[0] == alone.logprobs[0]
        assert mixed.top_logprobs[0] == alone.top_logprobs[0]
    raw = torch.log_softmax(logits[0].double(), dim=-1).topk(20)
    tops = alone.top_logprobs[0]
    assert [t for t, _ in tops] == raw.indices.tolist()
    assert max(abs(a - b) for (_, a), b in zip(tops, raw.values.tolist(), strict=True)) < 1e-5


def test_the_drawn_tokens_top_logprob_entry_is_its_logprob():
    """OpenAI's logprobs: the sampled token, listed among the top logprobs, carries its own logprob
    there (a client matches them), greedy or sampled."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3)) * 4
    params = [EngineSampling(temperature=t, top_k=k, top_logprobs=5) for t in (0.0, 0.7) for k in (-1, 3)] * 2
    d = sample(logits, params, [None] * 8, torch.Generator().manual_seed(0))
    for tok, mu, tops in zip(d.tokens, d.logprobs, d.top_logprobs, strict=True):
        listed = dict(tops)
        assert tok not in listed or listed[tok] == mu, (tok, mu, tops)


def test_a_request_temperature_too_small_for_float32_is_greedy():
    """``temperature`` 1e-40 divided the logits to inf (μ NaN, which JSON cannot carry, and a
    token that was not the argmax); 1e-300 became 0 in float32, so the filters treated the row as
    greedy while the draw sampled it at T = 1.  Below 1e-5 a request is greedy, as in vLLM."""
    from agentrl.inference.protocol import CompletionRequest

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    for t in (1e-300, 1e-40, 1e-6):
        req = CompletionRequest(prompt=[1], temperature=t)
        sp = EngineSampling(temperature=req.temperature)
        draws = [sample(logits, [sp], [None], torch.Generator().manual_seed(s)) for s in range(20)]
        assert {d.tokens[0] for d in draws} == {int(logits.argmax())}, t
        assert all(d.logprobs[0] == draws[0].logprobs[0] and d.logprobs[0] <= 0 for d in draws), t
    assert CompletionRequest(prompt=[1], temperature=1e-3).temperature == 1e-3
