"""HarnessEnv and the gateway: agent programs written with the real ``openai`` SDK, unchanged.

The programs run as subprocesses (sync SDK, streaming, tools) or in-process (AsyncOpenAI);
the policy is the scripted ChatML client here (exact, inspectable ids) and the real embedded
engine in ``test_harness_engine.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import textwrap
import time

import aiohttp
import pytest

from agentrl.envs import HarnessEnv, ScriptedClient
from agentrl.envs.check import IM_END, decode
from agentrl.envs.harness import why_no_pid_namespace
from agentrl.rubrics import Rubric
from agentrl.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=200)
ROWS = [{"id": "t1", "prompt": "What is 2+3?", "answer": "5", "info": {"level": 1}}]


def program(tmp_path, body: str, name: str = "agent.py") -> list[str]:
    path = tmp_path / name
    path.write_text("import json, os, sys\nfrom openai import OpenAI\nTASK = json.loads(os.environ['AGENTRL_TASK'])\n"
                    + textwrap.dedent(body))  # fmt: skip
    return [sys.executable, str(path)]


def tool_policy(prompt: str) -> str:
    """Calls the calculator once, then answers with the tool's result."""
    if "<|im_start|>tool\n" in prompt:
        return "The answer is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


async def run(env: HarnessEnv, client, task=None):
    try:
        return await env.rollout(client, task or env.dataset()[0], SAMPLING)
    finally:
        await env.close()


def sampled_ids(seq) -> list[int]:
    return [t for t, m in zip(seq.token_ids, seq.loss_mask, strict=True) if m]


# ----------------------------------------------------------------------------- the token record


async def test_a_linear_program_is_one_token_exact_sequence(tmp_path):
    cmd = program(tmp_path, """
        client = OpenAI()
        messages = list(TASK["prompt"])
        first = client.chat.completions.create(model="anything", messages=messages)
        messages += [first.choices[0].message, {"role": "user", "content": "Sure?"}]
        second = client.chat.completions.create(model="anything", messages=messages)
        print("thinking...")
        print(second.choices[0].message.content)
        print()
    """)
    client = ScriptedClient(lambda p: f"reply {p.count('<|im_start|>user')}")
    traj = await run(HarnessEnv(cmd, dataset=ROWS), client)
    assert traj.error is None, traj.error
    assert traj.stop_reason == "done" and traj.state["result"] == "reply 2"
    assert len(traj.turns) == 2 and traj.metrics["template_breaks"] == 0
    (seq,) = traj.sequences
    # the second call's prompt is the first sequence continued: the first reply's sampled ids
    # are kept as sampled, and the engine saw exactly the sequence's tokens
    first, second = client.prompts
    assert second[: len(first)] == first
    assert seq.token_ids[: len(second)] == second
    assert decode(sampled_ids(seq)) == "reply 1<|im_end|>reply 2<|im_end|>"
    assert seq.logprobs == [-0.5 if m else 0.0 for m in seq.loss_mask]
    assert [m.content for m in traj.messages] == ["What is 2+3?", "reply 1", "Sure?", "reply 2"]


async def test_a_program_that_edits_history_starts_a_counted_new_sequence(tmp_path):
    cmd = program(tmp_path, """
        client = OpenAI()
        messages = list(TASK["prompt"])
        first = client.chat.completions.create(model="m", messages=messages)
        # forks: the history the model wrote is summarised, not sent back
        summary = [{"role": "user", "content": "Earlier you said: " + first.choices[0].message.content}]
        second = client.chat.completions.create(model="m", messages=summary)
        print(second.choices[0].message.content)
    """)
    client = ScriptedClient(lambda p: "ok")
    traj = await run(HarnessEnv(cmd, dataset=ROWS), client)
    assert traj.error is None, traj.error
    assert len(traj.sequences) == 2 and traj.metrics["template_breaks"] == 1
    assert [s.token_ids[: len(p)] for s, p in zip(traj.sequences, client.prompts, strict=True)] == client.prompts
    assert "Earlier you said" not in decode(traj.sequences[0].token_ids)


async def test_concurrent_calls_of_one_episode_stay_apart(tmp_path):
    cmd = program(tmp_path, """
        import asyncio
        from openai import AsyncOpenAI

        async def main():
            client = AsyncOpenAI()
            base = list(TASK["prompt"])
            first = await client.chat.completions.create(model="m", messages=base)
            base.append(first.choices[0].message)

            async def branch(word):
                msgs = base + [{"role": "user", "content": word}]
                r = await client.chat.completions.create(model="m", messages=msgs)
                return r.choices[0].message.content

            print(await branch("warmup-done"))
            print(" ".join(await asyncio.gather(*(branch(w) for w in ("alpha", "beta", "gamma")))))
        asyncio.run(main())
    """)

    class SlowClient(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            await asyncio.sleep(0.2)  # the three branches are in flight together
            return await super().complete(prompt_ids, sampling, n)

    client = SlowClient(lambda p: "echo " + p.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0])
    traj = await run(HarnessEnv(cmd, dataset=ROWS), client)
    assert traj.error is None, traj.error
    assert traj.state["result"] == "echo alpha echo beta echo gamma"
    assert len(traj.turns) == 5
    # each sequence holds one line of the conversation: no branch's tokens inside another's
    texts = [decode(s.token_ids) for s in traj.sequences]
    for word in ("alpha", "beta", "gamma"):
        holders = [t for t in texts if word in t]
        assert len(holders) == 1 and sum(w in holders[0] for w in ("alpha", "beta", "gamma")) == 1
    assert traj.metrics["template_breaks"] == len(traj.sequences) - 1 >= 2
    for seq in traj.sequences:  # every sampled turn ends its own turn: nothing interleaved
        seq.validate()
        assert decode(sampled_ids(seq)).count("<|im_end|>") == sum(1 for t in sampled_ids(seq) if t == IM_END)


