"""Environments as services: `agentrl env serve` in one process, used by URL from another.

Real parts only: the server is the real CLI in a subprocess (aiohttp), the client the real
RemoteEnvironment over HTTP, the episodes run through the one episode loop."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from env_service import CALC, cli_server, served
from testkit import free_port

from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.errors import AgentrlError
from agentrl.plugins import load_environment
from agentrl.rubrics import score_episodes
from agentrl.types import SamplingParams


@pytest.fixture(scope="module")
def calc_server():
    with cli_server(CALC, {"num_train": 50}) as url:
        yield url


def solver(prompt: str) -> str:
    """Calls the calculator on the question, then repeats its result (a wrong sum for 'What is 1')."""
    if "<|im_start|>tool\n" in prompt:
        return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    expr = prompt.rsplit("What is ", 1)[1].split("?")[0]
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expr}})}\n</tool_call>'


def wrong_then_garbage(prompt: str) -> str:
    if "<|im_start|>tool\n" in prompt:
        return "I think it is 7."
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "__import__(1)"}}\n</tool_call>'


def _plain(messages) -> list[dict]:
    """Messages without the random tool-call ids."""
    out = []
    for m in messages:
        d = m.to_dict()
        d.pop("tool_call_id", None)
        for tc in d.get("tool_calls", []):
            tc.pop("id")
        out.append(d)
    return out


@pytest.mark.parametrize("policy", [solver, wrong_then_garbage])
async def test_a_served_env_runs_exactly_like_the_local_one(calc_server, policy):
    """Same tasks, same policy: the same tokens, messages, tool calls, rewards and metrics.

    Catches: tool calls not parsed by the env on the server (no tool reply, reward 0), the
    conversation on this side differing from the server's (different forced tokens), metrics or
    reward not coming back, tool errors turned into episode errors."""
    local, remote = load_environment(CALC, num_train=50), load_environment(calc_server)
    assert (remote.name, remote.version, remote.max_turns) == (local.name, local.version, local.max_turns)
    assert remote.tool_schemas() == local.tool_schemas()
    def rows(tasks):  # task ids are random per load: compare the content
        return [{k: v for k, v in t.to_dict().items() if k != "id"} for t in tasks]

    assert rows(remote.eval_dataset()) == rows(local.eval_dataset())
    assert [t.prompt for t in remote.dataset()] == [t.prompt for t in local.dataset()] and len(remote.dataset()) == 50
    sampling = SamplingParams(max_tokens=100)
    got = {}
    for name, env in (("local", local), ("remote", remote)):  # the same problems (a server runs only its own tasks)
        trajs = [await env.rollout(ScriptedClient(policy), t, sampling) for t in list(env.eval_dataset())[:4]]
        await score_episodes(env.rubric, trajs)
        got[name] = trajs
    await remote.aclose()
    for a, b in zip(got["local"], got["remote"], strict=True):
        assert b.error is None, b.error
        assert _plain(b.messages) == _plain(a.messages)
        assert [s.token_ids for s in b.sequences] == [s.token_ids for s in a.sequences]
        assert [s.loss_mask for s in b.sequences] == [s.loss_mask for s in a.sequences]
        assert (b.reward, b.stop_reason, b.metrics) == (a.reward, a.stop_reason, a.metrics)
    if policy is solver:
        assert [t.reward for t in got["remote"]] == [1.0] * 4
    if policy is wrong_then_garbage:  # the tool raised: a tool message back to the model, not an error
        assert all(any(m.role == "tool" for m in t.messages) for t in got["remote"])


async def test_the_checker_passes_on_a_served_env(calc_server):
    report = await check_environment(load_environment(calc_server), num_episodes=3)
    assert report.ok, [f"{r.name}: {r.detail}" for r in report.failures()]


async def test_server_side_failures_are_episode_errors_with_their_kind(calc_server):
    """An episode the server does not know (restarted server) errors as kind env, naming the cause."""
    from agentrl.envs.base import State

    remote = load_environment(calc_server)
    task = remote.eval_dataset()[0]
    state = State(task, episode_id="nope")
    with pytest.raises(Exception, match="no open episode 'nope'") as e:
        await remote.step(state, remote.parse_assistant("hi", state))
    assert type(e.value).error_kind == "env"
    # a group whose states the server no longer holds is errored by the rubric, not scored 0 silently
    traj = await remote.rollout(ScriptedClient(solver), task, SamplingParams(max_tokens=100))
    traj.state["episode_id"] = "gone"
    await score_episodes(remote.rubric, [traj])
    assert traj.error_kind == "env" and "no state for episode 'gone'" in traj.error and traj.reward == 0.0
    await remote.aclose()


def test_an_unreachable_server_or_env_args_for_a_url_are_one_line_errors(calc_server):
    with pytest.raises(AgentrlError, match="unreachable.*agentrl env serve"):
        load_environment(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(AgentrlError, match="agentrl env serve NAME --env-args"):
        load_environment(calc_server, num_train=3)


@pytest.mark.slow
def test_agentrl_eval_and_a_training_run_use_a_served_env(calc_server, tmp_path, small_model):
    """`agentrl eval URL` with the embedded engine, then a short RL run with env.name = URL."""
    from agentrl.config import load_config
    from agentrl.metrics import read_jsonl
    from agentrl.recipes.rl import train as run_training

    model = small_model
    out = tmp_path / "eval"
    ev = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", calc_server, "--model", str(model), "-n", "2",
                         "-r", "2", "--out", str(out), "--max-tokens", "16", "--max-error-rate", "0"],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["env"] == "calc" and r["error"] is None and r["completion_tokens"] > 0 for r in recs)

    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": calc_server,
        "rollout.group_size": 4, "rollout.max_in_flight": 8, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 2, "buffer.filter_zero_variance": "false", "eval.every": 0,
        "trainer.checkpoint_every": 0, "inference.max_batch_size": 8, "trainer.num_threads": 1,
    }  # fmt: skip
    run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[-1]["ledger/trained"] == 2 * 2 * 4 and rows[-1]["ledger/errored"] == 0
    episodes = read_jsonl(run_dir / "rollouts.jsonl")
    assert episodes and all(e["env_name"] == "calc" for e in episodes)
    with urllib.request.urlopen(f"{calc_server}/health", timeout=5) as r:
        assert json.loads(r.read())["open"] == 0  # every episode was closed on the server


def test_agentrl_env_test_url_plays_the_served_reference_policy(calc_server):
    """`agentrl env test URL` runs the env's reference policy on the server (POST /reference).

    Catches: the reference check silently skipped for a URL (no policy on the client side), the
    policy's tool-call turns not surviving the round trip (reward below max)."""
    r = subprocess.run([sys.executable, "-m", "agentrl.cli", "env", "test", calc_server, "-n", "2"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    row = next(line for line in r.stdout.splitlines() if "reference_solution" in line)
    assert "pass" in row and "rewards [1.0, 1.0" in row, row


class _Counting:
    """Wraps an env: counts cleanups (to see the reaper run the env's own cleanup)."""

    def __init__(self, env):
        self.env, self.cleaned = env, 0
        orig = env.cleanup

        async def cleanup(state):
            self.cleaned += 1
            await orig(state)

        env.cleanup = cleanup


async def test_an_episode_whose_client_died_expires_after_the_idle_timeout():
    """Two open episodes on a real aiohttp server with idle_timeout 1s: the one still stepping
    stays open, the silent one is cleaned up, counted in /health, and a late call names the cause.

    Catches: a reaper that expires active episodes (last call not recorded), one that forgets to
    run the env's cleanup, expiries not counted, a late call answered as a generic unknown id."""
    import asyncio

    from agentrl.envs.base import State
    from agentrl.envs.remote import RemoteEnvironment

    counting = _Counting(load_environment(CALC, num_train=10))
    # a timeout well above the 0.1 s between the live episode's steps: a 0.3 s stall of a loaded
    # host's event loop (a full GC, a noisy neighbour) must not expire it
    async with served(counting.env, idle_timeout_s=1.0) as url:
        remote = await asyncio.to_thread(RemoteEnvironment, url)
        task = remote.eval_dataset()[0]
        alive, silent = await remote.setup(task), await remote.setup(task)
        for _ in range(25):  # 2.5 s of activity on one episode, silence on the other
            await asyncio.sleep(0.1)
            await remote.step(alive, remote.parse_assistant("still here", alive))
        health = await remote._client().get(f"{remote.url}/health")
        h = await health.json()
        assert (h["open"], h["expired"], counting.cleaned) == (1, 1, 1), h
        with pytest.raises(Exception, match=rf"no open episode '{silent['episode_id']}' \(expired after 1s idle\)") as e:
            await remote.step(silent, remote.parse_assistant("late", silent))
        assert type(e.value).error_kind == "env"
        await remote.cleanup(alive)
        assert isinstance(alive, State) and counting.cleaned == 2
        await remote.aclose()


def test_env_serve_idle_timeout_flag():
    """`agentrl env serve --idle-timeout 1`: an episode opened and abandoned is expired."""
    with cli_server(CALC, {"num_train": 5}, extra=("--idle-timeout", "1")) as url:
        with urllib.request.urlopen(f"{url}/tasks?split=eval&limit=1", timeout=5) as r:
            task = json.loads(r.read())["tasks"][0]
        req = urllib.request.Request(f"{url}/reset", data=json.dumps({"task_id": task["id"]}).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["episode_id"].startswith("ep-")
        time.sleep(2.5)
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            h = json.loads(r.read())
        assert (h["open"], h["expired"]) == (0, 1), h


async def test_a_cleanup_cut_short_by_a_cancel_is_settled_before_the_env_closes():
    """A run's end cancels episodes that may be inside their env's cleanup (a served env's close call).
    The cleanup is shielded, so it outlives the episode; `agentrl run` closed the env (its HTTP
    session) right after, cutting the close off: episodes stayed open on the env server (`/health`
    open 1-4 after a short training run on a loaded host)."""
    import asyncio

    from agentrl.envs import SingleTurnEnv
    from agentrl.episode import run_episode, settle_cleanups
    from agentrl.rubrics import Rubric

    entered, closed = asyncio.Event(), []

    class SlowClose(SingleTurnEnv):
        async def cleanup(self, state):
            entered.set()
            await asyncio.sleep(0.3)  # a close call on its way to the env server
            closed.append(state)

    env = SlowClose(dataset=["hi"], rubric=Rubric([lambda completion: 0.0]))
    episode = asyncio.create_task(run_episode(env, ScriptedClient(lambda prompt: "hello"), env.dataset()[0]))
    await entered.wait()
    episode.cancel()  # the run ends while the episode closes
    with pytest.raises(asyncio.CancelledError):
        await episode
    assert closed == []  # still on its way
    assert await settle_cleanups(timeout=10) == 0
    assert len(closed) == 1
