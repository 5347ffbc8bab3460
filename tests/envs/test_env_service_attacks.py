"""`agentrl env serve` under attack: each test is an attack a review made on the env service.

Real parts: a real aiohttp server (in process, or the real CLI in a subprocess), real HTTP
clients (aiohttp sessions standing in for a second, hostile client; the real RemoteEnvironment
for the honest one), real bwrap sandboxes where an env has them."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from agentrl_cli import agentrl
from door import closed_within_async
from env_service import CALC, ROOT, calc, cli_server, get, post, served, tool_call
from testkit import free_port

from agentrl.config import Config
from agentrl.envs.remote import RemoteEnvironment
from agentrl.envs.serve import client_of
from agentrl.errors import AgentrlError
from agentrl.plugins import load_environment
from agentrl.recipes.rl import served_env_room
from agentrl.types import Trajectory


async def test_another_client_cannot_step_close_or_score_an_episode_it_did_not_open():
    """Attack: ids were ep0, ep1..., and any client could step, close and score any episode.
    Client B holds A's episode id (a leaked log line) but not A's secret: every call is refused,
    and A's episode is untouched (A steps, closes and scores it afterwards)."""
    env = calc()
    async with served(env) as url:
        a = await asyncio.to_thread(RemoteEnvironment, url)
        task = a.eval_dataset()[0]
        state = await a.setup(task)
        eid = state["episode_id"]
        real = state["episode_secret"]
        near = real[:-1] + ("B" if real.endswith("A") else "A")  # one character off, never the real one
        async with aiohttp.ClientSession() as b:
            for secret in (None, "", "x" * 32, near):
                body = {"episode_id": eid, "assistant": tool_call("1+1"), "parse": True}
                if secret is not None:
                    body["episode_secret"] = secret
                status, out = await post(b, f"{url}/step", body)
                assert status == 403 and "opened by another client" in out["error"], (status, out)
                status, out = await post(b, f"{url}/close", {"episode_id": eid, "episode_secret": secret})
                assert status == 403, (status, out)
            traj = {"task": task.to_dict(), "messages": [], "sequences": []}
            status, out = await post(b, f"{url}/score", {"episodes": [{"episode_id": eid, "trajectory": traj}]})
            assert status == 200 and "opened by another client" in out["scores"][0]["error"], out
            junk = [{"episode_id": eid, "episode_secret": state["episode_secret"], "trajectory": {"junk": 1}}]
            status, out = await post(b, f"{url}/score", {"episodes": junk})  # malformed: 400, nothing taken
            assert status == 400 and "episodes[0].trajectory is not a trajectory" in out["error"], out
        # A's episode was neither stepped nor closed by B: A plays it out and it scores 1.0
        reply = await a.step(state, a.parse_assistant(tool_call(task.prompt[-1].content[8:-1])["content"], state))
        assert [m.role for m in reply] == ["tool"], reply
        await a.step(state, a.parse_assistant(reply[0].content, state))  # the answer: the tool's result
        await a.cleanup(state)
        t = Trajectory(task=task, messages=list(state.messages))
        t.state = state
        await a.rubric.score_group([t])
        assert t.error is None and t.reward == 1.0, (t.error, t.reward)
        await a.aclose()


async def test_episode_ids_and_secrets_cannot_be_guessed():
    """Attack: sequential ids (ep0, ep1...) let a client name the next client's episode."""
    async with served(calc()) as url:
        async with aiohttp.ClientSession() as s:
            _, page = await get(s, f"{url}/tasks?split=eval&limit=1")
            tid = page["tasks"][0]["id"]
            opened = [await post(s, f"{url}/reset", {"task_id": tid}) for _ in range(20)]
    ids = [out["episode_id"] for _, out in opened]
    secrets_ = [out["episode_secret"] for _, out in opened]
    assert len(set(ids)) == len(set(secrets_)) == 20
    assert not any(re.fullmatch(r"ep_?\d+", i) for i in ids), ids[:3]
    assert all(len(i) >= 16 for i in ids) and all(len(x) >= 32 for x in secrets_)  # ≥ 96 / 192 random bits
    assert not set(secrets_) & set(ids)


