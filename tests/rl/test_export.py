"""`agentrl export`: a real run keeps the newest `trainer.keep_checkpoints` checkpoints, and each
exports as an HF model dir that `from_pretrained` and `agentrl serve` load (LoRA merged)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from agentrl_cli import agentrl

from agentrl.config import load_config
from agentrl.recipes.rl import train as run_training
from agentrl.trainer.checkpoint import complete_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow


ODD_LENGTH_ENV = """\
from agentrl.envs import SingleTurnEnv
from agentrl.rubrics import Rubric


def odd_length(completion) -> float:  # rewards that differ within a group: every step moves the weights
    return float(len(completion) % 2)


def load_environment():
    return SingleTurnEnv(dataset=[f"Say something #{i}" for i in range(50)], rubric=Rubric([odd_length]))
"""


def _run(model: Path, run_dir: Path, lora: int) -> None:
    env = run_dir.parent / "odd_env"
    env.mkdir()
    (env / "odd_env_mod.py").write_text(ODD_LENGTH_ENV)
    (env / "pyproject.toml").write_text('[project]\nname = "odd-env"\nversion = "0"\n'
                                        '[project.entry-points."agentrl.environments"]\nodd-env = "odd_env_mod:load_environment"\n')
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": env,
        "rollout.group_size": 4, "rollout.max_in_flight": 8, "rollout.max_tokens": 16, "rollout.max_turns": 1,
        "trainer.batch_groups": 2, "buffer.filter_zero_variance": "false", "eval.every": 0, "trainer.num_threads": 1,
        "inference.max_batch_size": 8, "trainer.steps": 3, "trainer.checkpoint_every": 1,
        "trainer.keep_checkpoints": 2, "trainer.lora_rank": lora, "trainer.lr": 1e-2,
    }
    run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)


def _expected(model: Path, run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds, as the trainer itself merges them."""
    from agentrl.trainer.trainer import Trainer

    cfg = load_config([run_dir / "config.toml"])
    trainer = Trainer(model, cfg.trainer)
    trainer.load_state_dict(load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")[0])
    return {k: v.detach().clone() for k, v in trainer.merged_model().state_dict().items()}


def _exported(out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(out).state_dict())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_kept_checkpoints_export_as_models_that_load_and_serve(tiny_model, tmp_path, lora):
    run_dir = tmp_path / "run"
    _run(tiny_model, run_dir, lora)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000002", "step_00000003"]  # keep = 2

    gone = agentrl("export", str(run_dir), "--step", "1", "--out", str(tmp_path / "s1"))
    assert gone.returncode == 2 and "no complete checkpoint of step 1" in gone.stderr and "kept: 2, 3" in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1

    r = agentrl("export", str(run_dir), "--step", "2", "--out", str(tmp_path / "s2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("LoRA merged" in r.stdout) == bool(lora)
    latest = agentrl("export", str(run_dir), "--out", str(tmp_path / "latest"))
    assert latest.returncode == 0, latest.stderr[-3000:]
    meta = json.loads((tmp_path / "s2" / "agentrl_export.json").read_text())
    assert meta["step"] == 2 and meta["lora_merged"] == bool(lora)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "s2" / f).is_file(), f

    s2, s3 = _exported(tmp_path / "s2"), _exported(tmp_path / "latest")
    assert not any(".lora_" in k or "base_layer" in k for k in s2)  # a plain model
    assert _same(s2, _expected(tiny_model, run_dir, 2))
    assert _same(s3, _expected(tiny_model, run_dir, 3)) and not _same(s2, s3)
    assert _same(s3, _exported(run_dir / "final"))  # the latest checkpoint is what the run finished with
    if lora:
        _serves(tmp_path / "s2")


def _serves(model_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", str(model_dir), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                time.sleep(0.2)
        models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=10).read())
        name = models["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": "What is 2+3?", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"content-type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
