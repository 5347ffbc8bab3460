"""Adapter-only weight pushes: the engine merges LoRA factors into its own base weights.

A LoRA trainer changes ``W = W0 + B·A`` only through the small factors ``A`` (r × in) and
``B`` (out × r, with the LoRA scaling folded in).  Pushing those instead of merged weights
moves ``r·(in + out)`` numbers per adapted matrix instead of ``in·out``: for a 7B model at
rank 16 that is well under 1% of the bytes.  The engine keeps a copy of each adapted
matrix's base ``W0`` (taken at the first adapter push) and recomputes ``W0 + B·A`` in
place on every push, so repeated pushes never accumulate.

Tensor names: ``{module}.lora_A`` and ``{module}.lora_B`` where ``{module}.weight`` is a
weight of the served (plain HF) model, e.g. ``model.layers.0.self_attn.q_proj.lora_A``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from agentrl.errors import RequestError

SUFFIX_A, SUFFIX_B = ".lora_A", ".lora_B"


def split_adapter_name(name: str) -> tuple[str, str]:
    """``"m.q_proj.lora_A"`` → ``("m.q_proj", "A")``; anything else is a request error."""
    for suffix, part in ((SUFFIX_A, "A"), (SUFFIX_B, "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    raise RequestError(f"adapter tensor {name!r} must end in {SUFFIX_A!r} or {SUFFIX_B!r}")


def adapted_matrix(params: dict[str, torch.Tensor], module: str, ab: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """The 2-D weight ``{module}.weight`` that (A, B) factors of these shapes adapt; a request
    error unless both are given and fit it (A: r × in, B: out × r)."""
    if set(ab) != {"A", "B"}:
        raise RequestError(f"adapter for {module!r} needs both lora_A and lora_B")
    w = params.get(module + ".weight")
    if w is None or w.dim() != 2:
        raise RequestError(f"unknown adapted matrix {module + '.weight'!r}")
    (out_f, in_f), a, b = w.shape, ab["A"], ab["B"]
    if len(a) != 2 or len(b) != 2 or a[1] != in_f or b[0] != out_f or a[0] != b[1]:
        raise RequestError(f"adapter shapes for {module!r} do not fit {tuple(w.shape)}: A {a}, B {b}")
    return w


class AdapterMerger:
    """Applies adapter pushes to a model: ``W = W0 + B·A`` for every adapted matrix."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}  # weight name -> W0 (the weights before any adapter)
        self._pending: dict[str, torch.Tensor] = {}  # W0 of a matrix a push being checked adapts first

    def reset(self) -> None:
        """The base weights were replaced (a full push): forget the saved ``W0``."""
        self._base.clear()
        self._pending.clear()

    @torch.no_grad()
    def apply(self, model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Merge every (A, B) pair; validates everything (shapes, finite merged weights) before
        changing any weight."""
        self._pending.clear()  # left by a push refused before its writes
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors:
            module, part = split_adapter_name(name)
            factors.setdefault(module, {})[part] = t
        params = dict(model.named_parameters())
        plan = []
        for module, ab in factors.items():
            w = adapted_matrix(params, module, {part: tuple(t.shape) for part, t in ab.items()})
            plan.append((module + ".weight", w, ab["A"], ab["B"]))
        # finite factors can still merge to Inf (1e20 · 1e20), or overflow the served dtype: every
        # merged matrix is checked before the first is written, one at a time (no second model in memory)
        from agentrl.weights.fit import check_finite  # fit imports this module

        for wname, w, a, b in plan:
            check_finite([(wname, self._merged(wname, w, a, b))])
        for wname, w, a, b in plan:
            w.data.copy_(self._merged(wname, w, a, b))
            if wname in self._pending:  # its first adapter push: W0 is kept from now on
                self._base[wname] = self._pending.pop(wname)
        return len(plan)

    def _merged(self, wname: str, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``W0 + B·A`` in the served dtype (``W0``: the weight before any adapter, saved at the first push)."""
        base = self._base.get(wname)
        if base is None:
            base = self._pending.get(wname)
            if base is None:
                base = self._pending[wname] = w.detach().clone()
        merged = torch.addmm(base.float(), b.to(w.device, torch.float32), a.to(w.device, torch.float32))
        return merged.to(w.dtype)
