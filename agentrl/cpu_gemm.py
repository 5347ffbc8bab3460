"""Float32 linear layers on a CPU through oneDNN instead of torch's default BLAS (MKL).

torch's float32 ``F.linear`` calls MKL's sgemm.  MKL picks its code path by CPU vendor: on an
AMD EPYC with AVX-512 (Zen 4/5) it runs its AVX2 kernels, ~100 GFLOP/s on one core, while
oneDNN (shipped inside the same torch, and what vLLM's CPU build calls) picks its kernels by
the CPU's instruction set and runs the same products at ~2x that rate.  Measured there, one
thread, SmolLM2-135M's shapes: the MLP's 1536x576 product 1.05x faster at 1 row, 1.77x at 16,
2.2x at 64 to 2,048; the 49,152-row LM head 1.6x at 1 row and 2.1-2.3x from 16 rows.  On a
CPU where MKL already runs its best kernels the two measured even.  bf16 products already go
through oneDNN in torch, so only float32 layers are routed.

:func:`route_linears` makes every float32 CPU ``nn.Linear`` of a model compute through oneDNN,
with an autograd rule of its own so training works too (its three products go through oneDNN
as well).  The module keeps its ``weight`` and ``bias`` parameters: optimizers, state dicts and
in-place weight updates see the same tensors as before.  Anything the route does not cover
falls back to ``F.linear`` call by call: another dtype or device, autocast, tensor subclasses
(FSDP's sharded parameters), a torch without the oneDNN op.  Results differ from MKL's only
by float32 summation order (relative ~1e-6).
"""

from __future__ import annotations

import types
from functools import cache

import torch
import torch.nn.functional as F


@cache
def available() -> bool:
    """Does this torch have oneDNN's linear op (a CPU build with mkldnn)?"""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` through oneDNN (``x``: [..., K], ``w``: [N, K], either may be a strided view)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


class _Linear(torch.autograd.Function):
    """``x @ W.T + b`` with all three products of forward and backward in oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm_t(grad, weight.t())  # grad @ W
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            g2 = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = _mm_t(g2.t(), x.reshape(-1, x.shape[-1]).t())  # grad.T @ x
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb


def _covered(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and (bias is None or (bias.dtype == torch.float32 and type(bias) in (torch.Tensor, torch.nn.Parameter)))
        and x.dim() >= 2
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN where covered (see the module docstring), ``F.linear`` otherwise."""
    if not _covered(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


_PACK = "_agentrl_packed"  # a prepacked layer's (weight's identity, its packed copy), or None: pack at next use


def _weight_key(w: torch.Tensor) -> tuple[int, int, int]:
    # an in-place write bumps _version; a new tensor or storage changes id or data_ptr.  Writes
    # through .data bump nothing: whoever makes them calls invalidate_packs (the engine does)
    return id(w), w.data_ptr(), w._version


def _forward_packed(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = self.weight, self.bias
    if torch.is_grad_enabled() or not _covered(x, w, b):
        return linear(x, w, b)
    packed = getattr(self, _PACK)
    key = _weight_key(w)
    if packed is None or packed[0] != key:
        packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
        setattr(self, _PACK, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed[1], b, "none", [], "")


def route_linears(model: torch.nn.Module, prepack: bool = False) -> int:
    """Make each ``nn.Linear`` of ``model`` compute through :func:`linear`; returns how many.

    ``prepack``: forwards without autograd (an inference engine's) use a copy of each weight in
    oneDNN's blocked layout, made at first use and again whenever the weight changes: ~15 % less
    time than the plain weight at 64 rows, ~30 % at 1-16 rows, for one more copy of the linear
    weights in memory.  A weight written through ``.data`` goes unnoticed: call
    :func:`invalidate_packs` after such writes.  Forwards with autograd use the plain weight.

    A no-op (0) where torch has no oneDNN.  Only the module instances' ``forward`` changes;
    their parameters, hooks and state dict stay as they were.
    """
    if not available():
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and "forward" not in mod.__dict__:
            if prepack:
                setattr(mod, _PACK, None)
            mod.forward = types.MethodType(_forward_packed if prepack else _forward, mod)
            n += 1
    return n


def invalidate_packs(model: torch.nn.Module) -> None:
    """Drop every prepacked weight copy of ``model``; each is made again at its layer's next use."""
    for mod in model.modules():
        if getattr(mod, _PACK, None) is not None:
            setattr(mod, _PACK, None)