async def test_open_episodes_are_capped_per_client_and_in_all_before_setup_runs():
    """Attack: 3,000 episodes were accepted from one client, each holding env state (and, for a
    sandbox env, a sandbox).  A refused reset never runs the env's setup, and closing an episode
    frees its slot; the total cap holds with a per-client cap above it."""
    env = calc()
    setups = 0
    orig = env.setup

    async def counting_setup(task):
        nonlocal setups
        setups += 1
        return await orig(task)

    env.setup = counting_setup
    async with served(env, max_open=3, max_open_per_client=2) as url:
        async with aiohttp.ClientSession() as one:
            _, page = await get(one, f"{url}/tasks?split=eval&limit=1")
            tid = page["tasks"][0]["id"]
            first = [await post(one, f"{url}/reset", {"task_id": tid}) for _ in range(2)]
            assert [s for s, _ in first] == [200, 200]
            status, out = await post(one, f"{url}/reset", {"task_id": tid})
            assert status == 429 and "--max-open-per-client" in out["error"] and "loopback" in out["error"], out
            assert "rollout.max_in_flight + eval.concurrency" in out["error"], out  # what a run must fit under it
            assert setups == 2
            eid, secret = first[0][1]["episode_id"], first[0][1]["episode_secret"]
            assert (await post(one, f"{url}/close", {"episode_id": eid, "episode_secret": secret}))[0] == 200
            assert (await post(one, f"{url}/reset", {"task_id": tid}))[0] == 200
            _, health = await get(one, f"{url}/health")
            assert health["open"] == 2
    async with served(calc(), max_open=3, max_open_per_client=10) as url:
        async with aiohttp.ClientSession() as one:
            tid = (await get(one, f"{url}/tasks?split=eval&limit=1"))[1]["tasks"][0]["id"]
            assert [(await post(one, f"{url}/reset", {"task_id": tid}))[0] for _ in range(3)] == [200] * 3
            status, out = await post(one, f"{url}/reset", {"task_id": tid})
            assert status == 429 and "3 open episodes (its --max-open)" in out["error"], out


async def test_other_loopback_addresses_are_the_same_client():
    """Attack: the per-client cap counted addresses, and every 127.x.y.z reaches a loopback
    server: a client bound 127.0.0.2..11 in turn and held ten times its cap.  All loopback
    (and ::1, and the IPv4-mapped forms a dual-stack socket reports) is one client."""
    async with served(calc(), max_open_per_client=2) as url:
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(f"127.0.0.{k}", 0)))
                    for k in range(1, 12)]  # fmt: skip
        try:
            _, page = await get(sessions[0], f"{url}/tasks?split=eval&limit=1")
            tid = page["tasks"][0]["id"]
            statuses = [(await post(s, f"{url}/reset", {"task_id": tid}))[0] for s in sessions]
            assert statuses == [200, 200] + [429] * 9, statuses
            _, health = await get(sessions[0], f"{url}/health")
            assert health["open"] == 2
        finally:
            for s in sessions:
                await s.close()
    assert {client_of(a) for a in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "::ffff:127.0.0.3",
                                   "::ffff:7f00:2")} == {"loopback"}  # fmt: skip
    assert client_of("::ffff:10.1.2.3") == client_of("10.1.2.3") == "10.1.2.3"
    assert client_of("2001:db8::1") == client_of("2001:db8::ffff:2") != client_of("2001:db8:0:1::1")
    assert client_of("fe80::1%eth0") == client_of("fe80::2") and client_of(None) == "?"


