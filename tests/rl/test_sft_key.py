"""What the SFT warm-start key covers (and leaves out), and the note on a model.path that already
holds another model than model.init / model.tiny_* describe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from testkit import env_package

from agentrl.config import load_config
from agentrl.recipes import sft
from agentrl.recipes.sft import cache_inputs, ensure_base_model, sft_cache_key

# the reward and the held-out tasks live in files an author edits without touching any config value
ENV = """\
import json, pathlib
from agentrl.envs import SingleTurnEnv
from agentrl.rubrics import Rubric

HERE = pathlib.Path(__file__).parent


def correct(completion, answer) -> float:
    return 0.0


class Echo(SingleTurnEnv):
    def demonstrations(self, n, seed=0):
        return [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "four"}] for i in range(n)]


def load_environment():
    held_out = json.loads((HERE / "held_out.json").read_text())
    return Echo(dataset=[{"prompt": "q", "answer": "four"}], eval_dataset=held_out, rubric=Rubric([correct]))
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=32, heads=2)


@pytest.fixture
def env_dir(tmp_path) -> Path:
    return env_package(tmp_path / "echo_key_env", "echo-key-env", "echo_key_env_mod", ENV,
                       files={"held_out.json": json.dumps([{"prompt": "2+2", "answer": "four"}])})


def _cfg(base: Path, env_dir: Path, *extra: str):
    return load_config([], [f"--model.path={base}", f"--env.name={env_dir}", "--sft.steps=2", "--sft.batch_size=4",
                            "--sft.num_demos=8", "--trainer.device=cpu", *extra])


def _key(base: Path, env_dir: Path, *extra: str) -> str:
    from agentrl.plugins import load_environment

    cfg = _cfg(base, env_dir, *extra)
    env = load_environment(str(env_dir))
    data = sft.demonstration_data(env, base, cfg.sft, cfg.run.seed)
    return sft_cache_key(cache_inputs(cfg, base, env, data))


def test_with_a_target_reward_the_key_covers_the_reward_code_and_the_held_out_tasks(base, env_dir):
    """The early stop reads the rubric and the held-out tasks: a changed correct() reused a warm start
    that had stopped (or not) by the old reward."""
    target = "--sft.target_reward=0.5"
    key = _key(base, env_dir, target)
    assert _key(base, env_dir, target) == key  # nothing changed: the same entry
    module = env_dir / "echo_key_env_mod.py"
    module.write_text(module.read_text().replace("return 0.0", "return 1.0"))
    rewarded = _key(base, env_dir, target)
    assert rewarded != key
    (env_dir / "held_out.json").write_text(json.dumps([{"prompt": "2+3", "answer": "five"}]))
    assert _key(base, env_dir, target) not in (key, rewarded)


def test_evaluation_only_settings_shape_the_key_only_with_a_target_reward(base, env_dir):
    """Without target_reward no evaluation runs: eval_every / eval_tasks / rollout limits do not
    shape the weights, so they must not build a new entry (nor the env's reward code)."""
    key = _key(base, env_dir)
    assert _key(base, env_dir, "--sft.eval_every=3", "--sft.eval_tasks=7", "--rollout.max_tokens=9") == key
    module = env_dir / "echo_key_env_mod.py"
    module.write_text(module.read_text().replace("return 0.0", "return 1.0"))
    assert _key(base, env_dir) == key

    target = "--sft.target_reward=0.5"
    with_target = _key(base, env_dir, target)
    assert with_target != key
    assert len({with_target, _key(base, env_dir, target, "--sft.eval_every=3"),
                _key(base, env_dir, target, "--sft.eval_tasks=7")}) == 3


def test_a_bin_model_whose_weights_change_gets_a_new_key(base, env_dir, tmp_path):
    """The base model hash read only .json/.safetensors/...: a pytorch_model.bin retrained in place
    reused the warm start of the old weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.plugins import load_environment

    binary = tmp_path / "bin-model"
    shutil.copytree(base, binary)
    for f in binary.glob("*.safetensors"):
        f.unlink()
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.save(model.state_dict(), binary / "pytorch_model.bin")  # transformers 5 writes only safetensors
    assert AutoModelForCausalLM.from_pretrained(binary) is not None  # a model dir transformers loads

    cfg = _cfg(binary, env_dir)
    env = load_environment(str(env_dir))
    data = sft.demonstration_data(env, binary, cfg.sft, cfg.run.seed)
    before = sft_cache_key(cache_inputs(cfg, binary, env, data))
    assert sft_cache_key(cache_inputs(cfg, binary, env, data)) == before
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    torch.save(model.state_dict(), binary / "pytorch_model.bin")
    assert sft_cache_key(cache_inputs(cfg, binary, env, data)) != before


def _note(capsys, base: Path, *extra: str) -> str:
    capsys.readouterr()
    assert ensure_base_model(load_config([], [f"--model.path={base}", *extra]).model) == base
    err = capsys.readouterr().err
    assert err.count("\n") <= 1, err  # one line
    return " ".join(err.split())


def test_model_init_and_tiny_sizes_that_do_not_match_the_model_there_are_named(base, tmp_path, capsys):
    """model.path already holds a model: init and tiny_* build nothing, and were ignored silently."""
    assert _note(capsys, base) == ""  # defaults: nothing was asked for
    assert _note(capsys, base, "--model.tiny_hidden=32", "--model.tiny_layers=1") == ""  # what is there
    note = _note(capsys, base, "--model.tiny_hidden=256", "--model.tiny_layers=8")
    assert str(base) in note
    assert "model.tiny_hidden = 256" in note and "model.tiny_layers = 8" in note and "ignored" in note
    assert "hidden 32" in note and "1 layers" in note
    note = _note(capsys, base, "--model.init=smollm2-135m")
    assert "model.init = 'smollm2-135m'" in note and "ignored" in note

    imported = tmp_path / "smol"
    shutil.copytree(base, imported)  # stands in for `agentrl model init smollm2-135m` (its provenance file)
    (imported / "agentrl_import.json").write_text(json.dumps({"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert _note(capsys, imported, "--model.init=smollm2-135m") == ""
