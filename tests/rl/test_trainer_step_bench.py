"""benchmarks/trainer_step.py --dtype-compare: its one switched trainer is a float32 trainer and a bf16 one.

The benchmark times bf16 autocast against float32 with one trainer whose autocast it switches
between steps (two 135M trainers with their AdamW state would not fit a laptop twice).  These tests
check that a step after each switch is exactly the step of a trainer a run builds with that
``trainer.dtype``, and that the script prints its ratio.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from benchmark_module import load_benchmark

from agentrl.trainer.trainer import Trainer
from agentrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
SHAPE = Namespace(groups=2, group_size=2, prompt=12, turns=2, sampled=6, forced=4, vocab=300)


@pytest.mark.parametrize("dtype,name", [("float32", "float32"), ("bfloat16", "bf16")])
def test_each_switch_steps_like_a_trainer_built_with_that_dtype(tiny_model, dtype, name):
    bench = load_benchmark("trainer_step")
    sampling = SamplingParams(temperature=1.0)
    batch = bench.groups(SHAPE, random.Random(0))
    switched, set_up = bench.dtype_switch(tiny_model, sampling, lr=1e-3)
    set_up(name)
    built = Trainer(tiny_model, bench.dtype_config(dtype, lr=1e-3), sampling)
    a, b = switched.step(batch), built.step(batch)
    assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    # and the two dtypes really differ (the switch is not a no-op)
    other = Trainer(tiny_model, bench.dtype_config("float32" if dtype == "bfloat16" else "bfloat16", lr=1e-3),
                    sampling).step(batch)  # fmt: skip
    assert a["grad_norm"] > 0 and other["grad_norm"] != a["grad_norm"]


def test_dtype_compare_prints_the_bf16_speedup():
    args = ["--dtype-compare", "--steps", "2", "--groups", "1", "--group-size", "2", "--hidden", "32", "--layers", "1"]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_step.py"), *args], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["trainer_bf16_speedup"] > 0 and out["bf16_tok_s"] > 0 and out["float32_tok_s"] > 0
    assert out["heldout_curve"] == "not measured by this script"
    assert "  float32: median" in run.stdout and "     bf16: median" in run.stdout
