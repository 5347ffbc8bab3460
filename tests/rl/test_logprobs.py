"""The trainer's π_θ replays the engine's sampling distribution exactly (support replay)."""

import pytest
import torch

from agentrl.inference.sampling import EngineSampling, sample
from agentrl.trainer.logprobs import token_logprobs


def reference_logprob(z: torch.Tensor, token: int, temperature: float, k: int) -> float:
    """The published rule written out plainly: softmax(z/T) renormalised over its top-k entries."""
    scaled = (z / temperature).double()
    top = torch.topk(scaled, k).values
    return float(scaled[token] - torch.logsumexp(top, 0))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, -1, 1.0, 0.0), (0.7, -1, 0.8, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 50, 0.9, 0.05), (0.5, -1, 1.0, 0.2)],
)
def test_trainer_logprobs_equal_the_engines_mu_at_identical_weights(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3
    params = [EngineSampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * 64
    draw = sample(logits, params, [None] * 64, torch.Generator().manual_seed(1))
    tokens, support = torch.tensor(draw.tokens), torch.tensor(draw.support)
    logp, ent, outside = token_logprobs(logits, tokens, support, temperature, chunk_tokens=7)
    assert not outside.any()
    assert torch.allclose(logp, torch.tensor(draw.logprobs), atol=1e-5)
    truncated = top_k > 0 or top_p < 1 or min_p > 0
    assert (support < 300).any() == truncated
    for i in range(0, 64, 9):
        assert logp[i].item() == pytest.approx(reference_logprob(logits[i], draw.tokens[i], temperature, draw.support[i]), abs=1e-5)
    assert (ent >= 0).all()


def test_gradient_flows_through_the_chunks_and_matches_the_unchunked_rule():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(10, 50, generator=gen)
    tokens = torch.randint(0, 50, (10,), generator=gen)
    support = torch.tensor([0, 5, 50, 3, 10, 0, 2, 49, 7, 1])
    a = base.clone().requires_grad_(True)
    logp, _, outside = token_logprobs(a, tokens, support, 0.8, chunk_tokens=3)
    (logp * (~outside)).sum().backward()
    b = base.clone().requires_grad_(True)
    ref = []
    for i in range(10):
        k = 50 if support[i] <= 0 else int(support[i])
        z = b[i] / 0.8
        ref.append(z[tokens[i]] - torch.logsumexp(torch.topk(z, k).values, 0))
    ref = torch.stack(ref)
    inside = ~outside
    (ref * inside).sum().backward()
    assert torch.allclose(logp[inside], ref[inside].detach(), atol=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
    # a token outside the trainer's own top-K is flagged, never silently renormalised
    for i in range(10):
        k = 50 if support[i] <= 0 else int(support[i])
        assert bool(outside[i]) == (tokens[i].item() not in torch.topk(base[i], k).indices.tolist())


@pytest.mark.parametrize("rows,chunk,heads", [(5, 8, 1), (10, 4, 3 + 2)])
def test_only_the_chunks_before_the_last_rerun_the_lm_head_in_the_backward(rows, chunk, heads):
    """The last chunk's backward runs first, so it keeps its activations: one LM head forward per
    chunk plus one rerun per earlier chunk (the old path reran every chunk, the last too)."""
    from agentrl.trainer.logprobs import token_logprobs_from_hidden

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 8, generator=gen, requires_grad=True)
    hidden = torch.randn(rows, 8, generator=gen, requires_grad=True)
    tokens, support = torch.randint(0, 40, (rows,), generator=gen), torch.zeros(rows, dtype=torch.long)
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return h @ w.t()

    logp, _, _ = token_logprobs_from_hidden(hidden, head, tokens, support, 1.0, chunk_tokens=chunk)
    logp.sum().backward()
    assert len(calls) == heads
    ref = torch.log_softmax(hidden.detach() @ w.detach().t(), -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logp.detach(), ref, atol=1e-6)
    hidden2, w2 = hidden.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.log_softmax(hidden2 @ w2.t(), -1).gather(-1, tokens[:, None]).sum().backward()
    assert torch.allclose(hidden.grad, hidden2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "qwen3"])
def test_the_trainers_hidden_state_path_equals_the_models_own_logits(family, tmp_path):
    """The trainer sends hidden states through the LM head itself (memory); that path must apply
    the model's final-logit processing (Gemma 2's softcapping) exactly as its own forward does."""
    from transformers import AutoModelForCausalLM

    from agentrl.tiny_model import build_family_model
    from agentrl.trainer.logprobs import head_of, token_logprobs_from_hidden

    model = AutoModelForCausalLM.from_pretrained(build_family_model(tmp_path / family, family)).eval()
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    tokens, support = ids[0, 1:], torch.tensor([0, 20] * 19 + [0])
    with torch.no_grad():
        want, _, out_w = token_logprobs(model(input_ids=ids).logits[0, :-1], tokens, support, 0.7)
        decoder, logits_fn = head_of(model)
        hidden = decoder(input_ids=ids).last_hidden_state[0, :-1]
        got, _, out_g = token_logprobs_from_hidden(hidden, logits_fn, tokens, support, 0.7, chunk_tokens=7)
    assert torch.equal(out_w, out_g)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 1.0), (-1, 0.8), (20, 0.9)])
