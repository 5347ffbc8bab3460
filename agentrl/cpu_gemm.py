"""Float32 linear layers on a CPU through oneDNN instead of torch's default BLAS (MKL).

torch's float32 ``F.linear`` calls MKL's sgemm.  MKL picks its code path by CPU vendor: on an
AMD EPYC with AVX-512 (Zen 4/5) it runs its AVX2 kernels, ~100 GFLOP/s on one core, while
oneDNN (shipped inside the same torch, and what vLLM's CPU build calls) picks its kernels by
the CPU's instruction set and runs the same products at ~2x that rate.  Measured there, one
thread, SmolLM2-135M's shapes: the MLP's 1536x576 product 1.05x faster at 1 row, 1.77x at 16,
2.2x at 64 to 2,048; the 49,152-row LM head 1.6x at 1 row and 2.1-2.3x from 16 rows.  On an
AVX2-only EPYC (Zen 3) oneDNN measured no faster than MKL.  bf16 products already go through
oneDNN in torch, so only float32 layers are routed.

:func:`route_linears` makes every float32 CPU ``nn.Linear`` of a model compute through oneDNN,
with an autograd rule of its own so training works too (its three products go through oneDNN
as well; first-order reverse mode only: a double backward raises).  The module keeps its
``weight`` and ``bias`` parameters: optimizers, state dicts and in-place weight updates see
the same tensors as before.  Anything the route does not cover falls back to ``F.linear``
call by call: another dtype or device, autocast, tensor subclasses (DTensor), an empty
input, oneDNN switched off (``torch.backends.mkldnn.flags(enabled=False)``).  FSDP2 swaps
plain unsharded parameters in around each forward, so a sharded model runs through oneDNN
too.  Results differ from MKL's only by float32 summation order (relative ~1e-6).
"""

from __future__ import annotations

import weakref
from functools import cache

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


@cache
def _has_op() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available() -> bool:
    """Can linear layers run through oneDNN here (a CPU build with mkldnn, not switched off)?"""
    return _has_op() and torch.backends.mkldnn.enabled


def _mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` through oneDNN (``x``: [..., K], ``w``: [N, K], either may be a strided view)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


class _Linear(torch.autograd.Function):
    """``x @ W.T + b`` with all three products of forward and backward in oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # keep only what the wanted gradients read (a frozen layer does not hold its input)
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    @once_differentiable  # the backward's products have no autograd rule: a double backward must raise
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
        and x.numel() > 0  # oneDNN refuses empty products; F.linear gives zeros
        and weight.shape[1] > 0
        and not torch.is_autocast_enabled("cpu")
        and torch.backends.mkldnn.enabled
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN where covered (see the module docstring), ``F.linear`` otherwise."""
    if not _covered(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` that computes through :func:`linear` (what :func:`route_linears` makes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


PACK_AFTER = 16  # forwards a weight serves unchanged before it is packed (packing costs about a forward's weight reads)


class PackedLinear(OneDNNLinear):
    """:class:`OneDNNLinear` whose forwards without autograd use a copy of the weight in oneDNN's
    blocked layout.  The copy is made once the weight has served :data:`PACK_AFTER` forwards
    unchanged (so a model whose weights change every few steps never pays for packing it
    cannot use) and dropped when the weight changes.  A change is noticed when the weight is a
    new tensor, has new storage, or its version moved (an ordinary in-place write).  Writes that
    move no version go unnoticed: through ``.data``, fused optimizer steps, peft merges.  Call
    :func:`invalidate_packs` after those (the engine does, after every weight update)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if torch.is_grad_enabled() or not _covered(x, w, b):
            return linear(x, w, b)
        state = self.__dict__.get("_pack")
        version = 0 if w.is_inference() else w._version  # inference tensors keep no version
        if state is None or state[0]() is not w or state[1] != w.data_ptr() or state[2] != version:
            state = [weakref.ref(w), w.data_ptr(), version, 0, None]  # weight, storage, version, uses, pack
            self.__dict__["_pack"] = state
        state[3] += 1
        if state[4] is None and state[3] > PACK_AFTER:
            state[4] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        return torch.ops.mkldnn._linear_pointwise(x, state[4] if state[4] is not None else w, b, "none", [], "")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_pack"}  # an opaque oneDNN tensor neither copies nor pickles


def route_linears(model: torch.nn.Module, prepack: bool = False) -> int:
    """Make each ``nn.Linear`` of ``model`` compute through :func:`linear`; returns how many.

    ``prepack``: :class:`PackedLinear` (for an inference engine's forwards: ~15 % less time than
    the plain weight at 64 rows, ~30 % at 1-16 rows, for one more copy of the linear weights in
    memory); else :class:`OneDNNLinear`.  Only plain ``nn.Linear`` modules change (their class,
    so they still copy and pickle): a subclass with a forward of its own (a router, a peft or
    quantized layer) keeps it, as does a module whose forward was replaced.  Parameters, hooks
    and state dict stay as they were.  A no-op (0) where oneDNN is not :func:`available`.
    """
    if not available():
        return 0
    cls = PackedLinear if prepack else OneDNNLinear
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and "forward" not in mod.__dict__:
            mod.__class__ = cls
            n += 1
    return n


def invalidate_packs(model: torch.nn.Module) -> None:
    """Drop every packed weight copy of ``model`` (made again once each weight has served
    :data:`PACK_AFTER` forwards)."""
    for mod in model.modules():
        mod.__dict__.pop("_pack", None)
