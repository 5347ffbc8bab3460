"""bf16 where the CPU has it and it was measured faster (agentrl.precision), in the trainer,
the SFT loop and the engine; float32 for the tiny model."""

from __future__ import annotations

import warnings

import pytest
import torch

from agentrl import precision
from agentrl.config import TrainerConfig
from agentrl.inference import model_support
from agentrl.tiny_model import build_family_model
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory


def test_the_rule(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.use_bf16("auto", 576, "cpu")  # SmolLM2-135M on a bf16 CPU
    assert not precision.use_bf16("auto", 128, "cpu")  # the tiny model: its decode measured slower in bf16
    assert not precision.use_bf16("auto", 576, "cuda")  # GPUs keep their own defaults
    assert not precision.use_bf16("float32", 576, "cpu")
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert not precision.use_bf16("auto", 576, "cpu")
    with pytest.warns(precision.EmulatedBF16Warning, match="without native bf16"):
        assert precision.use_bf16("bfloat16", 64, "cpu")  # asked for: always, with a warning where it is emulated
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.use_bf16("bfloat16", 64, "cpu")  # native: no warning
        assert precision.use_bf16("bfloat16", 64, "cuda")


def test_cpu_flags_are_read_from_cpuinfo():
    flags = open("/proc/cpuinfo").read()
    precision.cpu_has_bf16.cache_clear()
    assert precision.cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    # 2 layers, hidden 512: wide enough for auto to pick bf16 on a bf16 CPU
    return build_family_model(tmp_path_factory.mktemp("m") / "wide", "llama", hidden_size=512,
                              num_attention_heads=8, intermediate_size=256)


def test_engine_auto_runs_a_float32_checkpoint_in_bf16_on_a_bf16_cpu(wide, monkeypatch):
    for has, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda has=has: has)
        model, _ = model_support.load_model(wide, "auto", torch.device("cpu"))
        assert model.dtype == want
    model, _ = model_support.load_model(wide, "float32", torch.device("cpu"))
    assert model.dtype == torch.float32


def _groups():
    s1, s2 = TokenSequence(), TokenSequence()
    for s, tail in ((s1, [40, 41, 42]), (s2, [50, 51, 52])):
        s.extend_forced([1, 5, 6, 7])
        s.extend_sampled(tail, [-1.0] * 3, [0] * 3)
    task = Task(prompt=[Message("user", "q")])
    g = Group(task=task, trajectories=[Trajectory(task=task, sequences=[s1], reward=1.0),
                                       Trajectory(task=task, sequences=[s2], reward=0.0)])  # fmt: skip
    g.assign_advantages()
    return [g]


def test_trainer_bf16_autocast_keeps_float32_weights_and_close_logprobs(wide):
    cfg = dict(lr=1e-3, steps=4, loss={"name": "ppo", "clip_eps": 10.0})
    f32 = Trainer(wide, TrainerConfig.model_validate({**cfg, "dtype": "float32"}))
    b16 = Trainer(wide, TrainerConfig.model_validate({**cfg, "dtype": "bfloat16"}))
    assert not f32.bf16 and b16.bf16
    rows = [r for g, first in zip(_groups(), [0], strict=True) for r in b16._rows(g, first)]
    x32, x16 = f32._tensors(rows), b16._tensors(rows)
    with torch.no_grad():
        lp32, _, _ = f32._policy_logprobs(rows, x32)
        lp16, _, _ = b16._policy_logprobs(rows, x16)
    assert lp16.dtype == torch.float32
    assert not torch.equal(lp16, lp32)  # bf16 really ran
    # bf16 keeps ~3 significant digits; this model's logprobs are large (-12 to -20 nats)
    assert ((lp16 - lp32).abs() / lp32.abs()).max() < 0.03
    stats = b16.step(_groups())
    assert stats["grad_norm"] > 0 and all(p.dtype == torch.float32 for p in b16.model.parameters())