def test_a_run_that_would_not_fit_under_the_servers_caps_is_refused_before_it_starts(tmp_path):
    """Every loopback address is one client, so all of a run's local rollout workers and its held-out
    evaluation share one --max-open-per-client: a run that needs more used to start, then errored
    episodes with 429s mid-run.  Now `agentrl run` refuses at once (exit 2, one line naming the
    flag and the number to give it), before a run dir or an engine exists; a run that fits passes the check."""
    with cli_server(CALC, {"num_train": 10}, extra=("--max-open-per-client", "128", "--max-open", "1000")) as url:
        cfg = tmp_path / "c.toml"
        cfg.write_text("")
        r = agentrl("run", cfg, f"--env.name={url}", "--sft.enabled=false", "--rollout.max_in_flight=96",
                    f"--run.dir={tmp_path / 'run'}", timeout=120)  # fmt: skip
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
        assert "--max-open-per-client 160 or more" in r.stderr and "loopback" in r.stderr, r.stderr
        assert "rollout.max_in_flight: 96 + eval.concurrency: 64" in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()

        def room(**over):
            c = Config.model_validate({"env": {"name": url}, **over})
            return served_env_room(c)

        assert room() is None  # the defaults, 64 + 64, fit 128 exactly
        # 8 Ray workers on this machine, each running whole groups of 16: 8 x 16 + 64 held-out > 128
        with pytest.raises(AgentrlError, match=r"over 8 rollout workers: 128 \+ eval.concurrency: 64\), and every "
                           r"loopback address is one client there: restart .* --max-open-per-client 192 or more"):
            room(cluster={"backend": "ray", "rollout_workers": 8}, rollout={"group_size": 16})
        assert room(cluster={"backend": "ray", "rollout_workers": 8}, eval={"every": 0}) is None  # 8 x 8
        with pytest.raises(AgentrlError, match=r"at most 1000 open episodes \(its --max-open\).* --max-open 1064 or"):
            room(rollout={"max_in_flight": 1000})


async def test_a_client_cannot_set_the_answer():
    """Attack: /reset took the whole task from the client, answer included, and /score scored
    against the trajectory's task: a client named its own answer and got reward 1 for it."""
    env = calc()
    async with served(env) as url:
        remote = await asyncio.to_thread(RemoteEnvironment, url)
        task = remote.eval_dataset()[0]
        forged = {**task.to_dict(), "answer": 7, "id": "task_mine"}
        async with aiohttp.ClientSession() as s:
            status, out = await post(s, f"{url}/reset", {"task": forged})
            assert status == 400 and "task_id" in out["error"], out
            status, out = await post(s, f"{url}/reset", {"task_id": "task_mine", "task": forged})
            assert status == 404 and "runs only its own tasks" in out["error"], out
            status, opened = await post(s, f"{url}/reset", {"task_id": task.id})
            eid, secret = opened["episode_id"], opened["episode_secret"]
            await post(s, f"{url}/step", {"episode_id": eid, "episode_secret": secret, "parse": True,
                                          "assistant": {"role": "assistant", "content": "It is 7."}})  # fmt: skip
            await post(s, f"{url}/close", {"episode_id": eid, "episode_secret": secret})
            traj = {"task": forged, "messages": [], "sequences": []}
            status, out = await post(s, f"{url}/score", {"episodes": [
                {"episode_id": eid, "episode_secret": secret, "trajectory": traj}]})  # fmt: skip
        assert task.answer != 7
        assert status == 200 and out["scores"][0]["error"] is None and out["scores"][0]["reward"] == 0.0, out
        await remote.aclose()