async def test_tools_streaming_and_the_async_sdk_in_process():
    seen = {}

    async def agent(client, task):
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}}}}}]
        messages = list(task["prompt"])
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice="auto")
        msg = r.choices[0].message
        seen["finish"] = r.choices[0].finish_reason
        call = msg.tool_calls[0]
        args = json.loads(call.function.arguments)
        messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": str(eval(args["expression"]))}]
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        seen["usage"] = usage
        seen["task"] = task
        return text

    def correct(result, answer) -> float:
        return float(result.endswith(answer))

    env = HarnessEnv(agent=agent, dataset=ROWS, rubric=Rubric([correct]), task_info=["level"])
    client = ScriptedClient(tool_policy)
    traj = await run(env, client)
    assert traj.error is None, traj.error
    assert seen["finish"] == "tool_calls" and traj.state["result"] == "The answer is 5"
    assert seen["usage"].completion_tokens == len(traj.turns[-1].completion_ids)
    assert "answer" not in seen["task"] and seen["task"]["info"] == {"level": 1}
    (seq,) = traj.sequences  # the tool result was bridged onto the sampled call
    assert len(traj.turns) == 2 and traj.metrics["template_breaks"] == 0
    await env.rubric.score(traj)
    assert traj.reward == 1.0


async def test_tool_choice_none_returns_the_text_unparsed():
    async def agent(client, task):
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        r = await client.chat.completions.create(model="m", messages=task["prompt"], tools=tools, tool_choice="none")
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    traj = await run(HarnessEnv(agent=agent, dataset=ROWS), ScriptedClient(tool_policy))
    assert traj.error is None, traj.error
    assert "<tool_call>" in traj.state["result"]


# ----------------------------------------------------------------------------- keys and limits


async def test_the_episode_key_guards_the_gateway_and_ends_with_the_episode(monkeypatch):
    monkeypatch.setenv("AGENTRL_API_KEY", "the-run-key")
    got = {}

    async def agent(client, task):
        import openai

        url = str(client.base_url).rstrip("/")
        got["url"], got["key"] = url, client.api_key
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": task["prompt"]}
            for name, headers in {"none": {}, "wrong": {"Authorization": "Bearer arl-wrong"},
                                  "run key": {"Authorization": "Bearer the-run-key"},
                                  "basic": {"Authorization": f"Basic {client.api_key}"}}.items():
                async with http.post(url + "/chat/completions", json=body, headers=headers) as r:
                    got[name] = r.status
            other = url.rsplit("/episodes/", 1)[0] + "/episodes/ep_notthisone/v1"
            async with http.post(other + "/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {client.api_key}"}) as r:
                got["other episode"] = r.status
        wrong = openai.AsyncOpenAI(base_url=url, api_key="arl-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=task["prompt"])
        await wrong.close()
        got["models"] = [m.id async for m in client.models.list()]
        r = await client.chat.completions.create(model="m", messages=task["prompt"])
        return r.choices[0].message.content

    env = HarnessEnv(agent=agent, dataset=ROWS)
    try:
        traj = await env.rollout(ScriptedClient(lambda p: "fine"), env.dataset()[0], SAMPLING)
        assert traj.error is None, traj.error
        assert {k: got[k] for k in ("none", "wrong", "run key", "basic", "other episode")} == dict.fromkeys(
            ("none", "wrong", "run key", "basic", "other episode"), 401)
        assert got["url"].endswith("/v1") and got["url"].startswith("http://127.0.0.1:") and len(got["models"]) == 1
        async with aiohttp.ClientSession() as http:  # the episode is over: its key opens nothing
            async with http.post(got["url"] + "/chat/completions", json={"model": "m", "messages": ROWS[0]["prompt"]},
                                 headers={"Authorization": f"Bearer {got['key']}"}) as r:
                assert r.status == 410
    finally:
        await env.close()


async def test_the_program_gets_the_episode_key_never_the_runs_or_the_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_API_KEY", "the-run-key")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-clusters-token")  # runs code on the cluster
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    cmd = program(tmp_path, """
        client = OpenAI()
        client.chat.completions.create(model="m", messages=TASK["prompt"])
        ray = [v for k, v in os.environ.items() if k.startswith("RAY_AUTH_TOKEN")]  # RAY_AUTH_MODE is no secret
        print(json.dumps({"run_key": os.environ.get("AGENTRL_API_KEY"), "ray": ray, "task": TASK,
                          "base": os.environ["OPENAI_BASE_URL"], "key": os.environ["OPENAI_API_KEY"][:4]}))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, task_info=["level"]), ScriptedClient(lambda p: "x"))
    seen = json.loads(traj.state["result"])
    assert seen["run_key"] is None and seen["ray"] == [] and seen["key"] == "arl-"
    assert seen["task"] == {"id": "t1", "prompt": [{"role": "user", "content": "What is 2+3?"}], "info": {"level": 1}}
    assert seen["base"].endswith("/v1")


@pytest.mark.parametrize("form", ["command", "agent"])
async def test_a_program_cannot_find_the_tasks_hidden_fields(tmp_path, form):
    """A dataset's other columns (tests with their expected outputs, the solution, a ground truth)
    land in ``task.info`` for the rubric.  ``AGENTRL_TASK`` carried all of it, and a coding agent
    the model steers can print its own environment: the program now sees only the info keys
    named in ``task_info``, and the rubric still gets everything."""
    rows = [{"id": "t1", "prompt": "Write f.", "answer": "SECRET-ANSWER", "solution": "SECRET-SOLUTION",
             "tests": [{"input": "1", "expected": "SECRET-EXPECTED"}],
             "info": {"ground_truth": "SECRET-TRUTH", "language": "python"}}]  # fmt: skip
    cmd = program(tmp_path, """
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        environ = open("/proc/self/environ", "rb").read().decode(errors="replace")
        print(json.dumps({"environ": environ, "task": TASK}))
    """)

    async def agent(client, task):
        await client.chat.completions.create(model="m", messages=task["prompt"])
        return json.dumps({"task": task})

    program_form = {"command": cmd} if form == "command" else {"agent": agent}
    env = HarnessEnv(**program_form, dataset=rows, task_info=["language", "not_a_key"])
    traj = await run(env, ScriptedClient(lambda p: "x"))
    assert traj.error is None, traj.error
    assert "SECRET" not in traj.state["result"] and "LEVEL" not in traj.state["result"]
    assert json.loads(traj.state["result"])["task"]["info"] == {"language": "python"}
    assert traj.task.info["solution"] == "SECRET-SOLUTION" and traj.task.info["ground_truth"] == "SECRET-TRUTH"
    env = HarnessEnv(**program_form, dataset=rows)  # the default: no info at all
    traj = await run(env, ScriptedClient(lambda p: "x"))
    assert traj.error is None and json.loads(traj.state["result"])["task"]["info"] == {}, traj.error


async def test_max_turns_caps_the_calls_of_an_episode(tmp_path):
    cmd = program(tmp_path, """
        import openai
        client = OpenAI(max_retries=0)
        n = 0
        try:
            while True:
                client.chat.completions.create(model="m", messages=TASK["prompt"])
                n += 1
        except openai.BadRequestError as e:
            print(n, "max_turns" in str(e))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, max_turns=3), ScriptedClient(lambda p: "x"))
    assert traj.error is None and traj.state["result"] == "3 True" and traj.stop_reason == "max_turns"


