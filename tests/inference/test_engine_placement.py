"""Where local engines run: spread over the GPUs the trainer leaves, else where they were told."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.errors import AgentrlError
from agentrl.inference.launcher import engine_devices


def test_engines_spread_over_the_gpus_the_trainer_leaves():
    assert engine_devices("auto", 2, 4, "auto") == ["cuda:1", "cuda:2"]
    assert engine_devices("auto", 4, 3, "cuda") == ["cuda:1", "cuda:2", "cuda:1", "cuda:2"]
    assert engine_devices("cuda", 3, 4, "cuda:2") == ["cuda:0", "cuda:1", "cuda:3"]
    assert engine_devices("auto", 1, 2, "auto") == ["cuda:1"]  # one engine still leaves the trainer its GPU
    assert engine_devices("auto", 3, 2, "cpu") == ["cuda:0", "cuda:1", "cuda:0"]


def test_one_gpu_none_or_an_explicit_device_is_every_engines():
    assert engine_devices("auto", 2, 1, "auto") == ["auto", "auto"]
    assert engine_devices("auto", 2, 0, "auto") == ["auto", "auto"]
    assert engine_devices("cuda:3", 2, 8, "auto") == ["cuda:3", "cuda:3"]
    assert engine_devices("cpu", 1, 8, "auto") == ["cpu"]
    with pytest.raises(ValueError, match="at least 1"):
        engine_devices("auto", 0, 2, "auto")


def test_a_gpu_the_host_does_not_have_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"trainer.device = 'cuda:7', but this host has 4 GPU"):
        engine_devices("auto", 2, 4, "cuda:7")
    with pytest.raises(ValueError, match=r"inference.device = 'cuda:x'"):
        engine_devices("cuda:x", 2, 4, "auto")
    assert engine_devices("auto", 1, 0, "cuda:3") == ["auto"]  # no GPUs here: the trainer reports its own device


class _Started(Exception):
    pass


def test_a_run_starts_its_engines_where_engine_devices_puts_them(monkeypatch, tmp_path):
    import torch

    from agentrl.recipes.engines import open_engines

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # a 3-GPU host; the trainer takes GPU 0
    seen: dict = {}

    def open_policy(model, base_urls=None, **kw):
        seen.update(kw)
        raise _Started

    monkeypatch.setattr("agentrl.inference.launcher.open_policy", open_policy)
    cfg = load_config([], ["--cluster.num_inference=2", f"--model.path={tmp_path}"])
    with pytest.raises(_Started):
        open_engines(cfg, tmp_path, threads=1)
    assert seen["engines"] == 2 and seen["devices"] == ["cuda:1", "cuda:2"]
    bad = load_config([], ["--cluster.num_inference=2", f"--model.path={tmp_path}", "--trainer.device=cuda:3"])
    with pytest.raises(AgentrlError, match="trainer.device = 'cuda:3', but this host has 3 GPU"):
        open_engines(bad, tmp_path, threads=1)  # a user error (exit 2), before any engine starts


def test_open_policy_starts_each_engine_on_its_own_device(monkeypatch, tmp_path, small_model):
    from agentrl.inference import EngineArgs, launcher, open_policy

    model = small_model
    with pytest.raises(ValueError, match="1 devices for 2 engines"):
        open_policy(model, engines=2, devices=["cpu"])

    started: list[EngineArgs] = []

    class Handle:  # what open_policy reads of a started engine
        model = "tiny"

        def __init__(self, i: int) -> None:
            self.base_url = f"http://127.0.0.1:{9000 + i}/v1"

    def start(model_dir, args=None, **kw):
        started.append(args)
        return Handle(len(started))

    monkeypatch.setattr(launcher, "start_embedded_engine", start)
    args = EngineArgs(max_batch_size=8)
    policy = open_policy(model, engines=2, args=args, devices=["cuda:1", "cuda:2"])
    assert [a.device for a in started] == ["cuda:1", "cuda:2"]
    assert all(a.max_batch_size == 8 for a in started) and args.device == "auto"  # the caller's args untouched
    assert len(policy.base_urls) == 2
