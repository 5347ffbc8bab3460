"""JudgeRubric against a real HTTP server speaking the OpenAI chat API."""

import asyncio
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rubrics import JudgeRubric
from agentrl.rubrics.judge import JudgeReply, yes_means_correct
from agentrl.rubrics.rubric import score_episodes
from agentrl.types import Message, Task, Trajectory


class JudgeServer:
    """Says "yes" when the response contains the reference answer; can fail N times first."""

    def __init__(self):
        self.requests = 0
        self.fail_next = 0
        self.in_flight = 0
        self.max_in_flight = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests += 1
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(0.05)
            self.in_flight -= 1
            text = body["messages"][0]["content"]
            answer = text.split("Reference answer:\n")[1].split("\n")[0]
            response = text.split("Response:\n")[1].split("\n\n")[0]
            verdict = "yes" if answer in response else "no"
            return {
                "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": verdict}}],
            }

        self.server, self.thread, self.port = _serve(app)


def _serve(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, int]:
    # the server gets the bound, listening socket itself: no free-port-then-rebind race, and a
    # request that comes before uvicorn serves waits in the backlog (no start-up polling)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    s = JudgeServer()
    yield s
    s.server.should_exit = True
    s.thread.join(5)


def traj(reply, answer):
    task = Task([Message("user", "What is 2+2?")], answer=answer)
    return Trajectory(task=task, messages=[*task.prompt, Message("assistant", reply)])


async def test_judge_scores_caches_caps_concurrency_and_retries(server):
    rubric = JudgeRubric(base_url=f"http://127.0.0.1:{server.port}/v1", model="judge", max_concurrency=2, backoff_s=0.01)
    ts = [traj("It is 4.", "4"), traj("It is 5.", "4"), traj("It is 4.", "4"), traj("4!", "4"), traj("six", "6")]
    before = server.requests
    await rubric.score_group(ts)
    assert [t.reward for t in ts] == [1.0, 0.0, 1.0, 1.0, 0.0] and all(t.error is None for t in ts)
    assert server.requests - before == 4  # the duplicate question was answered from the cache
    assert server.max_in_flight <= 2

    server.fail_next = 2  # transient 503s are retried
    t = traj("Maybe 4", "4")
    await rubric.score_group([t])
    assert t.reward == 1.0 and t.error is None
    await rubric.judge.close()


async def test_judge_down_marks_episode_errored(server):
    rubric = JudgeRubric(base_url="http://127.0.0.1:9/v1", model="judge", max_retries=1, backoff_s=0.01, timeout_s=2)
    t = traj("4", "4")
    await rubric.score_group([t])
    assert t.reward == 0.0 and "judge unavailable" in t.error


# ----------------------------------------------------------------------------- a strict fake
# Validates requests as the OpenAI API does (400 for unknown or malformed fields) and answers
# with a complete chat.completion; what it says is scripted per response text.

_ALLOWED = {"model", "messages", "max_tokens", "temperature"}


class ScriptedJudge:
    """Replies ``script[response] = (content, finish_reason, delay_s)`` for the question's response."""

    def __init__(self):
        self.script: dict[str, tuple[str | None, str, float]] = {}
        self.requests = 0
        app = FastAPI()

        def invalid(message):
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=400)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            if not request.headers.get("authorization", "").startswith("Bearer "):
                return JSONResponse({"error": {"message": "missing API key"}}, status_code=401)
            body = await request.json()
            if set(body) - _ALLOWED:
                return invalid(f"Unrecognized request argument supplied: {sorted(set(body) - _ALLOWED)}")
            msgs = body.get("messages")
            if not isinstance(body.get("model"), str) or not isinstance(msgs, list) or not msgs:
                return invalid("model and messages are required")
            if any(m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str)
                   for m in msgs):  # fmt: skip
                return invalid("each message needs a role and string content")
            if not isinstance(body.get("max_tokens", 1), int) or body.get("max_tokens", 1) < 1:
                return invalid("max_tokens must be a positive integer")
            self.requests += 1
            response = msgs[-1]["content"].split("Response:\n")[1].split("\n\n")[0]
            content, finish, delay = self.script[response]
            await asyncio.sleep(delay)
            return {
                "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "logprobs": None, "finish_reason": finish,
                             "message": {"role": "assistant", "content": content, "refusal": None}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
            }  # fmt: skip

        self.server, self.thread, self.port = _serve(app)


@pytest.fixture(scope="module")
def scripted():
    s = ScriptedJudge()
    yield s
    s.server.should_exit = True
    s.thread.join(5)


def _rubric(judge, **kwargs):
    return JudgeRubric(base_url=f"http://127.0.0.1:{judge.port}/v1", model="judge", backoff_s=0.01, **kwargs)