def test_with_a_key_every_route_but_health_needs_it(tmp_path):
    """Attack: no auth, so anyone who reached the port ran the env's tools.  Started with
    AGENTRL_API_KEY, the CLI server refuses calls without it (401), answers /health, and the
    client that reads the same variable works; binding beyond loopback warns."""
    key = "arl-test-key-0123456789"
    with cli_server(CALC, {"num_train": 5}, environ={"AGENTRL_API_KEY": key}) as url:
        def status(route: str, headers: dict, data: bytes | None = None) -> int:
            req = urllib.request.Request(f"{url}{route}", headers={"Content-Type": "application/json", **headers},
                                         data=data)  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        for route, data in (("/info", None), ("/tasks", None), ("/reset", b'{"task_id": "x"}'),
                            ("/demonstrations", b'{"n": 1}')):  # fmt: skip
            assert status(route, {}, data) == 401, route
            assert status(route, {"Authorization": "Bearer wrong"}, data) == 401, route
            assert status(route, {"Authorization": key}, data) == 401, route  # not a Bearer header
        assert status("/health", {}) == 200
        assert status("/info", {"Authorization": f"Bearer {key}"}) == 200
        with pytest.raises(AgentrlError, match="requires an API key: set AGENTRL_API_KEY"):
            RemoteEnvironment(url)
        with pytest.raises(AgentrlError, match="refused the API key"):
            RemoteEnvironment(url, api_key="wrong")
        assert RemoteEnvironment(url, api_key=key).name == "calc"
    from agentrl.envs.serve import exposure_warning

    assert exposure_warning("127.0.0.1", keyed=False) is None and exposure_warning("::1", keyed=False) is None
    assert "NO API key" in exposure_warning("0.0.0.0", keyed=False)
    assert "beyond this machine" in exposure_warning("10.1.2.3", keyed=True)


def test_the_cli_warns_when_it_binds_beyond_loopback():
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl.cli", "env", "serve", CALC, "--port", str(port), "--host", "0.0.0.0",
           "--env-args", '{"num_train": 2}', "--api-key", "arl-some-key-0123456789"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "(API key required)" in lines[0] and "warning: the env server listens on 0.0.0.0" in lines[1], lines


def test_a_power_tower_in_a_tool_call_is_an_error_reply_and_health_stays_up():
    """Attack: calc's exponent check passed (((9**64)**64)**64)**64; the tool timed out, but
    its thread kept computing and froze /health for 145 s.  Now the tool refuses it at once;
    /health, asked while the call is in flight, answers."""
    with cli_server(CALC, {"num_train": 5}) as url:
        remote = RemoteEnvironment(url)

        async def attack():
            state = await remote.setup(remote.eval_dataset()[0])
            msg = remote.parse_assistant(tool_call("(((9**64)**64)**64)**64")["content"], state)
            step = asyncio.create_task(remote.step(state, msg))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            async with aiohttp.ClientSession() as s:
                health = await asyncio.wait_for(get(s, f"{url}/health"), timeout=20)
            reply = await asyncio.wait_for(step, timeout=20)
            await remote.cleanup(state)
            await remote.aclose()
            return health, reply, time.monotonic() - t0

        health, reply, _ = asyncio.run(attack())
        assert health[0] == 200 and reply[0].role == "tool" and "too large" in reply[0].content, (health, reply)


async def test_an_abandoned_sandbox_episode_expires_and_frees_its_sandbox():
    """Attack: never-closed episodes took every sandbox of a 2-sandbox env, so every other
    client waited forever.  The per-client cap keeps one client to one sandbox here, and its
    abandoned episode is expired after the idle timeout, giving its sandbox back.  (Every
    loopback address is one client, so the test has one client; two distinct clients' caps are
    tested by the loopback cap test.)"""
    from agentrl.envs.sandbox_env import SandboxEnv
    from agentrl.rubrics import Rubric
    from agentrl.sandbox import SandboxLimits, why_unavailable

    if why := why_unavailable("bwrap"):
        pytest.skip(f"bwrap sandbox unavailable: {why}")
    limits = SandboxLimits(timeout_s=3.0, cpu_s=1, memory_bytes=256 << 20, pids=24, output_bytes=64 << 10,
                           disk_bytes=16 << 20)  # fmt: skip
    env = SandboxEnv(dataset=["go"], rubric=Rubric([lambda completion: 1.0]), sandbox_backend="bwrap",
                     sandbox_limits=limits, max_sandboxes=2, max_turns=3)  # fmt: skip
    try:
        async with served(env, max_open_per_client=1, idle_timeout_s=1.0) as url:
            async with aiohttp.ClientSession() as client:
                _, page = await get(client, f"{url}/tasks")
                tid = page["tasks"][0]["id"]
                assert (await post(client, f"{url}/reset", {"task_id": tid}))[0] == 200
                status, out = await post(client, f"{url}/reset", {"task_id": tid})
                assert status == 429, out  # it cannot take the second sandbox
                assert env.pool().snapshot().live == 1
                for _ in range(100):  # the abandoned episode goes idle; the reaper expires it
                    await asyncio.sleep(0.1)
                    _, health = await get(client, f"{url}/health")
                    if health["expired"]:
                        break
                assert (health["open"], health["expired"]) == (0, 1), health
                for _ in range(100):  # expiry is counted first; the reaper's cleanup (a sandbox reset) follows
                    stats = env.pool().snapshot()
                    if stats.idle:
                        break
                    await asyncio.sleep(0.1)
                assert (stats.live, stats.idle) == (1, 1)  # the expired episode's sandbox is back in the pool
                # the client's cap is free again and the pool's sandbox serves the next episode
                status, out = await asyncio.wait_for(post(client, f"{url}/reset", {"task_id": tid}), timeout=30)
                assert status == 200, out
                assert env.pool().snapshot().live == 1  # reused, not a new sandbox
    finally:
        await env.close()