def test_ties_at_the_support_boundary_are_broken_the_same_way_on_both_sides(top_k, top_p):
    """bf16-rounded logits tie often: the engine's support and the trainer's replay must keep the
    same tokens, so π_θ/μ = 1 at identical weights (it was 0.5–0.75 on tied rows)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(256, 400, generator=gen) * 2).to(torch.bfloat16).float()
    params = [EngineSampling(temperature=1.0, top_k=top_k, top_p=top_p)] * 256
    draw = sample(logits, params, [None] * 256, torch.Generator().manual_seed(4))
    support = torch.tensor(draw.support)
    logp, _, outside = token_logprobs(logits, torch.tensor(draw.tokens), support, 1.0)
    assert not outside.any()
    assert torch.allclose(logp, torch.tensor(draw.logprobs), atol=1e-5)
    # independently: the kept set is every logit ≥ the K-th largest (a tie is never split)
    for i in range(256):
        row = logits[i].double()
        kth = torch.sort(row, descending=True).values[draw.support[i] - 1]
        assert int((row >= kth).sum()) == draw.support[i]
        assert draw.logprobs[i] == pytest.approx(float(row[draw.tokens[i]] - torch.logsumexp(row[row >= kth], 0)),
                                                 abs=1e-5)


def test_min_p_acts_before_top_p_as_in_vllm_v1():
    """vLLM v1 applies min-p, then top-k, then top-p; so top-p's mass is taken over what min-p left."""
    from agentrl.inference.sampling import filtered_logits

    # p = 0.4, 0.3, 0.2, 0.1.  min_p 0.5 keeps p ≥ 0.2, renormalised 4/9, 3/9, 2/9; top_p 0.75 then
    # keeps two (mass above the third is 7/9 ≥ 0.75).  Top-p first would keep three (mass above the
    # third is 0.7 < 0.75) and min-p after it all three.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    _, k = filtered_logits(logits, [EngineSampling(temperature=1.0, top_p=0.75, min_p=0.5)])
    assert k.tolist() == [2]
    _, k = filtered_logits(logits, [EngineSampling(temperature=1.0, top_p=0.75, min_p=0.0)])
    assert k.tolist() == [3]


ROWS = 300  # two chunks of 150 positions: at least LOW_PRECISION_MIN_ROWS each, the first checkpointed


