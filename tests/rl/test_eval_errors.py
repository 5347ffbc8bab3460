"""Errored held-out episodes are named, not read as a model that has not learnt yet.

A rubric that raised on every episode made every SFT evaluation print ``greedy held-out reward
0.000`` (so SFT ran all ``sft.steps``), the warm start ``eval/reward_mean 0.000``, and a short run
end with exit 0 and a hint about ``buffer.filter_zero_variance``.  Now each evaluation names its
errored episodes as the stall message does, and one whose every episode errored by no fault of
the policy stops with one line and exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agentrl_cli import agentrl
from testkit import env_package

from agentrl.buffer import StalenessBuffer
from agentrl.config import Config, EvalConfig
from agentrl.envs.check import ScriptedClient
from agentrl.plugins import load_environment
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.rubrics import Rubric
from agentrl.types import Message, SamplingParams, Task, Trajectory

RUBRIC_ERROR = "reward function 'correct' raised KeyError: 'oops in my reward'"


def correct(completion: str, answer: str) -> float:
    raise KeyError("oops in my reward")


def calc_with_a_broken_rubric():
    env = load_environment("calc", num_train=20, num_eval=20)
    env.rubric = Rubric([correct])
    return env


def held_out(manager, tasks, **kw):
    from agentrl.recipes.rl_steps import HeldOut

    return HeldOut(manager, tasks, EvalConfig(), max_tokens=8, **kw)


class Canned:
    """A rollout source whose evaluation returns the given episodes."""

    def __init__(self, trajs: list[Trajectory]) -> None:
        self.trajs = trajs

    async def evaluate(self, tasks, sampling, concurrency=64):
        return self.trajs


def episode(reward: float = 0.0, error: str | None = None, kind: str | None = None) -> Trajectory:
    return Trajectory(task=Task(prompt=[Message("user", "q")]), reward=reward, error=error, error_kind=kind)


# ----------------------------------------------------------------------------- the warm-start baseline


async def test_a_warm_start_evaluation_whose_rubric_always_raises_stops_the_run():
    from agentrl.recipes.rl_steps import EvaluationErrored

    env = calc_with_a_broken_rubric()
    tasks = list(env.eval_dataset())[:4]
    manager = RolloutManager(env, ScriptedClient(), StalenessBuffer(1, 1), TaskSampler(list(env.dataset()), seed=0),
                             SamplingParams(max_tokens=8))
    with pytest.raises(EvaluationErrored) as e:
        await held_out(manager, tasks).baseline(0)
    line = str(e.value)
    assert e.value.exit_code == 1 and "\n" not in line
    assert f"4/4 held-out episodes errored, most in rubric: {RUBRIC_ERROR}" in line, line
    assert "fix the rubric" in line and line.startswith("warm-start evaluation")


async def test_a_warm_start_evaluation_names_its_errored_episodes():
    trajs = [episode(1.0), episode(error="RuntimeError: db gone", kind="env"), episode(error="second", kind="env"),
             episode(error="late", kind="timeout")]
    line = await held_out(Canned(trajs), []).baseline(0)
    assert line == ("warm start: eval/reward_mean 0.250 (3/4 held-out episodes errored, most in env: "
                    "RuntimeError: db gone)"), line


async def test_every_episode_failing_by_the_policys_doing_is_not_a_broken_setup():
    """A timeout (or a program failing on the model's output) is the policy's: reward 0, measured."""
    trajs = [episode(error="episode exceeded its wall limit", kind="timeout") for _ in range(3)]
    line = await held_out(Canned(trajs), []).baseline(0)
    assert line.startswith("warm start: eval/reward_mean 0.000 (3/3 held-out episodes errored, most in timeout")
    assert await held_out(Canned([episode(0.5)]), []).baseline(0) == "warm start: eval/reward_mean 0.500"


# ----------------------------------------------------------------------------- SFT's greedy evaluations


async def test_an_sft_evaluation_whose_rubric_always_raises_stops_sft():
    from agentrl.recipes.rl_steps import EvaluationErrored
    from agentrl.recipes.sft import GreedyEvaluator

    cfg = Config.model_validate({"sft": {"eval_tasks": 3, "target_reward": 0.5}, "rollout": {"max_tokens": 8}})
    evaluator = GreedyEvaluator(Path("unused"), calc_with_a_broken_rubric(), cfg, policy=object())
    with pytest.raises(EvaluationErrored) as e:
        await evaluator.reward(ScriptedClient(), 20)
    line = str(e.value)
    assert line.startswith("sft evaluation at step 20: ") and "\n" not in line
    assert f"3/3 held-out episodes errored, most in rubric: {RUBRIC_ERROR}; fix the rubric" in line, line


async def test_an_sft_evaluation_with_some_errors_keeps_their_note():
    cfg = Config.model_validate({"sft": {"eval_tasks": 3, "target_reward": 0.5}, "rollout": {"max_tokens": 8}})
    env = load_environment("calc", num_train=20, num_eval=20)
    first = env.eval_dataset()[0].answer
    env.rubric = Rubric([lambda completion, answer: 1 / 0 if answer == first else 0.0])
    from agentrl.recipes.sft import GreedyEvaluator

    evaluator = GreedyEvaluator(Path("unused"), env, cfg, policy=object())
    assert await evaluator.reward(ScriptedClient(), 5) == 0.0
    assert evaluator.errored is not None and evaluator.errored.startswith("1/3 held-out episodes errored, most in rubric")


def test_sft_progress_names_errored_episodes_beside_the_reward(tiny_model, tmp_path, capsys):
    from agentrl.config import SFTConfig
    from agentrl.recipes.sft import train_sft

    class Evaluator:
        errored = "2/2 held-out episodes errored, most in env: RuntimeError: db gone"

        def score(self, model, version: int) -> float:
            return 0.0

    env = load_environment("calc", num_train=20, num_eval=20)
    sft = SFTConfig(steps=1, batch_size=2, num_demos=4, lr=1e-3, target_reward=0.5, eval_every=1)
    train_sft(tiny_model, env, sft, seed=0, out_dir=tmp_path / "out", evaluator=Evaluator())
    err = capsys.readouterr().err
    assert "sft step 1: greedy held-out reward 0.000 (target 0.5); 2/2 held-out episodes errored, most in env: " \
           "RuntimeError: db gone" in " ".join(err.split()), err


# ----------------------------------------------------------------------------- a run out of time


def test_a_run_out_of_time_names_its_errored_episodes_not_only_the_filter():
    from agentrl.ledger import Ledger
    from agentrl.recipes.rl_steps import waited_note

    ledger = Ledger()
    ledger.start(["e1", "e2", "e3"], "g1", "t1")
    ledger.settle(["e1", "e2"], "errored", step=0, reason=RUBRIC_ERROR, kind="rubric")
    ledger.settle(["e3"], "filtered", step=0, reason="every reward was 0")
    note = waited_note(20, 0, ledger)
    assert note.startswith("run.max_wall_s (20s) ran out while the trainer waited for a batch at step 0 (")
    assert f"2 episodes errored so far, most: 2× rubric: {RUBRIC_ERROR}; fix the rubric function" in note, note
    quiet = Ledger()
    quiet.start(["e1"], "g1", "t1")
    quiet.settle(["e1"], "filtered", step=0, reason="every reward was 0")
    assert "errored" not in waited_note(20, 0, quiet) and "buffer.filter_zero_variance" in waited_note(20, 0, quiet)


# ----------------------------------------------------------------------------- through the CLI

BROKEN_ENV = '''
"""calc, with a reward function that raises on every episode."""
from agentrl.plugins import load_environment as _load
from agentrl.rubrics import Rubric


def correct(completion, answer) -> float:
    raise KeyError("oops in my reward")


def load_environment(**kwargs):
    env = _load("calc", num_train=20, num_eval=20)
    env.rubric = Rubric([correct])
    return env
'''


@pytest.fixture(scope="module")
def broken_env(tmp_path_factory) -> Path:
    return env_package(tmp_path_factory.mktemp("broken") / "broken-env", "broken", "broken_env", BROKEN_ENV,
                       dist="agentrl-env-broken")


RUN = {"rollout.group_size": 2, "rollout.max_in_flight": 4, "rollout.max_tokens": 8, "rollout.max_turns": 2,
       "trainer.batch_groups": 1, "trainer.steps": 2, "trainer.num_threads": 1, "inference.max_batch_size": 4,
       "eval.num_tasks": 2, "sft.steps": 50, "sft.eval_every": 2, "sft.eval_tasks": 2, "sft.target_reward": 0.5,
       "sft.batch_size": 2, "sft.num_demos": 8}  # fmt: skip


@pytest.mark.parametrize(("sft", "where"), [("true", "sft evaluation at step 2"), ("false", "warm-start evaluation")])
def test_agentrl_run_with_a_rubric_that_always_raises_stops_in_one_line(small_model, broken_env, tmp_path, sft, where):
    model = tmp_path / "model"  # the SFT cache is written beside the model
    model.symlink_to(small_model, target_is_directory=True)
    over = {"model.path": model, "run.dir": tmp_path / "run", "env.name": broken_env, "sft.enabled": sft, **RUN}
    r = agentrl("run", *(f"--{k}={v}" for k, v in over.items()), timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1, r.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(f"error: {where}: 2/2 held-out episodes errored, most in rubric: {RUBRIC_ERROR}")
    assert not (tmp_path / "run" / "summary.json").exists()
    assert not list(tmp_path.glob("model-sft-*"))  # no warm start was cached from it


# ----------------------------------------------------------------------------- what a finished run reports


def test_summary_json_records_the_steps_taken(tiny_model, tmp_path):
    import asyncio

    from transformers import AutoModelForCausalLM

    from agentrl.metrics import LiveProgress
    from agentrl.recipes.rl import finish

    class Trainer:
        def merged_model(self):
            return AutoModelForCausalLM.from_pretrained(tiny_model)

    cfg = Config.model_validate({"trainer": {"steps": 250}})
    asyncio.run(finish(cfg, tmp_path, Trainer(), StalenessBuffer(1, 1), tiny_model, LiveProgress(250, enabled=False),
                       0.0, steps=0))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["version"] == 0


def test_view_of_a_finished_run_without_a_step_says_why(tmp_path):
    from agentrl.metrics import summarize_run

    (tmp_path / "config.toml").write_text("")
    (tmp_path / "metrics.jsonl").write_text("")
    ledger = {"ledger/started": 1192, "ledger/trained": 0, "ledger/filtered": 1000, "ledger/errored": 64,
              "ledger/interrupted": 128, "ledger/in_flight": 0, "ledger/errored/rubric": 64}
    (tmp_path / "summary.json").write_text(json.dumps({
        "steps": 0, "version": 0, "ledger": ledger, "top_error": f"64× rubric: {RUBRIC_ERROR}",
        "final_model": str(tmp_path / "final")}))
    text = summarize_run(tmp_path)
    assert "no training steps logged yet" not in text, text
    assert "run ended with no training step: 0 trained, 1000 filtered (" in text, text
    assert "64 errored (rubric 64" in text and RUBRIC_ERROR in text and "128 interrupted" in text, text
    assert f"final model: {tmp_path / 'final'}" in text
