"""The SFT warm-start cache: keyed by everything that shapes the weights (code versions, the rendered
demonstrations, seed, config), and an entry is verified (manifest + weights hash) before reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit import env_package

from agentrl.config import load_config
from agentrl.errors import UserCodeError
from agentrl.recipes import sft
from agentrl.recipes.sft import MANIFEST, MARKER, cache_inputs, sft_cache_key, warm_start

# demonstrations read from a data file beside the package: editing it changes what SFT learns
# without touching any config value (the old key, config only, reused the stale entry)
ENV = """\
import json, pathlib
from agentrl.envs import SingleTurnEnv
from agentrl.rubrics import Rubric

HERE = pathlib.Path(__file__).parent


class Echo(SingleTurnEnv):
    def demonstrations(self, n, seed=0):
        answers = json.loads((HERE / "answers.json").read_text())
        if answers == "raise":
            raise OSError("answers.json is not a list")
        return [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answers[i % len(answers)]}]
                for i in range(n)]


def load_environment():
    return Echo(dataset=["q"], rubric=Rubric([lambda completion: 1.0]))
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=32, heads=2)


@pytest.fixture
def env_dir(tmp_path) -> Path:
    return env_package(tmp_path / "echo_env", "echo-env", "echo_env_mod", ENV,
                       files={"answers.json": json.dumps(["four", "five"])})


def _cfg(base: Path, env_dir: Path, *extra: str):
    return load_config([], [f"--model.path={base}", f"--env.name={env_dir}", "--sft.steps=2", "--sft.batch_size=4",
                            "--sft.num_demos=8", "--trainer.device=cpu", *extra])


def _builds(monkeypatch) -> list[Path]:
    """Count real SFT trainings (a reuse trains nothing)."""
    calls: list[Path] = []
    real = sft.train_sft

    def counting(*args, **kwargs):
        calls.append(kwargs["out_dir"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sft, "train_sft", counting)
    return calls


def test_a_verified_entry_is_reused_and_changed_data_gets_a_new_key(base, env_dir, monkeypatch):
    builds = _builds(monkeypatch)
    first = warm_start(_cfg(base, env_dir), progress=False)
    manifest = json.loads((first / MANIFEST).read_text())
    assert (first / MARKER).is_file() and set(manifest["weights"]) == {"model.safetensors"}
    assert manifest["key"] == first.name.rsplit("-", 1)[1]
    assert set(manifest["inputs"]) >= {"code", "model", "data", "env", "sft", "seed", "device"}
    assert set(manifest["inputs"]["code"]) == {"agentrl", "sft_source", "torch", "transformers"}
    assert warm_start(_cfg(base, env_dir), progress=False) == first and len(builds) == 1  # reused

    (env_dir / "answers.json").write_text(json.dumps(["four", "six"]))  # same config, other data
    second = warm_start(_cfg(base, env_dir), progress=False)
    assert second != first and len(builds) == 2
    third = warm_start(_cfg(base, env_dir, "--run.seed=1"), progress=False)
    assert third not in (first, second) and len(builds) == 3


def test_a_tampered_or_unverifiable_entry_is_rebuilt_with_a_note(base, env_dir, monkeypatch, capsys):
    builds = _builds(monkeypatch)
    entry = warm_start(_cfg(base, env_dir), progress=False)
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the bytes changed since the build (a partial copy, another writer, a bad disk)
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert warm_start(_cfg(base, env_dir), progress=True) == entry and len(builds) == 2
    note = capsys.readouterr().err
    assert f"not reusing the cached warm start {entry}: model.safetensors changed since it was saved; rebuilding" \
        in " ".join(note.split())
    assert sft.verify_cached(entry, json.loads((entry / MANIFEST).read_text())["inputs"]) is None

    (entry / MANIFEST).unlink()  # an entry from before manifests: nothing vouches for it
    assert sft.verify_cached(entry, {}) == f"no readable {MANIFEST}"
    assert warm_start(_cfg(base, env_dir), progress=False) == entry and len(builds) == 3


def test_the_key_covers_code_versions_data_seed_and_config(base, env_dir, monkeypatch):
    import torch
    import transformers

    from agentrl.plugins import load_environment

    cfg = _cfg(base, env_dir)
    env = load_environment(str(env_dir))
    data = sft.demonstration_data(env, base, cfg.sft, cfg.run.seed)
    key = sft_cache_key(cache_inputs(cfg, base, env, data))
    assert sft_cache_key(cache_inputs(cfg, base, env, data)) == key  # stable
    other_data = [(ids, mask) for ids, mask in data[:-1]]
    variants = {
        "data": sft_cache_key(cache_inputs(cfg, base, env, other_data)),
        "seed": sft_cache_key(cache_inputs(_cfg(base, env_dir, "--run.seed=3"), base, env, data)),
        "sft config": sft_cache_key(cache_inputs(_cfg(base, env_dir, "--sft.lr=0.002"), base, env, data)),
    }
    monkeypatch.setattr(torch, "__version__", "0.0-other")
    variants["torch"] = sft_cache_key(cache_inputs(cfg, base, env, data))
    monkeypatch.undo()
    monkeypatch.setattr(transformers, "__version__", "0.0-other")
    variants["transformers"] = sft_cache_key(cache_inputs(cfg, base, env, data))
    monkeypatch.undo()
    monkeypatch.setattr("agentrl.__version__", "0.0-other")
    variants["agentrl"] = sft_cache_key(cache_inputs(cfg, base, env, data))
    assert key not in variants.values() and len(set(variants.values())) == len(variants), variants


def test_demonstrations_raising_is_a_user_code_error(base, env_dir):
    (env_dir / "answers.json").write_text(json.dumps("raise"))
    with pytest.raises(UserCodeError, match=r"demonstrations\(\) raised OSError: answers.json is not a list"):
        warm_start(_cfg(base, env_dir), progress=False)