def _bf16_head(bias: bool, cap: float | None, seed: int = 5, head=None):
    from agentrl.trainer.logprobs import Head

    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(48, 600, bias=bias) if head is None else head
    with torch.no_grad():  # peaked rows with logits of ~±20, where bf16's 8-bit rounding costs ~0.06
        lin.weight.copy_(torch.randn(600, 48, generator=gen) * 0.9)
        if bias:
            lin.bias.copy_(torch.randn(600, generator=gen))
    hidden = torch.randn(ROWS, 48, generator=gen)
    tokens = torch.randint(0, 600, (ROWS,), generator=gen)
    tokens[: ROWS // 2] = (hidden[: ROWS // 2] @ lin.weight.detach().t()).argmax(-1)  # half sample their top token
    return lin, Head(lin, None, None, cap), hidden, tokens


def _rounded(hidden, lin, cap=None):
    """The bf16 product as a bf16 GEMM makes it: accumulated in float32 (here float64), plus the bf16
    bias, rounded once to bf16; then the cap."""
    b = lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
    z = (hidden.bfloat16().double() @ lin.weight.detach().bfloat16().double().t() + b.bfloat16().double())
    z = z.bfloat16().double()
    return torch.tanh(z / cap) * cap if cap else z


def _exact(hidden, lin, cap=None):
    b = lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
    z = hidden.double() @ lin.weight.detach().double().t() + b.double()
    return torch.tanh(z / cap) * cap if cap else z


@pytest.mark.parametrize(("bias", "cap"), [(False, None), (True, None), (False, 30.0)])
def test_a_bf16_lm_head_recomputes_the_sampled_and_largest_logits_in_float32(bias, cap):
    """Golden: log π = z_y − logsumexp(z) where z is the bf16 product except, per row, the sampled
    token and the 16 largest, which are float32 (here float64) products; the cap applies to all."""
    from agentrl.trainer.logprobs import EXACT_TOP, token_logprobs_from_hidden

    lin, head, hidden, tokens = _bf16_head(bias, cap)
    support = torch.zeros(ROWS, dtype=torch.long)
    got, _, _ = token_logprobs_from_hidden(hidden, head, tokens, support, 1.0, chunk_tokens=150,
                                           head_dtype=torch.bfloat16)  # fmt: skip
    exact, rounded = _exact(hidden, lin, cap), _rounded(hidden, lin, cap)
    want = []
    for i in range(ROWS):
        mixed = rounded[i].clone()
        keep = set(torch.topk(rounded[i], EXACT_TOP).indices.tolist()) | {int(tokens[i])}
        for j in keep:
            mixed[j] = exact[i, j]
        want.append(float(exact[i, tokens[i]] - torch.logsumexp(mixed, 0)))
    want = torch.tensor(want)
    true = exact.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(exact, 1)
    plain_bf16 = rounded.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(rounded, 1)
    assert torch.allclose(got.double(), want.double(), atol=2e-4), (got - want).abs().max()
    # and it is what makes the bf16 head as exact as a float32 one: the plain bf16 product is not
    assert (got.double() - true).abs().mean() < 0.2 * (plain_bf16 - true).abs().mean()


@pytest.mark.parametrize("top_k", [20, 50])
def test_a_bf16_heads_truncated_support_is_ranked_on_its_bf16_logits(top_k):
    """A bf16 engine draws from the top K of its bf16 logits.  The token at rank K must stay inside
    the trainer's support: ranked on the bf16 logits (ties kept whole, as the engine keeps them),
    not on a mix where the float32 values sit among bf16-rounded neighbours.  Golden, at T = 0.7:
    log π = z_y/T − logsumexp over that set of the mixed values / T."""
    from agentrl.trainer.logprobs import EXACT_TOP, token_logprobs_from_hidden

    lin, head, hidden, _ = _bf16_head(False, None, seed=11)
    exact, rounded = _exact(hidden, lin), _rounded(hidden, lin)
    order = rounded.sort(dim=-1, descending=True)
    tokens = order.indices[:, top_k - 1]  # the boundary token of each row's kept set
    support = torch.full((ROWS,), top_k, dtype=torch.long)
    got, _, outside = token_logprobs_from_hidden(hidden, head, tokens, support, 0.7, chunk_tokens=150,
                                                 head_dtype=torch.bfloat16)  # fmt: skip
    assert not outside.any(), int(outside.sum())
    want = []
    for i in range(ROWS):
        mixed = rounded[i].clone()
        for j in set(torch.topk(rounded[i], EXACT_TOP).indices.tolist()) | {int(tokens[i])}:
            mixed[j] = exact[i, j]
        kept = rounded[i] >= order.values[i, top_k - 1]
        want.append(float(mixed[tokens[i]] / 0.7 - torch.logsumexp(mixed[kept] / 0.7, 0)))
    want = torch.tensor(want)
    assert torch.allclose(got.double(), want.double(), atol=3e-4), (got - want).abs().max()


def test_a_bf16_lm_heads_gradient_is_the_products_own():
    """The float32 values replace entries, not the gradient: it flows through the bf16 product to
    the hidden states and the float32 weight, within bf16's precision of the float32 gradient."""
    from agentrl.trainer.logprobs import token_logprobs_from_hidden

    grads = {}
    for dtype in (None, torch.bfloat16):
        lin, head, hidden, tokens = _bf16_head(False, None)
        hidden.requires_grad_(True)
        logp, _, _ = token_logprobs_from_hidden(hidden, head, tokens, torch.zeros(ROWS, dtype=torch.long), 1.0,
                                                chunk_tokens=150, head_dtype=dtype)  # fmt: skip
        logp.sum().backward()
        grads[dtype] = (hidden.grad, lin.weight.grad)
    for ref, got in zip(grads[None], grads[torch.bfloat16], strict=True):
        assert got is not None and got.dtype == torch.float32
        assert torch.linalg.norm(got - ref) < 0.03 * torch.linalg.norm(ref)


class _Wrapped(torch.nn.Parameter):
    """A weight of another tensor type (as a quantized or sharded one is)."""


class _OtherLinear(torch.nn.Linear):
    def __init__(self):
        super().__init__(48, 600, bias=False)
        self.weight = _Wrapped(self.weight.detach().clone())


@pytest.mark.parametrize("case", ["function", "wrapped weight", "short chunk"])
def test_a_bf16_head_stays_float32_without_a_plain_weight_or_enough_positions(case):
    """A bare function, a weight of another tensor type (an adapter, a quantized or sharded weight):
    no float32 rows to recompute from; a chunk under LOW_PRECISION_MIN_ROWS: the casts cost more
    than bf16 saves.  Each runs the head in float32, whatever ``head_dtype`` says."""
    from agentrl.trainer.logprobs import Head, token_logprobs_from_hidden

    lin, head, hidden, tokens = _bf16_head(False, None, head=_OtherLinear() if case == "wrapped weight" else None)
    support = torch.zeros(ROWS, dtype=torch.long)
    chunk = 100 if case == "short chunk" else 150
    plain = Head(lin, None, None, None) if case != "function" else (lambda h: lin(h))
    with torch.no_grad():
        want = torch.log_softmax(lin(hidden), -1).gather(-1, tokens[:, None])[:, 0]
    got, _, _ = token_logprobs_from_hidden(hidden, plain, tokens, support, 1.0, chunk_tokens=chunk,
                                           head_dtype=torch.bfloat16)  # fmt: skip
    assert torch.allclose(got, want, atol=1e-5)


def test_a_bf16_trainer_runs_its_lm_head_in_bf16(tiny_model, monkeypatch):
    """The trainer asks for the bf16 head exactly when its autocast is on."""
    import warnings

    from agentrl.config import TrainerConfig
    from agentrl.trainer import trainer as trainer_module
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

    seen = []
    real = trainer_module.token_logprobs_from_hidden

    def spy(*args, **kwargs):
        seen.append(kwargs.get("head_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "token_logprobs_from_hidden", spy)
    task = Task(prompt=[Message("user", "q")])
    group = Group(task=task)
    for reward in (0.0, 1.0):
        s = TokenSequence()
        s.extend_forced([5, 6, 7])
        s.extend_sampled([8, 9, 10], [-1.0] * 3, [0] * 3)
        group.trajectories.append(Trajectory(task=task, sequences=[s], reward=reward))
    group.assign_advantages()
    for dtype, want in (("float32", None), ("bfloat16", torch.bfloat16)):
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 on a CPU that emulates it
            Trainer(tiny_model, TrainerConfig(dtype=dtype)).step([group])
        assert seen and set(seen) == {want}
