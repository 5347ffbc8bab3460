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