async def test_private_tasks_show_a_client_no_answers_and_still_score():
    """An eval served to a client it does not trust: with private_tasks, /tasks shows ids and
    prompts only, and the episode is still scored against the server's own answer."""
    async with served(calc(), private_tasks=True) as url:
        remote = await asyncio.to_thread(RemoteEnvironment, url)
        async with aiohttp.ClientSession() as s:
            _, page = await get(s, f"{url}/tasks?split=eval&limit=3")
            _, info = await get(s, f"{url}/info")
        assert info["private_tasks"] is True
        assert all(set(t) == {"id", "prompt"} for t in page["tasks"]), page["tasks"][0]
        task = remote.eval_dataset()[0]
        assert task.answer is None and task.info == {}
        state = await remote.setup(task)
        expr = task.prompt[-1].content[len("What is "):-1]
        reply = await remote.step(state, remote.parse_assistant(tool_call(expr)["content"], state))
        await remote.step(state, remote.parse_assistant(reply[0].content, state))
        await remote.cleanup(state)
        t = Trajectory(task=task, messages=list(state.messages))
        t.state = state
        await remote.rubric.score_group([t])
        assert t.error is None and t.reward == 1.0, (t.error, t.reward)
        await remote.aclose()


async def test_private_tasks_refuse_the_routes_that_play_tasks_to_their_answers():
    """Attack: with private_tasks /tasks hides the answers, but /demonstrations played the
    server's tasks to their answers (guess: the last guess is the secret number) and /reference
    let a client have the server solve an eval task turn by turn.  Both are refused (and /info
    says there is no reference policy); an honest client's episode still scores."""
    env = load_environment(str(ROOT / "environments/guess"), num_train=4)
    async with served(env, private_tasks=True) as url:
        async with aiohttp.ClientSession() as s:
            _, info = await get(s, f"{url}/info")
            _, page = await get(s, f"{url}/tasks?split=train&limit=1")
            task = page["tasks"][0]
            _, demos = await post(s, f"{url}/demonstrations", {"n": 4})
            status, ref = await post(s, f"{url}/reference", {"task_id": task["id"], "messages": task["prompt"]})
        assert info["reference_policy"] is False
        assert not demos.get("conversations") and "--private-tasks" in demos["error"], str(demos)[:300]
        assert status == 403 and "message" not in ref and "--private-tasks" in ref["error"], (status, ref)
        remote = await asyncio.to_thread(RemoteEnvironment, url)
        assert remote.reference_policy() is None
        with pytest.raises(NotImplementedError, match="private-tasks"):
            await asyncio.to_thread(remote.demonstrations, 1)
        await remote.aclose()