# (judge's content, finish_reason, reward, or the error's text when the verdict cannot be read)
VERDICT_GOLDEN = [
    ("Yes", "stop", 1.0),
    ("No", "stop", 0.0),
    ("yes", "stop", 1.0),
    ("**Yes**", "stop", 1.0),
    (" no.\n", "stop", 0.0),
    ("YES!", "stop", 1.0),
    ('"No"', "stop", 0.0),
    ("<think>5 is not 4</think>\nNo", "stop", 0.0),
    ("Yes", "length", 1.0),  # cut, but the verdict is there
    ("", "stop", "judge verdict unparseable: ''"),
    (None, "stop", "judge verdict unparseable: ''"),
    ("Correct.", "stop", "judge verdict unparseable: 'Correct.'"),
    ("<think>The response says 5, reference 4", "length", "cut at max_tokens"),
    ("I cannot judge this.", "stop", "judge verdict unparseable"),
    ("The response is correct: yes", "stop", "judge verdict unparseable"),
    ("Yes, it is incorrect", "stop", "judge verdict unparseable"),
    ("yesno", "stop", "judge verdict unparseable"),
]


async def test_verdicts_golden(scripted):
    rubric = _rubric(scripted)
    ts = []
    for i, (content, finish, _) in enumerate(VERDICT_GOLDEN):
        scripted.script[f"verdict {i}"] = (content, finish, 0.0)
        ts.append(traj(f"verdict {i}", "4"))
    await score_episodes(rubric, ts)  # never raises
    for t, (content, _, want) in zip(ts, VERDICT_GOLDEN, strict=True):
        if isinstance(want, float):
            assert (t.reward, t.error) == (want, None), (content, t.error)
        else:  # an unreadable verdict errors the episode (counted, rerun on --resume), never a silent 0
            assert t.reward == 0.0 and t.error_kind == "rubric" and want in (t.error or ""), (content, t.error)
    await rubric.judge.close()


async def test_a_custom_parser_gets_the_reply_and_its_finish_reason(scripted):
    seen = []

    def parse(reply):
        seen.append((type(reply), str(reply), reply.finish_reason))
        return 1.0 if "correct" in reply.lower() else 0.0

    scripted.script["custom"] = ("Correct.", "length", 0.0)
    rubric = _rubric(scripted, parse=parse)
    t = traj("custom", "4")
    await score_episodes(rubric, [t])
    assert (t.reward, t.error) == (1.0, None) and seen == [(JudgeReply, "Correct.", "length")]
    assert yes_means_correct("Yes") == 1.0 and yes_means_correct(JudgeReply("no", "stop")) == 0.0
    await rubric.judge.close()


async def test_one_askers_timeout_does_not_reach_another_sharing_the_request(scripted):
    # two episodes, one question: the first gives up (its wait_for times out) while the second
    # still waits; the second gets the verdict, from the one request, and nothing raises
    scripted.script["shared"] = ("Yes", "stop", 1.0)
    rubric = _rubric(scripted)
    a, b = traj("shared", "4"), traj("shared", "4")
    before = scripted.requests

    async def second():
        await asyncio.sleep(0.1)
        await score_episodes(rubric, [b])

    first = asyncio.wait_for(score_episodes(rubric, [a]), 0.4)
    got = await asyncio.gather(first, second(), return_exceptions=True)
    assert isinstance(got[0], TimeoutError) and got[1] is None
    assert (b.reward, b.error) == (1.0, None)
    assert scripted.requests - before == 1 and rubric.judge._pending == {}
    await rubric.judge.close()


async def test_a_timed_out_asker_gets_a_rubric_error_and_a_lone_one_cancels_the_request(scripted):
    scripted.script["slow"] = ("Yes", "stop", 1.0)
    rubric = _rubric(scripted)
    rubric.timeout_s = 0.4  # the rubric's own wall limit per reward function
    a, b = traj("slow", "4"), traj("slow", "4")
    before = scripted.requests

    async def second():  # joins a's request; still waiting when a's limit cancels a's wait
        await asyncio.sleep(0.1)
        await score_episodes(rubric, [b])

    got = await asyncio.gather(score_episodes(rubric, [a]), second(), return_exceptions=True)
    assert got == [None, None]
    for t in (a, b):
        assert t.reward == 0.0 and t.error_kind == "rubric" and "TimeoutError" in t.error
    assert rubric.judge._pending == {}  # no asker left: the request was cancelled
    rubric.timeout_s = None  # a later asker starts afresh, not on the cancelled request
    c = traj("slow", "4")
    await score_episodes(rubric, [c])
    assert (c.reward, c.error) == (1.0, None) and scripted.requests - before == 2
    await rubric.judge.close()
