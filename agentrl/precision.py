"""Which float type a model computes in on a CPU: bf16 where the CPU has native bf16 and it
was measured faster, float32 elsewhere (torch-free until asked).

``benchmarks/cpu_dtype.py`` on an AMD EPYC with avx512_bf16 (one thread, CPU seconds):

| model | trainer fwd+bwd, bf16 autocast | engine decode, bf16 weights |
|---|---|---|
| SmolLM2-135M (hidden 576) | 1.58x faster | 1.18x faster |
| tiny (hidden 128) | 1.20x faster | 0.76x (slower) |

(float32 through MKL).  With float32 through oneDNN (:mod:`agentrl.cpu_gemm`, Zen 5) SmolLM2's
decode step is even in both (1.01x) and agentrl's trainer step still 1.25x faster in bf16
(``benchmarks/trainer_step.py --dtype-compare``), so ``auto`` picks bf16 for models at least :data:`BF16_MIN_HIDDEN` wide, for the trainer and
the engine alike (one rule, so the two sides' numerics match), and leaves the tiny model in
float32.  Without native bf16 torch emulates it: on an AMD EPYC with AVX2 only, SmolLM2-135M's
trainer step took 64.9 s in bf16 autocast against 6.9 s in float32 (``benchmarks/trainer_step.py
--dtype-compare``), so ``auto`` stays float32 there and an explicit ``bfloat16`` is warned about.
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path

BF16_MIN_HIDDEN = 512
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_has_bf16() -> bool:
    """Does this CPU compute bf16 natively (``avx512_bf16`` or ``amx_bf16``; Linux)?"""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in _BF16_FLAGS)


class EmulatedBF16Warning(RuntimeWarning):
    """bf16 asked for on a CPU that emulates it (measured ~10x slower than float32)."""


def use_bf16(choice: str, hidden_size: int, device_type: str) -> bool:
    """``choice`` (auto | float32 | bfloat16) resolved for a model of ``hidden_size`` on a device."""
    if choice == "auto":
        return device_type == "cpu" and hidden_size >= BF16_MIN_HIDDEN and cpu_has_bf16()
    if choice == "bfloat16" and device_type == "cpu" and not cpu_has_bf16():
        warnings.warn("dtype 'bfloat16' on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
                      "torch emulates it, measured ~10x slower than float32 here; set dtype 'auto' or 'float32'",
                      EmulatedBF16Warning, stacklevel=2)  # fmt: skip
    return choice == "bfloat16"