async def test_a_key_or_secret_that_is_not_utf8_is_refused_not_a_500():
    """Attack: a bearer token with bytes that are not UTF-8 (or an episode_secret "\\ud800" in
    JSON) made the key comparison raise: a 500 and a traceback per request instead of 401/403."""
    env = calc()
    async with served(env, api_key="k" * 32) as url:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
        await writer.drain()
        head = (await reader.read()).split(b"\r\n", 1)[0]
        writer.close()
        assert head == b"HTTP/1.1 401 Unauthorized", head
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer " + "k" * 32}) as s:
            _, page = await get(s, f"{url}/tasks?limit=1")
            _, opened = await post(s, f"{url}/reset", {"task_id": page["tasks"][0]["id"]})
            lone = json.dumps({"episode_id": opened["episode_id"], "episode_secret": "SECRET"}).replace("SECRET", "\\ud800")
            async with s.post(f"{url}/close", data=lone, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 403, (r.status, await r.text())
            status, _ = await post(s, f"{url}/close", {"episode_id": opened["episode_id"],
                                                       "episode_secret": opened["episode_secret"]})  # fmt: skip
            assert status == 200


async def test_private_tasks_take_no_step_past_the_envs_limits():
    """Attack: the server left max_turns to the client's loop, so a client of a private eval kept
    stepping (its turn held at 1): guess with max_turns=2 was solved by bisection in 6 steps and
    scored 1.0.  With private_tasks a step past max_turns, or after the env said done, is a 409."""
    env = load_environment(str(ROOT / "environments/guess"), num_train=4, max_turns=2)
    secret = {t.id: int(t.answer) for t in env.eval_dataset()}
    async with served(env, private_tasks=True) as url:
        async with aiohttp.ClientSession() as s:
            _, page = await get(s, f"{url}/tasks?split=eval&limit=1")
            tid = page["tasks"][0]["id"]

            async def step(ep: dict, guess: int) -> tuple[int, dict]:
                return await post(s, f"{url}/step", {"episode_id": ep["episode_id"], "turn": 1,
                                                     "episode_secret": ep["episode_secret"],
                                                     "assistant": {"role": "assistant", "content": f"<guess>{guess}</guess>"}})  # fmt: skip

            _, ep = await post(s, f"{url}/reset", {"task_id": tid})
            for _ in range(2):
                assert (await step(ep, -1))[0] == 200
            status, out = await step(ep, secret[tid])
            assert status == 409 and "max_turns=2" in out["error"], (status, out)
            _, ep = await post(s, f"{url}/reset", {"task_id": tid})
            status, out = await step(ep, secret[tid])
            assert status == 200 and out["done"], out
            status, out = await step(ep, secret[tid])
            assert status == 409 and "done" in out["error"], (status, out)


def test_a_page_or_a_rebound_name_cannot_use_the_env_server():
    """Attack: the env server had no key by default and checked neither Host nor Origin, so a
    web page the user opened could call it, by a name that rebinds to 127.0.0.1 (and read the
    answers: /tasks), or by a cross-site "simple" POST (text/plain: no preflight) to /reset, up
    to the per-client cap the run's own episodes share.  Both are 403 now; the names and pages
    ``--allowed-hosts`` / ``--allowed-origins`` give are served."""
    import httpx
    from door import LOCAL_HOSTS, assert_foreign_hosts_refused, assert_foreign_origins_refused

    with cli_server(CALC, {"num_train": 4}, extra=("--allowed-hosts", "env.lan", "--allowed-origins",
                                                   "http://dash.lan")) as url, httpx.Client(base_url=url, timeout=30) as http:
        port = int(url.rsplit(":", 1)[1])
        task_id = http.get("/tasks?limit=1").json()["tasks"][0]["id"]
        assert_foreign_hosts_refused(http, "GET", "/tasks", port, {})
        assert_foreign_origins_refused(http, "POST", "/reset", {"Content-Type": "text/plain"},
                                       content=json.dumps({"task_id": task_id}))  # fmt: skip
        assert http.get("/health").json()["open"] == 0  # no refused reset opened an episode
        for host in (*LOCAL_HOSTS, "env.lan:{port}"):
            assert http.get("/tasks?limit=1", headers={"Host": host.format(port=port)}).status_code == 200, host
        r = http.post("/reset", json={"task_id": task_id}, headers={"Origin": "http://dash.lan"})
        assert r.status_code == 200 and r.json()["episode_id"], r.text


async def test_idle_slow_and_surplus_connections_are_closed():
    """Attack: aiohttp closes an idle connection after an hour, and has no header deadline and
    no connection cap, so a local process held a thousand silent connections to the env server
    (or the gateway, inside the run's own process) until the process ran out of file
    descriptors.  Now: silent or slow headers closed after ``header_timeout_s``, a body not all
    in after ``body_total_s``, past ``max_connections`` a new connection is dropped."""
    from agentrl.envs.serve import serve
    from agentrl.guard import AiohttpDoor, Limits

    limits = Limits(header_timeout_s=1.0, body_total_s=2.0, keep_alive_s=1, max_connections=4)
    port = free_port()
    ready = asyncio.Event()
    server = asyncio.create_task(serve(calc(), port=port, door=AiohttpDoor(limits=limits),
                                       on_ready=lambda url: ready.set()))  # fmt: skip
    try:
        await asyncio.wait_for(ready.wait(), 30)
        opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        (silent, _), (slow_head, w_head), (slow_body, w_body) = opened
        w_head.write(b"GET /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        w_body.write(b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")  # fmt: skip
        t0 = time.monotonic()

        async def drip() -> None:  # a byte now and then: never a pause, never done
            for _ in range(30):
                await asyncio.sleep(0.3)
                w_body.write(b" ")

        dripping = asyncio.create_task(drip())
        assert await closed_within_async(silent, 5) and await closed_within_async(slow_head, 5)
        assert await closed_within_async(slow_body, 8), "a body dripped for ever held its connection"
        assert time.monotonic() - t0 >= 1.5  # the body had its body_total_s
        dripping.cancel()
        for _, w in opened:
            w.close()
    finally:
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
    # the cap, with deadlines far off: only the cap can close the fifth connection this soon
    door = AiohttpDoor(limits=Limits(header_timeout_s=60.0, max_connections=4))
    port, ready = free_port(), asyncio.Event()
    server = asyncio.create_task(serve(calc(), port=port, door=door, on_ready=lambda url: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]  # idle, holding the cap
        await asyncio.sleep(0.2)
        assert door.open == 4
        surplus, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_within_async(surplus, 0.5), "a fifth connection was served past max_connections=4"
        assert door.open == 4
        for _, w in held:
            w.close()
        await asyncio.sleep(0.3)
        assert door.open == 0  # the slots came back
        async with aiohttp.ClientSession() as s:
            status, health = await get(s, f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["status"] == "ok"
    finally:
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server


async def test_the_gateway_has_the_same_door():
    """The gateway (agent programs' endpoint, in the run's process) refuses a rebound name and
    closes a silent connection; it checks the key before it reads a body, as before."""
    from agentrl.envs import ScriptedClient
    from agentrl.gateway import Gateway
    from agentrl.guard import Limits
    from agentrl.types import SamplingParams

    gateway = Gateway(limits=Limits(header_timeout_s=1.0))
    try:
        s = await gateway.open(ScriptedClient(lambda p: "x"), SamplingParams(max_tokens=8), tool_parser="hermes",
                               max_calls=1, max_total_tokens=None, max_seq_len=None, token_exact=True)  # fmt: skip
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:
            async with http.post(s.base_url + "/chat/completions", json=body,
                                 headers={"Host": "attacker.example"}) as r:  # fmt: skip
                assert r.status == 403 and "DNS-rebinding" in (await r.json())["error"]["message"]
            assert s.calls == 0
        host, port = s.base_url.removeprefix("http://").split("/", 1)[0].split(":")
        silent, _ = await asyncio.open_connection(host, int(port))
        assert await closed_within_async(silent, 5)
    finally:
        await gateway.close()