async def test_a_request_the_template_refuses_is_the_programs_400_not_an_endpoint_failure(tmp_path, small_model):
    """A chat template that raises on a request (Qwen-style ``raise_exception``) is the program's
    bad request: a 400 saying so, and no endpoint failure pinned on the episode.  It was a 502
    'the inference endpoint failed' and the episode's cause became kind ``endpoint``."""
    import shutil

    from agentrl.inference import PolicyClient

    tok = tmp_path / "tok"
    shutil.copytree(small_model, tok, ignore=shutil.ignore_patterns("*.safetensors"))
    template = tok / "chat_template.jinja"
    template.write_text("{%- if messages[0].role == 'assistant' -%}{{ raise_exception('Conversations must start "
                        "with a user message') }}{%- endif -%}" + template.read_text())  # fmt: skip
    seen = {}

    async def agent(client, task):
        import openai

        try:
            await client.chat.completions.create(model="m", messages=[{"role": "assistant", "content": "hi"}])
        except openai.APIStatusError as e:
            seen["status"], seen["message"] = e.status_code, str(e)
        raise RuntimeError("gave up")

    env = HarnessEnv(agent=agent, dataset=ROWS)
    # nothing listens there: only rendering, which is local, may happen
    async with PolicyClient("http://127.0.0.1:9", "m", tokenizer=str(tok), max_retries=0) as client:
        traj = await run(env, client)
    assert seen["status"] == 400, seen
    assert "chat template" in seen["message"] and "must start with a user message" in seen["message"]
    assert traj.error_kind == "env" and "gave up" in traj.error, (traj.error_kind, traj.error)


