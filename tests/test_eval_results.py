"""`agentrl eval`'s results directory: every finished episode is kept (an interrupt, a torn
last line), --resume continues only the same run, and `agentrl view` summarises it as the
eval did."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agentrl_cli import agentrl
from testkit import env_package

from agentrl.recipes.eval import exit_status, summarize, summary_table, unmeasured

# one turn, reward `reward`; the PROBE_HANG-th episode to be scored hangs (after touching PROBE_MARKER)
PROBE_ENV = '''
import asyncio
import os
from pathlib import Path

from agentrl.envs import ToolEnv
from agentrl.rubrics import Rubric

CALLS = {"n": 0}


def load_environment(num: int = 4, reward: float = 1.0):
    tasks = [{"question": f"Say x {i}", "answer": "x"} for i in range(num)]

    async def score(completion: str, answer: str) -> float:
        CALLS["n"] += 1
        if CALLS["n"] == int(os.environ.get("PROBE_HANG", "0")):
            Path(os.environ["PROBE_MARKER"]).touch()
            await asyncio.sleep(10**6)
        return reward

    return ToolEnv(tools=[], dataset=tasks, eval_dataset=tasks, rubric=Rubric([score]), max_turns=1, name="probe")
'''


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory) -> Path:
    return env_package(tmp_path_factory.mktemp("probe") / "probe_env", "probe-env", "probe_env", PROBE_ENV)


def lines(out: Path) -> list[str]:
    path = out / "results.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def wait_for(cond: Callable[[], bool], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def slots(out: Path) -> set[tuple[int, int]]:
    return {(r["task_index"], r["rollout"]) for r in map(json.loads, lines(out))}


@pytest.mark.slow
def test_an_interrupt_keeps_every_finished_episode_and_resume_runs_the_rest(tmp_path, tiny_model, probe_env):
    out, marker = tmp_path / "out", tmp_path / "hanging"
    args = ["eval", str(probe_env), "--model", str(tiny_model), "-n", "2", "-r", "3", "--max-tokens", "8",
            "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PROBE_HANG": "6", "PROBE_MARKER": str(marker)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background shell may ignore SIGINT
    )
    try:
        # the last episode to be scored hangs: the other 5 (of both tasks) have finished
        assert wait_for(lambda: marker.exists() or proc.poll() is not None, 240) and proc.poll() is None
        wait_for(lambda: len(lines(out)) >= 5, 30)  # written as each finishes (per group, its task's were lost)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-2000:]
    assert len(lines(out)) == 5 and len(slots(out)) == 5
    assert "interrupted: 5 of 6 episodes" in err and "--resume" in err, err[-2000:]

    again = agentrl(*args, "--resume")  # no hang now: only the missing episode runs
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(lines(out)) == 6 and slots(out) == {(i, r) for i in range(2) for r in range(3)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 6 and summary["missing"] == 0 and summary["pass_at"]["2"] == 1.0


@pytest.mark.slow
def test_a_torn_last_line_is_cut_and_its_episode_runs_again(tmp_path, tiny_model, probe_env):
    out = tmp_path / "out"
    args = ("eval", probe_env, "--model", tiny_model, "-n", "2", "-r", "2", "--max-tokens", "8", "--out", out)
    assert (first := agentrl(*args)).returncode == 0, first.stderr[-2000:]
    path = out / "results.jsonl"
    data = path.read_bytes()
    torn = data.rstrip(b"\n").rfind(b"\n") + 1 + 100  # the last record cut short, no newline (kill -9, a full disk)
    path.write_bytes(data[:torn])

    r = agentrl(*args, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torn last line" in r.stderr
    recs = [json.loads(x) for x in path.read_text().splitlines()]  # every line is a record again
    assert len(recs) == 4 and slots(out) == {(i, j) for i in range(2) for j in range(2)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 4 and summary["missing"] == 0
    assert "episodes" in r.stdout and "4 (2 tasks × 2)" in r.stdout


def test_missing_slots_are_counted_and_are_not_a_clean_exit():
    rec = {"reward": 1.0, "error": None, "error_kind": None, "stop_reason": "stop", "turns": 1, "metrics": {}}
    records = [{**rec, "task_index": i, "rollout": r} for i, r in [(0, 0), (0, 1), (1, 0)]]
    s = summarize(records, "probe", "m", rollouts=2, pass_threshold=1.0, num_tasks=2)
    assert (s.episodes, s.missing, s.tasks) == (3, 1, 2)
    assert exit_status(s, max_error_rate=0.5) == 1
    assert exit_status(summarize(records[:2], "probe", "m", rollouts=2, pass_threshold=1.0, num_tasks=1), 0.5) == 0
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(summary_table(s))
    assert "3 of 4 (2 tasks × 2); 1 missing" in console.export_text()


def test_the_policys_failures_are_measured_and_the_infrastructures_are_not():
    """A timeout is the model's failure (reward 0, kept by --resume); an endpoint error measured
    nothing (left out of the mean and pass@k, in the error rate, rerun by --resume)."""
    ok = {"reward": 1.0, "error": None, "error_kind": None, "stop_reason": "stop", "turns": 1, "metrics": {}}
    timeout = {**ok, "reward": 0.0, "error": "episode exceeded its wall limit of 5s", "error_kind": "timeout",
               "stop_reason": "error"}
    down = {**ok, "reward": 0.0, "error": "EndpointError: connection refused", "error_kind": "endpoint",
            "stop_reason": "error"}
    records = [{**ok, "task_index": 0, "rollout": 0}, {**timeout, "task_index": 0, "rollout": 1},
               {**down, "task_index": 1, "rollout": 0}, {**ok, "task_index": 1, "rollout": 1}]
    s = summarize(records, "probe", "m", rollouts=2, pass_threshold=1.0, num_tasks=2)
    assert s.mean_reward == pytest.approx(2 / 3)  # (1 + 0 + 1) / 3: the endpoint's episode measured nothing
    assert s.error_rate == pytest.approx(1 / 4) and s.policy_failures == {"timeout": 1}
    assert s.pass_at[1] == pytest.approx((1 / 2 + 1) / 2)  # task 0: 1 of 2; task 1: 1 of its 1 measured
    assert [row["kind"] for row in s.errors] == ["endpoint"]
    assert [unmeasured(r) for r in records] == [False, False, True, False]  # what --resume reruns


@pytest.mark.slow
def test_resume_refuses_other_settings_and_may_add_tasks(tmp_path, tiny_model, probe_env):
    out = tmp_path / "out"
    base = ("eval", probe_env, "--model", tiny_model, "-r", "1", "--out", out)
    assert (first := agentrl(*base, "-n", "2", "-T", "0", "-t", "8")).returncode == 0, first.stderr[-2000:]
    meta, results = (out / "meta.json").read_text(), (out / "results.jsonl").read_text()

    r = agentrl(*base, "--resume", "-n", "4", "-T", "1.5", "-t", "64", "--seed", "7", "--max-turns", "5")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]  # before the engine starts
    for part in ("--temperature 0.0 (now 1.5)", "--max-tokens 8 (now 64)", "--seed unset (now 7)",
                 "--max-turns unset (now 5)"):
        assert part in r.stderr, r.stderr
    r = agentrl(*base, "--resume", "-n", "2", "-t", "8", "--env-args", '{"num": 3}')
    assert r.returncode == 2 and '--env-args {} (now {"num": 3})' in r.stderr, r.stderr
    r = agentrl(*base, "--resume", "-n", "1", "-t", "8")  # dropping a task would leave its episodes unsummarised
    assert r.returncode == 2 and "--num-tasks 2 (now 1" in r.stderr, r.stderr
    assert (out / "meta.json").read_text() == meta and (out / "results.jsonl").read_text() == results

    more = agentrl(*base, "--resume", "-n", "3", "-t", "8")  # more tasks, same settings: only the new one runs
    assert more.returncode == 0, more.stderr[-2000:]
    assert slots(out) == {(0, 0), (1, 0), (2, 0)} and len(lines(out)) == 3
    new_meta = json.loads((out / "meta.json").read_text())
    assert new_meta["num_tasks"] == 3 and new_meta["sampling"] == json.loads(meta)["sampling"]


def view_row(text: str, name: str) -> str:
    m = re.search(rf"{re.escape(name)}\s*│\s*([^│]+?)\s*│", text)
    assert m, text
    return m.group(1)


@pytest.mark.slow
def test_view_summarises_an_eval_as_it_ran(tmp_path, tiny_model, probe_env):
    out = tmp_path / "out"
    r = agentrl("eval", probe_env, "--model", tiny_model, "-n", "2", "-r", "2", "--max-tokens", "8", "--out", out,
                "--pass-threshold", "0.5", "--env-args", '{"reward": 0.5}')
    assert r.returncode == 0, r.stderr[-2000:]
    assert view_row(r.stdout, "pass@1") == "1.0000"
    v = agentrl("view", out)
    assert v.returncode == 0 and view_row(v.stdout, "pass@1") == "1.0000", v.stdout  # 0.5 passes, as in the eval

    path = out / "results.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))  # an eval interrupted before its last
    v = agentrl("view", out)
    assert v.returncode == 0 and view_row(v.stdout, "episodes") == "3 of 4 (2 tasks × 2); 1 missing", v.stdout

    meta = json.loads((out / "meta.json").read_text())
    for key in ("num_tasks", "rollouts", "pass_threshold"):  # an eval dir from before meta.json held them
        del meta[key]
    (out / "meta.json").write_text(json.dumps(meta))
    v = agentrl("view", out)
    assert v.returncode == 0 and view_row(v.stdout, "episodes") == "3 (2 tasks × 2)", v.stdout


@pytest.mark.slow
def test_more_tasks_than_the_env_has_says_so_and_a_nan_threshold_is_refused(tmp_path, tiny_model, probe_env):
    out = tmp_path / "out"
    r = agentrl("eval", probe_env, "--model", tiny_model, "-n", "9", "-r", "1", "--max-tokens", "8", "--out", out,
                "--env-args", '{"num": 3}')
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: probe has 3 held-out tasks; -n 9 evaluates those 3" in r.stderr
    assert len(lines(out)) == 3 and json.loads((out / "meta.json").read_text())["num_tasks"] == 3
    nan = agentrl("eval", probe_env, "--model", tiny_model, "--out", tmp_path / "nan", "--pass-threshold", "nan")
    assert nan.returncode == 2 and "--pass-threshold must be a finite number, got nan" in nan.stderr, nan.stderr


async def test_a_group_level_reward_function_sees_every_rollout_of_its_task(tmp_path):
    """Scored slot by slot, a function of ``completions`` saw a group of one in eval, never the
    group training gives it."""
    from agentrl.envs import SingleTurnEnv
    from agentrl.envs.check import ScriptedClient
    from agentrl.recipes.eval import evaluate
    from agentrl.rubrics import Rubric

    def share(completions):  # what a group-normalised or diversity reward looks like
        return [1.0 / len(completions)] * len(completions)

    env = SingleTurnEnv(dataset=[{"question": f"q{i}", "answer": "a"} for i in range(2)], rubric=Rubric([share]))
    s = await evaluate(env, ScriptedClient(lambda p: "a"), model="m", out_dir=tmp_path, num_tasks=2, rollouts=4)
    assert {json.loads(x)["reward"] for x in lines(tmp_path)} == {0.25} and s.mean_reward == 0.25
