"""JudgeRubric against a real HTTP server speaking the OpenAI chat API."""

import asyncio
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rubrics import JudgeRubric
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

        # the server gets the bound, listening socket itself: no free-port-then-rebind race, and a
        # request that comes before uvicorn serves waits in the backlog (no start-up polling)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()


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


async def test_judge_down_marks_episode_errored(server):
    rubric = JudgeRubric(base_url="http://127.0.0.1:9/v1", model="judge", max_retries=1, backoff_s=0.01, timeout_s=2)
    t = traj("4", "4")
    await rubric.score_group([t])
    assert t.reward == 0.0 and "judge unavailable" in t.error
