"""Fault injection: each failure gets its documented fate, error kind, message and exit status.

A real embedded engine (tiny random model) serves every case; a real HTTP proxy in front of it
injects endpoint faults.  The environment is an installable-shaped package written per test
run, with one fault switched on by ``--env.args.fault``.  README "Fates, error kinds and exit
codes" is the table these tests check.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path

import pytest
from agentrl_cli import agentrl
from aiohttp import ClientSession, ClientTimeout, web
from testkit import env_package

from agentrl.inference import start_embedded_engine
from agentrl.metrics import read_jsonl

pytestmark = pytest.mark.slow

FAULTY_ENV = '''
"""An environment with one fault switched on (agentrl's fault-injection tests)."""
import math

from agentrl.envs import EpisodeError, State, ToolEnv
from agentrl.rubrics import Rubric
from agentrl.types import Message, ToolCall


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    if FAULT == "tool_raise":
        raise RuntimeError("add is broken")
    if FAULT == "tool_episode_error":
        raise EpisodeError("the calculator service is gone")
    return a + b


def correct(completion, answer) -> float:
    if FAULT == "rubric_nan":
        return math.nan
    if FAULT == "rubric_raise":
        raise ValueError("rubric bug")
    return float(str(answer) in completion)


class Faulty(ToolEnv):
    async def setup(self, task):
        if FAULT == "setup_raise":
            raise OSError("database unreachable")
        return State(task)

    def parse_assistant(self, text, state):
        # the first turn always calls the tool, whatever a random model wrote
        if state.turn == 1:
            return Message("assistant", text, tool_calls=[ToolCall("add", '{"a": 2, "b": 3}')])
        return Message("assistant", text)


FAULT = "none"


def load_environment(fault: str = "none"):
    global FAULT
    FAULT = fault
    info = {"tags": {"a", "b"}} if fault == "unjsonable" else {}
    tasks = [{"question": f"What is {i}+{i}?", "answer": 2 * i, "info": info} for i in range(40)]
    # on_length="continue": a random model's cut-off first turn still reaches step() and the tool
    return Faulty(tools=[add], dataset=tasks, rubric=Rubric([correct]), max_turns=2, name="faulty", on_length="continue")
'''


@pytest.fixture(scope="module")
def faulty_env(tmp_path_factory) -> Path:
    return env_package(tmp_path_factory.mktemp("faulty") / "faulty-env", "faulty", "faulty_env", FAULTY_ENV,
                       dist="agentrl-env-faulty")


@pytest.fixture(scope="module")
def engine(small_model):
    with start_embedded_engine(small_model, max_batch_size=16, max_model_len=256, device="cpu") as eng:
        yield eng


def run(small_model: Path, env: Path, run_dir: Path, fault: str, base_url: str, model: str, api_key: str | None = None,
        **extra) -> subprocess.CompletedProcess:
    over = {
        "run.dir": run_dir, "model.path": small_model, "sft.enabled": "false", "env.name": env,
        "env.args.fault": fault, "inference.base_url": f'["{base_url}"]', "inference.model_name": model,
        "rollout.group_size": 2, "rollout.max_in_flight": 8, "rollout.max_tokens": 8, "rollout.max_turns": 2,
        "trainer.batch_groups": 1, "trainer.steps": 3, "buffer.filter_zero_variance": "false",
        "buffer.stall_groups": 4, "eval.every": 0, "trainer.checkpoint_every": 0, "trainer.num_threads": 1,
        **extra,
    }  # fmt: skip
    # the engine's key, as a user passes it to a run against a running engine
    return agentrl("run", *[f"--{k}={v}" for k, v in over.items()], env={"AGENTRL_API_KEY": api_key} if api_key else None)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- agentrl run


@pytest.mark.parametrize(
    ("fault", "kind", "message"),
    [
        ("rubric_nan", "rubric", "reward function 'correct' returned nan"),
        ("rubric_raise", "rubric", "reward function 'correct' raised ValueError: rubric bug"),
        ("setup_raise", "env", "OSError: database unreachable"),
        ("tool_episode_error", "tool", "tool 'add' failed: EpisodeError: the calculator service is gone"),
    ],
)
def test_run_stalls_with_the_cause_named_and_exit_1(small_model, faulty_env, engine, tmp_path, fault, kind, message):
    r = run(small_model, faulty_env, tmp_path / "run", fault, engine.base_url, engine.model, engine.api_key)
    assert r.returncode == 1
    line = one_line(r)
    assert "training stalled" in line and f"most in {kind}: " in line and message in line
    assert "policy" not in line  # the policy is blamed only for valid, equal rewards
    records = read_jsonl(tmp_path / "run/ledger.jsonl")
    assert records and all(x["fate"] == "errored" and x["kind"] == kind and message in x["reason"] for x in records)
    ids = [x["id"] for x in records]
    assert len(ids) == len(set(ids))


def test_a_tool_that_raises_is_feedback_to_the_model_and_counted(small_model, faulty_env, engine, tmp_path):
    r = run(small_model, faulty_env, tmp_path / "run", "tool_raise", engine.base_url, engine.model, engine.api_key)
    assert r.returncode == 0, r.stderr[-2000:]
    rollouts = read_jsonl(tmp_path / "run/rollouts.jsonl")
    assert rollouts and all(x["error"] is None for x in rollouts)
    assert all(x["metrics"]["tool_raised/add"] == 1 for x in rollouts)
    assert any("Error: RuntimeError: add is broken" in m["content"] for x in rollouts for m in x["messages"])


def test_a_task_that_json_cannot_hold_is_logged_and_trained(small_model, faulty_env, engine, tmp_path):
    r = run(small_model, faulty_env, tmp_path / "run", "unjsonable", engine.base_url, engine.model, engine.api_key)
    assert r.returncode == 0, r.stderr[-2000:]
    rollouts = read_jsonl(tmp_path / "run/rollouts.jsonl")
    assert rollouts and rollouts[0]["task"]["info"]["tags"] == ["a", "b"]
    fates = {x["fate"] for x in read_jsonl(tmp_path / "run/ledger.jsonl")}
    assert "trained" in fates and fates <= {"trained", "unused", "interrupted"}  # the last two: held at the end


def test_a_wrong_model_name_is_one_line_exit_2_before_any_episode(small_model, faulty_env, engine, tmp_path):
    r = run(small_model, faulty_env, tmp_path / "run", "none", engine.base_url, "nope", engine.api_key)
    assert r.returncode == 2
    assert f'set inference.model_name = "{engine.model}"' in one_line(r)
    assert not (tmp_path / "run/rollouts.jsonl").exists() or not read_jsonl(tmp_path / "run/rollouts.jsonl")


def test_a_run_without_the_engines_key_is_one_line_exit_2_before_any_episode(small_model, faulty_env, engine, tmp_path):
    r = run(small_model, faulty_env, tmp_path / "run", "none", engine.base_url, engine.model)  # no AGENTRL_API_KEY
    assert r.returncode == 2
    line = one_line(r)
    assert "refused this run's API key" in line and "AGENTRL_API_KEY" in line and engine.api_key not in r.stderr
    assert not (tmp_path / "run/rollouts.jsonl").exists() or not read_jsonl(tmp_path / "run/rollouts.jsonl")


class FlakyProxy:
    """A real HTTP proxy in front of the engine: every ``fail_every``-th generation request gets a
    500, and the ``hang_on``-th one hangs for ``hang_s`` before answering."""

    def __init__(self, target: str, fail_every: int = 0, hang_on: int = 0, hang_s: float = 0.0):
        self.target, self.fail_every, self.hang_on, self.hang_s = target.rstrip("/"), fail_every, hang_on, hang_s
        self.calls = self.failed = self.hung = 0

    async def handle(self, request: web.Request) -> web.Response:
        path = request.rel_url.path_qs
        if request.path.endswith("/completions"):
            self.calls += 1
            if self.fail_every and self.calls % self.fail_every == 0:
                self.failed += 1
                return web.json_response({"error": {"message": "injected"}}, status=500)
            if self.calls == self.hang_on:
                self.hung += 1
                await asyncio.sleep(self.hang_s)
        async with ClientSession(timeout=ClientTimeout(total=120)) as s, s.request(
            request.method, self.target + path, data=await request.read(),
            headers={"Content-Type": "application/json", **{k: v for k, v in request.headers.items() if k == "Authorization"}},
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    def __enter__(self) -> str:
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.loop = loop
        self.thread = threading.Thread(target=loop.run_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_endpoint_500s_and_a_hang_are_retried_and_the_run_completes(small_model, faulty_env, engine, tmp_path):
    root = engine.base_url.removesuffix("/v1")
    proxy = FlakyProxy(root, fail_every=7, hang_on=5, hang_s=4.0)
    with proxy as url:
        r = run(small_model, faulty_env, tmp_path / "run", "none", url, engine.model, engine.api_key,
                **{"inference.request_timeout_s": 2, "inference.max_retries": 3})
    assert r.returncode == 0, r.stderr[-2000:]
    assert proxy.failed > 0 and proxy.hung == 1  # the faults really happened
    records = read_jsonl(tmp_path / "run/ledger.jsonl")
    assert records and not [x for x in records if x["fate"] == "errored"]  # every fault was retried away
    rows = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [x["step"] for x in rows] == [0, 1, 2]


# ----------------------------------------------------------------------------- agentrl eval


@pytest.mark.parametrize(
    ("fault", "status", "kind"), [("rubric_nan", 3, "rubric"), ("setup_raise", 3, "env"), ("tool_raise", 0, None)]
)
def test_eval_prints_the_error_table_and_its_exit_status_says_what_happened(faulty_env, engine, tmp_path, fault,
                                                                             status, kind):
    r = agentrl("eval", str(faulty_env), "--model", engine.model, "--base-url", engine.base_url, "-n", "3",
                "-r", "2", "--max-tokens", "8", "--out", str(tmp_path / "out"), "--env-args", json.dumps({"fault": fault}))
    assert r.returncode == status, r.stderr[-2000:]
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    if kind is None:
        assert summary["error_rate"] == 0.0 and not summary["errors"]
        return
    assert summary["error_rate"] == 1.0 and summary["errors"][0]["kind"] == kind and summary["errors"][0]["count"] == 6
    assert "errored episodes" in r.stdout and kind in r.stdout
    assert "100% of episodes errored" in one_line(r)


def test_eval_with_a_wrong_model_name_says_which_to_pass(faulty_env, engine, tmp_path):
    r = agentrl("eval", str(faulty_env), "--model", "nope", "--base-url", engine.base_url, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and f"pass --model {engine.model}" in one_line(r)


def test_eval_rollouts_differ_per_seed_and_reproduce(faulty_env, engine, tmp_path):
    def texts(out: Path) -> list[str]:
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        return [x["messages"][-1]["content"] for x in sorted(rows, key=lambda x: (x["task_index"], x["rollout"]))]

    common = ["--model", engine.model, "--base-url", engine.base_url, "-n", "2", "-r", "3", "--max-tokens", "12",
              "--temperature", "1.0", "--seed", "7"]  # fmt: skip
    a = agentrl("eval", str(faulty_env), *common, "--out", str(tmp_path / "a"))
    b = agentrl("eval", str(faulty_env), *common, "--out", str(tmp_path / "b"))
    assert a.returncode == b.returncode == 0, a.stderr[-1000:]
    ta, tb = texts(tmp_path / "a"), texts(tmp_path / "b")
    assert ta == tb  # reproducible
    assert len(set(ta[:3])) > 1  # the k rollouts of one task differ (pass@k is not pass@1)
