"""agentrl.cpu_gemm: float32 CPU linear layers through oneDNN, forward and backward."""

from __future__ import annotations

import re

import pytest
import torch

from agentrl import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch has no oneDNN linear op")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor):
    """y = x W^T + b and its gradients by hand, in float64: dx = g W, dW = g^T x, db = sum g."""
    x64, w64, g64 = x.double(), w.double(), g.double()
    y = x64 @ w64.T + (b.double() if b is not None else 0)
    g2, x2 = g64.reshape(-1, g64.shape[-1]), x64.reshape(-1, x64.shape[-1])
    return y, g64 @ w64, g2.T @ x2, g2.sum(0) if b is not None else None


def _ops(fn) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 24), (2, 7, 24), "transposed"])
def test_linear_matches_the_formula_forward_and_backward(bias, shape):
    gen = torch.Generator().manual_seed(0)
    if shape == "transposed":  # a strided input (a view, as attention reshapes make)
        x = torch.randn(24, 9, generator=gen).t()
    else:
        x = torch.randn(*shape, generator=gen)
    x.requires_grad_(True)
    w = torch.randn(40, 24, generator=gen, requires_grad=True)
    b = torch.randn(40, generator=gen, requires_grad=True) if bias else None
    y = cpu_gemm.linear(x, w, b)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    ref_y, ref_dx, ref_dw, ref_db = _reference(x.detach(), w.detach(), b.detach() if bias else None, g)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(b.grad.double(), ref_db, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("needs", ["x", "w", "b", "wb"])
def test_gradient_only_for_what_needs_it_and_keeps_only_what_it_reads(needs):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=gen, requires_grad="x" in needs)
    w = torch.randn(4, 8, generator=gen, requires_grad="w" in needs)
    b = torch.randn(4, generator=gen, requires_grad="b" in needs)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = cpu_gemm.linear(x, w, b)
    y.backward(torch.ones(3, 4))
    assert (x.grad is not None, w.grad is not None, b.grad is not None) == ("x" in needs, "w" in needs, "b" in needs)
    if "x" in needs:
        torch.testing.assert_close(x.grad, torch.ones(3, 4) @ w.detach())
    if "w" in needs:
        torch.testing.assert_close(w.grad, torch.ones(4, 3) @ x.detach())
    if "b" in needs:
        torch.testing.assert_close(b.grad, torch.full((4,), 3.0))
    # the input is kept only for the weight's gradient, the weight only for the input's (as F.linear does)
    assert any(t is x for t in saved) == ("w" in needs)
    assert any(t is w for t in saved) == ("x" in needs)


def test_double_backward_raises_instead_of_a_silent_zero():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(cpu_gemm.linear(x, w).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_empty_input_trains_like_f_linear():
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    y = cpu_gemm.linear(x, w)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(4, 8))


def test_subclasses_with_their_own_forward_keep_it():
    class Router(torch.nn.Linear):  # as MoE routers and peft/quantized layers subclass nn.Linear
        def forward(self, x):
            logits = super().forward(x)
            return logits, logits.argmax(-1)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Router(8, 4))
    assert cpu_gemm.route_linears(model) == 1
    assert isinstance(model[0], cpu_gemm.OneDNNLinear) and type(model[1]) is Router
    logits, idx = model(torch.randn(2, 8))
    assert logits.shape == (2, 4) and idx.shape == (2,)


def test_oneDNN_switched_off_is_respected():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not cpu_gemm.available()
        assert "mkldnn::_linear_pointwise" not in _ops(lambda: cpu_gemm.linear(x, w))
        assert cpu_gemm.route_linears(torch.nn.Sequential(torch.nn.Linear(8, 4))) == 0


def test_not_covered_falls_back_to_f_linear():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's rules apply: a bf16 product
        assert cpu_gemm.linear(x, w).dtype == torch.bfloat16
    assert cpu_gemm.linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert cpu_gemm.linear(x[0], w).shape == (4,)  # a 1-D input
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: cpu_gemm.linear(x.double(), w.double()))