async def test_a_program_that_keeps_calling_past_its_limit_is_slowed_not_served_at_full_speed(tmp_path):
    """A retry loop past max_turns: each refusal used to come back at once, ~600 a second from one
    plain urllib loop on a loaded machine, a third of a core of the run's event loop (shared by
    every episode).  Now each further refusal waits a little longer: a handful in two seconds."""
    cmd = program(tmp_path, """
        import time, urllib.request
        url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
        body = json.dumps({"model": "m", "messages": TASK["prompt"]}).encode()
        headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
        statuses, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 2:
            try:
                statuses.append(urllib.request.urlopen(urllib.request.Request(url, body, headers)).status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
        try:  # past the limit a body is not even parsed
            urllib.request.urlopen(urllib.request.Request(url, b"{not json", headers))
        except urllib.error.HTTPError as e:
            print(json.dumps([statuses, e.read().decode()]))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, max_turns=2), ScriptedClient(lambda p: "x"))
    statuses, unparsed = json.loads(traj.state["result"])
    assert "max_turns" in unparsed and "not JSON" not in unparsed, unparsed
    assert traj.error is None and len(traj.turns) == 2 and traj.stop_reason == "max_turns"
    assert statuses[:2] == [200, 200] and set(statuses[2:]) == {400}
    assert len(statuses) < 40, len(statuses)  # waits of 0, 20, 40, ... ms: at most ~15 refusals fit 2 s


async def test_many_threads_calling_past_the_limit_are_slowed_together(tmp_path):
    """64 threads of one program flood calls past max_turns.  Each refusal used to wait on its own, so
    the waits overlapped: ~60 refusals a second (242 in 4 s), every one of them parsing its body.  The
    waits of one episode's refusals now run one after another: a few dozen in 4 s at most."""
    cmd = program(tmp_path, """
        import threading, time, urllib.request
        url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
        body = json.dumps({"model": "m", "messages": TASK["prompt"]}).encode()
        headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
        statuses, t0 = [], time.monotonic()

        def flood():  # a call queued longer than 2 s ends its thread (the queue would take a minute to drain)
            while time.monotonic() - t0 < 4:
                try:
                    statuses.append(urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=2).status)
                except urllib.error.HTTPError as e:
                    statuses.append(e.code)
                except (TimeoutError, urllib.error.URLError):
                    return

        threads = [threading.Thread(target=flood) for _ in range(64)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(json.dumps(statuses))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, max_turns=2, timeout_s=60), ScriptedClient(lambda p: "x"))
    statuses = json.loads(traj.state["result"])
    assert traj.error is None and len(traj.turns) == 2 and traj.stop_reason == "max_turns"
    assert statuses.count(200) == 2 and set(statuses) <= {200, 400}
    # waits of 0, 20, 40, ... ms one after another: ~20 fit 4 s, plus the calls still queued at the end
    assert statuses.count(400) < 100, statuses.count(400)


# ----------------------------------------------------------------------------- failures, named


@pytest.mark.parametrize("failed_exit", ["failure", "error"])
async def test_a_program_that_crashes_on_the_models_reply_is_the_policys_failure(tmp_path, failed_exit):
    """Most agent programs crash on a malformed tool call: a crash after the model's reply, filed
    as infrastructure (kind env), left the group, and the policy escaped a wrong answer by writing
    one that crashes its program.  By default it is kind ``program``, a failure kept in its group;
    ``failed_exit="error"`` (a program that handles any output itself) keeps it ``env``."""
    from agentrl.buffer import POLICY_ERRORS

    cmd = program(tmp_path, """
        reply = OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        json.loads(reply.choices[0].message.content)  # the model's output was to be JSON
    """)
    kwargs = {} if failed_exit == "failure" else {"failed_exit": "error"}
    traj = await run(HarnessEnv(cmd, dataset=ROWS, **kwargs), ScriptedClient(lambda p: "{not json"))
    assert traj.stop_reason == "error"
    assert "exited with code 1" in traj.error and "JSONDecodeError" in traj.error, traj.error
    assert len(traj.turns) == 1  # what it did sample is kept on the episode
    if failed_exit == "failure":
        assert traj.error_kind == "program" and traj.error_kind in POLICY_ERRORS, (traj.error_kind, traj.error)
        assert "counted as the policy's failure" in traj.error and "failed_exit='error'" in traj.error
    else:
        assert traj.error_kind == "env", (traj.error_kind, traj.error)


@pytest.mark.parametrize("form", ["command", "agent"])
async def test_a_program_that_fails_before_the_model_replied_is_the_programs(tmp_path, form):
    """Nothing the model wrote can have made a program fail before its first reply: kind env
    (never counted against the policy), whatever ``failed_exit`` says."""
    cmd = program(tmp_path, "import no_such_module_here\n")

    async def agent(client, task):
        raise KeyError("no such field")

    env = HarnessEnv(cmd, dataset=ROWS) if form == "command" else HarnessEnv(agent=agent, dataset=ROWS)
    traj = await run(env, ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "env" and not traj.turns, (traj.error_kind, traj.error)
    assert ("no_such_module_here" if form == "command" else "KeyError") in traj.error


async def test_a_program_that_never_calls_the_model_is_named(tmp_path):
    cmd = program(tmp_path, "print('no model needed'); print('oops', file=sys.stderr)")
    traj = await run(HarnessEnv(cmd, dataset=ROWS), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "env" and "without calling the model" in traj.error and "oops" in traj.error


def alive(token: str) -> list[int]:
    """Live processes (any pid namespace: seen from this one) whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token in open(f"/proc/{entry}/cmdline").read() and not _zombie(int(entry)):
                found.append(int(entry))
        except OSError:
            pass
    return found


needs_pid_namespace = pytest.mark.skipif(why_no_pid_namespace() is not None, reason=str(why_no_pid_namespace()))


@pytest.mark.parametrize("isolate", ["none", pytest.param("pid", marks=needs_pid_namespace)])
async def test_a_program_exit_code_over_128_is_its_own_not_a_signal(tmp_path, isolate):
    """sys.exit(200) is the program's own code (under bwrap it was reported as "killed by signal 72");
    a real kill is named as one (under bwrap: both ways, since bwrap reports it as exit 128 + N)."""
    cmd = program(tmp_path, """
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        print("giving up", file=sys.stderr, flush=True)
        if TASK["id"] == "exit":
            sys.exit(200)
        os.kill(os.getpid(), 9)
    """)
    rows = [{"id": "exit", "prompt": "hi", "answer": ""}, {"id": "kill", "prompt": "hi", "answer": ""}]
    env = HarnessEnv(cmd, dataset=rows, isolate=isolate)
    try:
        own, killed = [await env.rollout(ScriptedClient(lambda p: "x"), t, SAMPLING) for t in env.dataset()]
    finally:
        await env.close()
    assert own.error_kind == "program" and "giving up" in own.error  # after the model's reply: the policy's
    assert "exited with code 200 after" in own.error and "signal" not in own.error, own.error
    assert killed.error_kind == "program" and "giving up" in killed.error
    if isolate == "none":
        assert "was killed by signal 9 (SIGKILL) after" in killed.error, killed.error
    else:
        assert "exited with code 137 (or was killed by signal 9 (SIGKILL)" in killed.error, killed.error


@pytest.mark.parametrize("isolate", ["none", pytest.param("pid", marks=needs_pid_namespace)])
async def test_the_programs_session_is_swept_before_its_pid_is_freed(tmp_path, monkeypatch, isolate):
    """After the program exits, what it left in its session is killed by the session's number (its
    pid).  The sweep ran after the program was reaped, when that number may already be another
    process's: another episode's program, a session and group leader too, which ``killpg`` would
    kill.  Every signal to the session must go while the program is unreaped (a zombie holds its pid)."""
    from agentrl.envs import harness

    real_killpg, sent = os.killpg, []

    def killpg(pgid, sig):
        try:
            os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            sent.append("held")  # our child, running or a zombie: the number is still its own
        except ChildProcessError:
            sent.append("reaped")  # the number is free: it may be anyone's by now
        return real_killpg(pgid, sig)

    monkeypatch.setattr(harness.os, "killpg", killpg)
    cmd = program(tmp_path, """
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        print("done")
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, isolate=isolate), ScriptedClient(lambda p: "x"))
    assert traj.error is None and traj.state["result"] == "done", traj.error
    assert sent and set(sent) == {"held"}, sent


@pytest.mark.slow
@pytest.mark.parametrize("isolate", ["none", pytest.param("pid", marks=needs_pid_namespace)])
async def test_a_timeout_kills_the_whole_process_tree(tmp_path, isolate):
    token = f"stuck-{isolate}-{os.getpid()}-{time.monotonic_ns()}"
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import os, time; os.fork(); time.sleep(600)", {token!r}])
        print("stuck", file=sys.stderr, flush=True)
        time.sleep(600)
    """))
    t0 = time.monotonic()
    env = HarnessEnv([sys.executable, str(script), token], dataset=ROWS, timeout_s=10, isolate=isolate)
    traj = await run(env, ScriptedClient(lambda p: "x"))
    assert time.monotonic() - t0 < 60
    assert traj.error_kind == "env" and "did not finish within timeout_s=10s" in traj.error and "stuck" in traj.error
    assert alive(token) == []  # the program, its child and the child's forked grandchild


@needs_pid_namespace
async def test_an_isolated_program_that_calls_setsid_is_killed_with_its_namespace(tmp_path):
    """Without a pid namespace a process that starts a session of its own outlives the sweep;
    in one, it dies with the namespace's first process."""
    token = f"escapee-{os.getpid()}-{time.monotonic_ns()}"
    cmd = program(tmp_path, f"""
        import subprocess
        subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(600)", {token!r}],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        print("done")
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, isolate="pid"), ScriptedClient(lambda p: "x"))
    assert traj.error is None and traj.state["result"] == "done", traj.error
    for _ in range(50):
        if not alive(token):
            break
        await asyncio.sleep(0.1)
    assert alive(token) == []


KEY_THIEF = """
    import time, urllib.request, urllib.error
    from pathlib import Path
    mine, flags = os.environ["OPENAI_API_KEY"], Path(sys.argv[1])
    if TASK["id"] == "victim":
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        (flags / "victim-called").touch()
        while not (flags / "thief-done").exists():
            time.sleep(0.05)
        print("victim done")
        sys.exit(0)
    while not (flags / "victim-called").exists():
        time.sleep(0.05)
    stolen = []
    for entry in Path("/proc").iterdir():  # every process of this user shows its environment here
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split(chr(0)) if "=" in v)
        except (OSError, ValueError):
            continue
        victim = json.loads(env.get("AGENTRL_TASK", "{}")).get("id") == "victim"
        if victim and env["OPENAI_BASE_URL"].split("/episodes/")[0] == os.environ["OPENAI_BASE_URL"].split("/episodes/")[0]:
            stolen.append((env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]))  # the victim of this run's gateway
    status = None
    for url, key in stolen:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "planted"}]}).encode()
        req = urllib.request.Request(url + "/chat/completions", data=body, headers={
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            status = urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as e:
            status = e.code
    OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
    (flags / "thief-done").touch()
    print(json.dumps({"stolen": len(stolen), "status": status}))
"""


async def thief_and_victim(tmp_path, isolate: str):
    """Two concurrent episodes of one env: the thief looks for other episodes' keys in /proc
    and calls the victim's episode with what it finds."""
    flags = tmp_path / "flags"
    flags.mkdir()
    cmd = [*program(tmp_path, KEY_THIEF), str(flags)]
    rows = [{"id": "victim", "prompt": "What is 2+3?", "answer": "5"}, {"id": "thief", "prompt": "What is 1+1?", "answer": "2"}]
    env = HarnessEnv(cmd, dataset=rows, timeout_s=60, isolate=isolate)
    try:
        victim, thief = await asyncio.gather(*(env.rollout(ScriptedClient(lambda p: "x"), t, SAMPLING) for t in env.dataset()))
    finally:
        await env.close()
    assert victim.error is None and thief.error is None, (victim.error, thief.error)
    return victim, json.loads(thief.state["result"])


@needs_pid_namespace
async def test_a_program_cannot_take_another_episodes_key(tmp_path):
    """Attack: one episode's program read another's OPENAI_API_KEY and OPENAI_BASE_URL from
    /proc/<pid>/environ (same user) and called into that episode: its call became a turn of
    the victim's trajectory.  In a pid namespace of its own it sees no other program."""
    victim, thief = await thief_and_victim(tmp_path, "pid")
    assert (thief["stolen"], thief["status"]) == (0, None), thief
    assert len(victim.turns) == 1


async def test_without_isolation_the_key_theft_works(tmp_path):
    """The same attack with isolate='none' (what a host without bubblewrap gets, with a
    warning): it succeeds, so the test above tests something."""
    victim, thief = await thief_and_victim(tmp_path, "none")
    assert thief["stolen"] == 1 and thief["status"] == 200
    assert len(victim.turns) == 2


@needs_pid_namespace
async def test_an_isolated_program_cannot_read_the_runs_key_files(tmp_path, monkeypatch):
    """Attack: with the run's key gone from its environment, the program read ``RUN_DIR/api_key``
    (same user) or a key an engine wrote to the user's key directory, and could then sign a
    weight push over HTTP.  Under isolation both read empty."""
    from agentrl import auth

    run_key = auth.run_key(tmp_path / "run")  # what `agentrl run` does first
    monkeypatch.setattr(auth, "key_dir", lambda: tmp_path / "home-keys")
    auth.write_key(tmp_path / "home-keys" / "engine-8000.key", "the-engine-key")
    assert auth.read_key(tmp_path / "run" / "api_key") == run_key  # readable outside
    cmd = program(tmp_path, f"""
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        def read(p):
            try:
                return open(p).read()
            except OSError as e:
                return type(e).__name__
        print(json.dumps({{"run": read({str(tmp_path / "run" / "api_key")!r}),
                          "engine": read({str(tmp_path / "home-keys" / "engine-8000.key")!r})}}))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, isolate="pid"), ScriptedClient(lambda p: "x"))
    assert traj.error is None, traj.error
    seen = json.loads(traj.state["result"])
    assert run_key not in seen["run"] and "the-engine-key" not in seen["engine"], seen
    assert seen["run"] in ("", "PermissionError") and seen["engine"] == "FileNotFoundError", seen


@needs_pid_namespace
async def test_a_rollout_workers_programs_cannot_read_the_drivers_key_file(tmp_path, monkeypatch):
    """A Ray rollout worker is another process: it never wrote the run's key file, so it did not
    hide it.  The driver hands the worker its key files; the worker's programs read them empty."""
    from agentrl import auth
    from agentrl.distributed.roles import RolloutWorkerImpl

    key_file = tmp_path / "run" / "api_key"
    auth.write_key(key_file, "the-run-key")
    monkeypatch.setattr(auth, "_written", set())  # this process now plays the worker: it wrote nothing
    monkeypatch.setattr(auth, "key_dir", lambda: tmp_path / "no-keys")
    RolloutWorkerImpl("w0", None, "calc", {}, lambda: None, SAMPLING, group_size=2, max_in_flight=2,
                      key_files=(str(key_file),))  # fmt: skip
    cmd = program(tmp_path, f"""
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        try:
            print(json.dumps(open({str(key_file)!r}).read()))
        except OSError as e:
            print(json.dumps(type(e).__name__))
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, isolate="pid"), ScriptedClient(lambda p: "x"))
    assert traj.error is None, traj.error
    assert json.loads(traj.state["result"]) in ("", "PermissionError")


async def test_concurrent_first_episodes_share_one_gateway_server():
    """Episodes opened at once on a fresh env each started a server (all but the last leaked,
    never closed): the key-theft test above found its victim on another port."""
    from agentrl.gateway import Gateway

    gateway = Gateway()

    async def url_given() -> str:  # what a program started right after this open is told
        s = await gateway.open(ScriptedClient(lambda p: "x"), SAMPLING, tool_parser="hermes", max_calls=1,
                               max_total_tokens=None, max_seq_len=None, token_exact=True)  # fmt: skip
        return s.base_url.split("/episodes/")[0]

    try:
        assert len(set(await asyncio.gather(*(url_given() for _ in range(8))))) == 1
    finally:
        await gateway.close()


def test_without_bwrap_auto_warns_and_pid_refuses(tmp_path, monkeypatch):
    from agentrl.envs import harness

    monkeypatch.setitem(harness._isolation, "pid", "bwrap is not installed (test)")
    cmd = program(tmp_path, """
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        print("ran")
    """)
    with pytest.warns(harness.UnisolatedHarnessWarning, match="can read other episodes' keys"):
        traj = asyncio.run(run(HarnessEnv(cmd, dataset=ROWS), ScriptedClient(lambda p: "x")))
    assert traj.error is None and traj.state["result"] == "ran"
    traj = asyncio.run(run(HarnessEnv(cmd, dataset=ROWS, isolate="pid"), ScriptedClient(lambda p: "x")))
    assert traj.error_kind == "env" and "isolate='pid'" in traj.error and "bwrap is not installed" in traj.error


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_an_endpoint_failure_is_the_episodes_cause(tmp_path):
    cmd = program(tmp_path, "OpenAI(max_retries=0).chat.completions.create(model='m', messages=TASK['prompt'])")
    traj = await run(HarnessEnv(cmd, dataset=ROWS), ScriptedClient(fail=True))
    assert traj.error_kind == "endpoint" and "scripted endpoint is down" in traj.error


@pytest.mark.parametrize("form", ["command", "agent"])
async def test_a_program_that_swallows_every_failed_call_does_not_train_as_done(tmp_path, form):
    """The endpoint is down; the program catches the error and prints an apology (what agent
    frameworks do).  With no model reply at all the episode has nothing to train on: it is the
    endpoint's failure, as in a native env.  It used to end "done" with no turns and no
    sequences, its reward counting in its group's baseline."""
    cmd = program(tmp_path, """
        import openai
        try:
            OpenAI(max_retries=0).chat.completions.create(model="m", messages=TASK["prompt"])
        except openai.APIStatusError:
            print("sorry, the model is unavailable")
    """)

    async def agent(client, task):
        import openai

        try:
            await client.chat.completions.create(model="m", messages=task["prompt"])
        except openai.APIStatusError:
            return "sorry, the model is unavailable"

    env = HarnessEnv(cmd, dataset=ROWS) if form == "command" else HarnessEnv(agent=agent, dataset=ROWS)
    traj = await run(env, ScriptedClient(fail=True))
    assert traj.error_kind == "endpoint" and "scripted endpoint is down" in traj.error, (traj.error_kind, traj.error)

    async def refused(client, task):  # every call refused as a bad request: the program's, kind env
        import openai

        try:
            await client.chat.completions.create(model="m", messages=task["prompt"], n=2)
        except openai.BadRequestError:
            return "gave up"

    traj = await run(HarnessEnv(agent=refused, dataset=ROWS), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "env" and "no model reply" in traj.error and "n must be 1" in traj.error, traj.error


async def test_a_program_that_gave_up_waiting_for_its_reply_is_named_so(tmp_path):
    """The call was accepted, the model is slow, the program's client times out, it swallows that and
    exits 0: nothing was refused, so the error says the call got no reply (it used to say "its 0
    call(s) were refused (first: None)")."""
    cmd = program(tmp_path, """
        import openai
        try:
            OpenAI(max_retries=0, timeout=0.3).chat.completions.create(model="m", messages=TASK["prompt"])
        except openai.APITimeoutError:
            print("the model took too long")
    """)

    class Slow(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            await asyncio.sleep(3)
            return await super().complete(prompt_ids, sampling, n)

    traj = await run(HarnessEnv(cmd, dataset=ROWS), Slow(lambda p: "x"))
    assert traj.error_kind == "env", (traj.error_kind, traj.error)
    assert "its 1 call(s) got no reply before it exited" in traj.error and "refused" not in traj.error, traj.error


async def test_an_agent_that_raises_or_hangs_is_named():
    async def raises(client, task):
        await client.chat.completions.create(model="m", messages=task["prompt"])
        raise KeyError("no such field")

    async def hangs(client, task):
        await asyncio.sleep(600)

    traj = await run(HarnessEnv(agent=raises, dataset=ROWS), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "program" and "KeyError" in traj.error and "raises" in traj.error
    traj = await run(HarnessEnv(agent=raises, dataset=ROWS, failed_exit="error"), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "env" and "KeyError" in traj.error
    traj = await run(HarnessEnv(agent=hangs, dataset=ROWS, timeout_s=0.5), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "env" and "timeout_s=0.5s" in traj.error and "before calling the model" in traj.error


@pytest.mark.parametrize("form", ["command", "agent"])
async def test_a_program_that_loops_after_the_models_reply_times_out_as_the_policys_failure(tmp_path, form):
    """The model can make its program loop forever (a tool call that never ends, a retry loop on its
    own output): ``timeout_s`` passing after a model call was filed as kind env, left its group, and
    so was an escape from a wrong answer.  It is kind ``timeout``: a failure kept in the group."""
    from agentrl.buffer import POLICY_ERRORS

    cmd = program(tmp_path, """
        import time
        OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
        print("looping on the reply", file=sys.stderr, flush=True)
        while True:
            time.sleep(0.05)
    """)

    async def agent(client, task):
        await client.chat.completions.create(model="m", messages=task["prompt"])
        while True:
            await asyncio.sleep(0.05)

    env = HarnessEnv(cmd, dataset=ROWS, timeout_s=15) if form == "command" else \
        HarnessEnv(agent=agent, dataset=ROWS, timeout_s=0.5)  # fmt: skip
    traj = await run(env, ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "timeout" and traj.error_kind in POLICY_ERRORS, (traj.error_kind, traj.error)
    assert "did not finish within timeout_s=" in traj.error and "after 1 model call(s)" in traj.error
    assert len(traj.turns) == 1
    if form == "command":
        assert "looping on the reply" in traj.error


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="exactly one of"):
        HarnessEnv(dataset=ROWS)
    with pytest.raises(ValueError, match="argv list"):
        HarnessEnv("python agent.py", dataset=ROWS)
    with pytest.raises(ValueError, match="failed_exit must be 'failure'"):
        HarnessEnv(["true"], dataset=ROWS, failed_exit="zero")
    with pytest.raises(ValueError, match=r"task_info must be a list of info keys, e.g. \['level'\]"):
        HarnessEnv(["true"], dataset=ROWS, task_info="level")


async def test_a_chat_only_endpoint_records_calls_without_token_ids():
    """``token_exact=False`` (evaluating a hosted model): calls pass through the client's chat
    route, tool calls as the endpoint split them; turns are kept, no sequences."""

    async def agent(client, task):
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        messages = list(task["prompt"])
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        call = r.choices[0].message.tool_calls[0]
        messages += [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        r = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        return r.choices[0].message.content

    env = HarnessEnv(agent=agent, dataset=ROWS)
    try:
        traj = await env.rollout(ScriptedClient(tool_policy), env.dataset()[0], SAMPLING, token_exact=False)
    finally:
        await env.close()
    assert traj.error is None, traj.error
    assert traj.state["result"] == "The answer is 5" and len(traj.turns) == 2 and traj.sequences == []


async def test_a_langchain_program_trains_unchanged(tmp_path):
    pytest.importorskip("langchain_openai")
    cmd = program(tmp_path, """
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        @tool
        def calculator(expression: str) -> str:
            \"\"\"Evaluate an arithmetic expression.\"\"\"
            a, b = expression.split("+")
            return str(int(a) + int(b))

        llm = ChatOpenAI(model="gpt-4o-mini", max_retries=0).bind_tools([calculator])
        messages = [HumanMessage(TASK["prompt"][0]["content"])]
        ai = llm.invoke(messages)
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(calculator.invoke(call["args"]), tool_call_id=call["id"]))
        print(llm.invoke(messages).content)
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS, timeout_s=120), ScriptedClient(tool_policy))
    assert traj.error is None, traj.error
    assert traj.state["result"] == "The answer is 5"
    assert len(traj.turns) == 2 and len(traj.sequences) == 1 and traj.metrics["template_breaks"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("calls_first", [False, True], ids=["stuck-before-calling", "stuck-after-a-reply"])
async def test_the_episodes_own_wall_limit_also_kills_the_program(tmp_path, calls_first):
    """``rollout.episode_timeout_s`` shorter than the program's ``timeout_s`` (the defaults: 120 s and
    300 s): the episode's limit fired first and filed every hang as kind ``timeout``, the policy's
    failure, a program stuck before its first call included, without its name or its stderr.  The
    program's time now ends just before the episode's, so HarnessEnv tells the two apart: before
    any model call kind ``env``, after one ``timeout``; either way its processes die with it."""
    token, script = f"sleeper-{os.getpid()}-{time.monotonic_ns()}", tmp_path / "sleeper.py"
    call = "OpenAI().chat.completions.create(model='m', messages=TASK['prompt'])\n" if calls_first else ""
    script.write_text("import json, os, sys, time\nfrom openai import OpenAI\nTASK = json.loads(os.environ['AGENTRL_TASK'])\n"
                      f"{call}print('stuck here', file=sys.stderr, flush=True)\ntime.sleep(600)\n")  # fmt: skip
    env = HarnessEnv([sys.executable, str(script), token], dataset=ROWS, timeout_s=600)
    try:
        traj = await env.rollout(ScriptedClient(lambda p: "x"), env.dataset()[0], SAMPLING, timeout_s=8)
    finally:
        await env.close()
    assert traj.error_kind == ("timeout" if calls_first else "env"), (traj.error_kind, traj.error)
    assert "episode's wall limit left it" in traj.error and "timeout_s=600s" in traj.error, traj.error
    assert "stuck here" in traj.error and traj.error.startswith(("EpisodeTimeout: the program", "EpisodeError: the program")), traj.error
    assert ("after 1 model call(s)" if calls_first else "before calling the model") in traj.error, traj.error
    for _ in range(50):  # the kill is sent as the episode ends; the process goes a moment later
        if not alive(token):
            break
        await asyncio.sleep(0.1)
    assert alive(token) == []


@pytest.mark.parametrize("when", ["before", "after"])
async def test_an_agent_that_calls_sys_exit_ends_its_episode_not_the_run(when):
    """``sys.exit()`` in an in-process agent (a CLI's main() wrapped as the agent) raised SystemExit
    through the episode and the rollout: the run ended, exit code 0, no fate recorded.  It is the
    agent's failure, named; after a model call the policy's (kind program), before it kind env."""

    async def agent(client, task):
        if when == "after":
            await client.chat.completions.create(model="m", messages=task["prompt"])
        sys.exit(0)

    traj = await run(HarnessEnv(agent=agent, dataset=ROWS), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == ("program" if when == "after" else "env"), (traj.error_kind, traj.error)
    assert "SystemExit" in traj.error and "agent" in traj.error, traj.error


async def test_an_agents_own_cancelled_error_is_its_failure_not_the_groups_cancellation():
    """An agent that awaits a task it cancelled itself raises CancelledError: the episode re-raised it,
    the rollout manager abandoned the whole group, and its episodes stayed in flight until shutdown,
    then counted as interrupted with no cause.  It is the agent's failure, named."""

    async def agent(client, task):
        await client.chat.completions.create(model="m", messages=task["prompt"])
        helper = asyncio.ensure_future(asyncio.sleep(60))
        helper.cancel()
        await helper

    traj = await run(HarnessEnv(agent=agent, dataset=ROWS), ScriptedClient(lambda p: "x"))
    assert traj.error_kind == "program" and "CancelledError of its own" in traj.error, (traj.error_kind, traj.error)

    async def hangs(client, task):  # a real cancellation still cancels
        await asyncio.sleep(600)

    env = HarnessEnv(agent=hangs, dataset=ROWS)
    episode = asyncio.ensure_future(env.rollout(ScriptedClient(lambda p: "x"), env.dataset()[0], SAMPLING))
    await asyncio.sleep(0.3)
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    await env.close()


async def test_an_in_process_agents_client_timeout_holds_and_a_refused_first_call_does_not_hide_the_policy():
    """``client.with_options(timeout=...)`` never fired in-process (the transport ignored it), so an
    agent waited to the wall limit.  And the "was the model at work" rule compared admitted calls with
    every refusal: one refused before admission (an image part) plus one admitted call the model
    drew out past the client's timeout read as "model not at work", kind env, an escape."""
    import openai

    class Slow(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            await asyncio.sleep(30)
            return await super().complete(prompt_ids, sampling, n)

    async def agent(client, task):
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
        with contextlib.suppress(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=image)  # refused before admission
        await client.with_options(timeout=0.5).chat.completions.create(model="m", messages=task["prompt"])

    t0 = time.monotonic()
    traj = await run(HarnessEnv(agent=agent, dataset=ROWS, timeout_s=60), Slow(lambda p: "x"))
    assert time.monotonic() - t0 < 20, "the client's timeout did not hold"
    assert traj.error_kind == "program" and "APITimeoutError" in traj.error, (traj.error_kind, traj.error)


async def test_closing_the_env_does_not_wait_for_calls_of_ended_episodes():
    """A program killed mid-call leaves its call sampling; the episode's fate is set and
    ``env.close()`` returns without waiting for that call (or for the server's 60 s default)."""
    started = asyncio.Event()

    class Stuck(ScriptedClient):
        async def complete(self, prompt_ids, sampling, n=1):
            started.set()
            await asyncio.sleep(600)

    async def agent(client, task):
        await client.chat.completions.create(model="m", messages=task["prompt"])

    env = HarnessEnv(agent=agent, dataset=ROWS, timeout_s=600)
    episode = asyncio.ensure_future(env.rollout(Stuck(), env.dataset()[0], SAMPLING))
    await started.wait()
    episode.cancel()
    with pytest.raises(asyncio.CancelledError):
        await episode
    await asyncio.wait_for(env.close(), 30)  # a liveness bound: the default would hold it 60 s


async def test_a_call_without_the_key_is_refused_before_its_body_is_read():
    """A local process without a key announced a 16 MiB body and sent 10 bytes: the gateway read
    (and would have buffered) the body before checking the key, so it never answered."""
    from agentrl.gateway import Gateway

    gateway = Gateway()
    try:
        s = await gateway.open(ScriptedClient(lambda p: "x"), SAMPLING, tool_parser="hermes", max_calls=1,
                               max_total_tokens=None, max_seq_len=None, token_exact=True)  # fmt: skip
        host, rest = s.base_url.removeprefix("http://").split("/", 1)
        reader, writer = await asyncio.open_connection(*host.split(":"))
        writer.write(f"POST /{rest}/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer arl-wrong\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {16 << 20}\r\n\r\n{{\"model\":".encode())  # fmt: skip
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout=20)
        writer.close()
        assert status.split()[1] == b"401", status
    finally:
        await gateway.close()


@pytest.mark.parametrize("isolate", [pytest.param("pid", marks=needs_pid_namespace), "none"])
async def test_an_isolated_program_has_a_dev_shm_of_its_own(tmp_path, isolate):
    """The engines' weight segments live in /dev/shm under the run's uid: a program of that uid
    could rewrite the live policy.  Isolated, it sees an empty /dev/shm of its own."""
    import tempfile

    mark = tempfile.mkdtemp(prefix="agentrl-test-weights-", dir="/dev/shm")
    try:
        cmd = program(tmp_path, f"""
            import os
            OpenAI().chat.completions.create(model="m", messages=TASK["prompt"])
            print(os.path.exists({mark!r}))
        """)
        traj = await run(HarnessEnv(cmd, dataset=ROWS, isolate=isolate), ScriptedClient(lambda p: "x"))
        assert traj.error is None and traj.state["result"] == str(isolate == "none"), (traj.error, traj.state)
    finally:
        os.rmdir(mark)


async def test_a_program_that_gives_up_on_a_reply_the_model_drew_out_is_the_policys_failure(tmp_path):
    """No reply was recorded, but the model was why: it sampled past the program's own client
    timeout (a model rewarded for escaping can learn to ramble).  Kind program, not env."""

    class Slow(ScriptedClient):
        async def complete(self, *args, **kwargs):
            await asyncio.sleep(3)
            return await super().complete(*args, **kwargs)

    cmd = program(tmp_path, """
        OpenAI(timeout=0.5, max_retries=0).chat.completions.create(model="m", messages=TASK["prompt"])
    """)
    traj = await run(HarnessEnv(cmd, dataset=ROWS), Slow(lambda p: "x"))
    assert traj.error_kind == "program" and "after 1 model call(s)" in traj.error, (traj.error_kind, traj.error)
