"""--resume from a complete checkpoint trains no SFT warm start: the checkpoint holds the weights.

It reran the whole warm start whenever its cache entry was gone (any agentrl upgrade changes the
key), then overwrote it with the checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.recipes import rl, sft
from agentrl.recipes.rl import train as run_training

pytestmark = pytest.mark.slow


def _cfg(model: Path, run_dir: Path, **extra: object):
    over = {
        "run.dir": run_dir, "model.path": model, "env.name": "calc", "sft.steps": 3, "sft.batch_size": 4,
        "sft.num_demos": 8, "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 24,
        "rollout.max_turns": 2, "trainer.batch_groups": 2, "buffer.filter_zero_variance": "false", "eval.every": 0,
        "trainer.checkpoint_every": 1, "trainer.num_threads": 1, "inference.max_batch_size": 16, **extra,
    }
    return load_config([], [f"--{k}={v}" for k, v in over.items()])


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture
def model(tiny_model, tmp_path) -> Path:
    # the SFT cache is written beside the model: a copy of the shared one keeps it in this test's dir
    return Path(shutil.copytree(tiny_model, tmp_path / "models" / "tiny"))


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_resume_without_the_warm_start_cache_trains_no_sft(model, tmp_path, monkeypatch, lora):
    run_dir = tmp_path / "run"
    run_training(_cfg(model, run_dir, **{"trainer.steps": 2, "trainer.lora_rank": lora}), progress=False)
    [entry] = model.parent.glob("tiny-sft-*")
    warm = _weights(entry)
    shutil.rmtree(entry)  # gone, as after an upgrade that changes the key

    sft_runs: list[Path] = []
    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: sft_runs.append(k["out_dir"]))
    engine_models: list[Path] = []
    real_open = rl.open_engines

    def recording(cfg, start_model, *args, **kwargs):
        engine_models.append(Path(start_model))
        return real_open(cfg, start_model, *args, **kwargs)

    monkeypatch.setattr(rl, "open_engines", recording)
    run_training(_cfg(model, run_dir, **{"trainer.steps": 3, "trainer.lora_rank": lora}), resume=True, progress=False)

    assert sft_runs == [] and not list(model.parent.glob("tiny-sft-*"))  # no warm start trained, no entry written
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]  # continued from step 2
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").is_file() and (run_dir / "final").is_dir()
    [start] = engine_models
    if lora:  # the engine adds pushed adapters to the weights it holds: they must be the warm start's, exactly
        served = _weights(start)
        assert served.keys() == warm.keys()
        assert all(served[k].equal(warm[k]) for k in warm)