def test_routed_model_runs_every_linear_through_onednn_and_keeps_its_parameters(tiny_model):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    routed = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    before = {k: v.data_ptr() for k, v in routed.state_dict().items()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in routed.modules())
    assert cpu_gemm.route_linears(routed) == linears > 0
    assert cpu_gemm.route_linears(routed) == 0  # already routed: nothing is wrapped twice
    assert {k: v.data_ptr() for k, v in routed.state_dict().items()} == before

    ids = torch.randint(0, routed.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    counts = _ops(lambda: routed(input_ids=ids))
    assert counts.get("mkldnn::_linear_pointwise") == linears  # each layer once, the LM head included
    assert counts.get("aten::addmm", 0) == counts.get("aten::mm", 0) == 0
    with torch.no_grad():
        torch.testing.assert_close(routed(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-5)

    # training: gradients agree with the plain model's
    for m in (plain, routed):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), routed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)

    # a weight update in place (as a weight push makes it) is what the next forward uses
    with torch.no_grad():
        for m in (plain, routed):
            m.lm_head.weight.mul_(0.5)
        torch.testing.assert_close(routed(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_engine_and_trainer_route_their_cpu_models(tiny_model):
    from agentrl.config import TrainerConfig
    from agentrl.inference.engine import Engine
    from agentrl.trainer.trainer import Trainer

    eng = Engine(tiny_model, max_batch_size=2, max_model_len=64, device="cpu", dtype="float32")
    try:
        assert cpu_gemm.route_linears(eng.model) == 0  # the engine routed them all at load
    finally:
        eng.close()
    trainer = Trainer(tiny_model, TrainerConfig(device="cpu"))
    assert cpu_gemm.route_linears(trainer.model) == 0
    plain = Trainer(tiny_model, TrainerConfig(device="cpu", cpu_linear="torch"))  # the opt-out
    assert not any(isinstance(m, cpu_gemm.OneDNNLinear) for m in plain.model.modules())


def _settle(lin: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forwards until the layer has packed its weight; the packed layer's output."""
    for _ in range(cpu_gemm.PACK_AFTER + 1):
        y = lin(x)
    assert lin.__dict__["_pack"][4] is not None  # the packed copy is what answered
    return y


def test_prepacked_layer_follows_its_weight():
    import copy
    import pickle

    lin = torch.nn.Linear(24, 40)
    plain = torch.nn.Linear(24, 40)
    plain.load_state_dict(lin.state_dict())
    assert cpu_gemm.route_linears(lin, prepack=True) == 1
    x = torch.randn(6, 24)
    with torch.no_grad():
        torch.testing.assert_close(_settle(lin, x), plain(x), rtol=1e-5, atol=1e-5)
        for m in (lin, plain):  # an in-place write is seen by the weight's version
            m.weight.mul_(-2)
        torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_settle(lin, x), plain(x), rtol=1e-5, atol=1e-5)
        new = torch.randn(40, 24)
        for m in (lin, plain):  # a write through .data bumps no version: invalidate_packs says so
            m.weight.data.copy_(new)
        cpu_gemm.invalidate_packs(lin)
        torch.testing.assert_close(_settle(lin, x), plain(x), rtol=1e-5, atol=1e-5)
        lin.weight = torch.nn.Parameter(torch.randn(40, 24))  # a new parameter
        plain.weight = lin.weight
        torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-5)
        # a packed layer still copies and pickles (the pack stays behind and is made again)
        for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert isinstance(clone, cpu_gemm.PackedLinear) and "_pack" not in clone.__dict__
            torch.testing.assert_close(_settle(clone, x), plain(x), rtol=1e-5, atol=1e-5)
    # with autograd the plain weight is used, and gradients flow to it
    x.requires_grad_(True)
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, torch.ones(6, 40).T @ x.detach())


def test_prepacked_layer_built_in_inference_mode():
    with torch.inference_mode():
        lin = torch.nn.Linear(8, 4)
        cpu_gemm.route_linears(lin, prepack=True)
        x = torch.randn(2, 8)
        torch.testing.assert_close(_settle(lin, x), x @ lin.weight.T + lin.bias)


def test_engine_serves_the_pushed_weights_not_a_stale_pack(tiny_model):
    """A push that writes through ``.data`` (as weight fitting does) must reach the next forward."""
    from transformers import AutoModelForCausalLM

    from agentrl.inference.engine import Engine
    from agentrl.inference.sampling import EngineSampling

    def push(model):  # every MLP's output projection zeroed, through .data (no version bump)
        for name, p in model.named_parameters():
            if "down_proj" in name:
                p.data.copy_(torch.zeros_like(p))

    prompt = [5, 6, 7, 8]
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        old = ref(input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1).max().item()
        push(ref)
        new = ref(input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1).max().item()
    assert abs(new - old) > 1e-2  # the push changes what the engine must report

    eng = Engine(tiny_model, max_batch_size=2, max_model_len=64, device="cpu", dtype="float32", cpu_linear="packed",
                 enable_prefix_caching=False)  # fmt: skip
    try:
        greedy = EngineSampling(max_tokens=1, temperature=0.0)
        assert eng.submit(prompt, greedy).result(timeout=60)[0].logprobs[0] == pytest.approx(old, abs=1e-4)
        eng.update_weights(push)
        assert eng.submit(prompt, greedy).result(timeout=60)[0].logprobs[0] == pytest.approx(new, abs=1e-4)
    finally:
        eng.close()


def test_engine_refuses_an_unknown_cpu_linear(tiny_model):
    from agentrl.errors import EngineStartError
    from agentrl.inference.engine import Engine

    with pytest.raises(EngineStartError, match=re.escape("cpu_linear must be packed | onednn | torch; got 'fast'")):
        Engine(tiny_model, max_batch_size=2, max_model_len=64, device="cpu", cpu_linear="fast")
