"""What a weight push must fit before anything is swapped: the served model's own tensors
(a full push names each exactly once, its shape, a fitting dtype), its 2-D weights (a LoRA
push: (A, B) pairs of one rank), finite values; and the swap of checked views into the model.

Every refusal is a :class:`~agentrl.errors.RequestError` (an HTTP 4xx), raised before any
weight changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.errors import RequestError
from agentrl.weights.lora import adapted_matrix, split_adapter_name
from agentrl.weights.manifest import DTYPES

FLOAT_PUSH_DTYPES = ("float32", "float16", "bfloat16")  # at most 4 bytes per model element


def named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by name, as a push names them (parameters and buffers)."""
    return dict(model.state_dict(keep_vars=True))


def check_named_tensors(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs, every name and shape checked before anything is copied."""
    targets = named_targets(model)
    pairs = []
    for name, t in tensors:
        dst = targets.get(name)
        if dst is None:
            raise RequestError(f"unknown weight name {name!r} (model has e.g. {next(iter(targets))!r})")
        if tuple(dst.shape) != tuple(t.shape):
            raise RequestError(f"shape mismatch for {name!r}: model {tuple(dst.shape)}, got {tuple(t.shape)}")
        if not torch.is_floating_point(t) and torch.is_floating_point(dst):
            raise RequestError(f"dtype mismatch for {name!r}: model {dst.dtype}, got {t.dtype}")
        pairs.append((dst, t))
    return pairs


def check_full_manifest(model: torch.nn.Module, manifest: list[dict[str, Any]]) -> None:
    """A full push: every tensor of the model exactly once, its exact shape, a fitting dtype."""
    targets = named_targets(model)
    seen: set[str] = set()
    for entry in manifest:
        name, dtype, shape = entry["name"], entry["dtype"], tuple(entry["shape"])
        dst = targets.get(name)
        if dst is None:
            raise RequestError(f"unknown weight name {name!r} (model has e.g. {next(iter(targets))!r})")
        if name in seen:
            raise RequestError(f"weight {name!r} is named twice")
        seen.add(name)
        if tuple(dst.shape) != shape:
            raise RequestError(f"shape mismatch for {name!r}: model {tuple(dst.shape)}, got {shape}")
        fits = dtype in FLOAT_PUSH_DTYPES if torch.is_floating_point(dst) else DTYPES.get(dtype) == dst.dtype
        if not fits:
            raise RequestError(f"dtype mismatch for {name!r}: model {dst.dtype}, got {dtype}")
    missing = [n for n in targets if n not in seen]
    if missing:
        raise RequestError(f"partial push refused: it names {len(seen)} of the model's {len(targets)} tensors "
                      f"(missing e.g. {missing[0]!r}); push every tensor, or LoRA factors with lora=true",
                      code="partial_push")


@dataclass(frozen=True)
class AdapterSpec:
    """What a LoRA push must look like: the adapted modules and the rank (fixed by the first one)."""

    modules: frozenset[str]
    rank: int


def check_adapter_manifest(model: torch.nn.Module, manifest: list[dict[str, Any]],
                           spec: AdapterSpec | None) -> AdapterSpec:
    """A LoRA push: (A, B) pairs fitting the model's 2-D weights, one rank, matching ``spec``."""
    params = dict(model.named_parameters())
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    for entry in manifest:
        module, part = split_adapter_name(entry["name"])
        if entry["dtype"] not in FLOAT_PUSH_DTYPES:
            raise RequestError(f"adapter factor {entry['name']!r} must be one of {FLOAT_PUSH_DTYPES}, not {entry['dtype']}")
        if part in factors.setdefault(module, {}):
            raise RequestError(f"adapter factor {entry['name']!r} is named twice")
        factors[module][part] = tuple(entry["shape"])
    ranks = set()
    for module, ab in factors.items():
        w = adapted_matrix(params, module, ab)
        a, b = ab["A"], ab["B"]
        if not 1 <= a[0] <= min(w.shape):  # a rank above min(out, in) adds no rank, only bytes
            raise RequestError(f"adapter shapes for {module!r} do not fit {tuple(w.shape)}: A {a}, B {b}")
        ranks.add(a[0])
    if not factors:
        raise RequestError("an adapter push needs at least one (lora_A, lora_B) pair")
    if len(ranks) != 1:
        raise RequestError(f"adapter factors of one push must share one rank, got {sorted(ranks)}")
    pushed = AdapterSpec(frozenset(factors), ranks.pop())
    if spec is not None and pushed != spec:
        raise RequestError(f"adapter push does not match the adapters being served ({len(spec.modules)} modules at rank "
                      f"{spec.rank}; this push: {len(pushed.modules)} at rank {pushed.rank}); a full push resets them",
                      code="partial_push")
    return pushed


def check_finite(views: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse NaN or Inf anywhere (the engine would serve empty text from such weights)."""
    for name, t in views:
        if not torch.is_floating_point(t) or t.numel() == 0:
            continue
        # min and max carry any NaN and any ±Inf: one pass, no tensor-sized temporary (isfinite's
        # bool mask cost 25x more on a 50M-element tensor)
        if not bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
            raise RequestError(f"weight {name!r} contains NaN or Inf: push refused, the served weights are unchanged",
                          code="non_finite")


def swap_in(model: torch.nn.Module, views: list[tuple[str, torch.Tensor]]) -> int:
    """Load checked views: a CPU parameter of the same dtype is pointed at its view (the buffer is
    never written again while it is live), anything else is copied."""
    pairs = check_named_tensors(model, views)
    for (_, view), (dst, _) in zip(views, pairs, strict=True):
        if dst.device.type == "cpu" and dst.dtype == view.dtype:
            dst.data = view
        else:
            dst.data.copy_(view)
    return len(pairs)
