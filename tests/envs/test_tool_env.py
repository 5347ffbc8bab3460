"""ToolEnv: schemas from hints and docstrings, hidden state args, every failure as a tool message."""

import asyncio
import json

from agentrl.envs import EpisodeError, State, ToolEnv
from agentrl.envs.check import ScriptedClient
from agentrl.rubrics import Rubric
from agentrl.types import Message, SamplingParams, Task, ToolCall


def search(query: str, limit: int = 3, exact: bool = False) -> list[str]:
    """Search the notes.

    Args:
        query: words to look for
        limit: how many hits
            at most (continued line)
        exact: match whole words only
    """
    return [query] * limit


async def slow_echo(text: str) -> str:
    """Echo after a while."""
    await asyncio.sleep(1.0)
    return text


def remember(key: str, value: str, state: State) -> str:
    """Store a value for this episode."""
    state.setdefault("memory", {})[key] = value
    return f"stored {len(state['memory'])}"


def fetch(path: str, sandbox) -> str:
    """Read a file from the episode's sandbox.

    :param path: file path
    """
    return sandbox[path]


def explode(n: int) -> int:
    """Always fails."""
    raise ZeroDivisionError("n/0")


def infra() -> str:
    """The backing service is gone."""
    raise EpisodeError("sandbox died")


class SandboxTools(ToolEnv):
    async def setup(self, task):
        state = State(task)
        state["sandbox"] = {"/a.txt": "hello"}
        return state


def make_env(**kw):
    return SandboxTools(
        tools=[search, slow_echo, remember, fetch, explode, infra],
        state_args=["sandbox"],
        tool_timeout_s=0.2,
        dataset=["go"],
        rubric=Rubric([lambda completion: 1.0]),
        **kw,
    )


def test_schemas_from_type_hints_and_docstrings():
    schemas = {s["function"]["name"]: s["function"] for s in make_env().tool_schemas()}
    s = schemas["search"]
    assert s["description"] == "Search the notes."
    props = s["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for"}
    assert props["limit"]["type"] == "integer" and props["limit"]["default"] == 3
    assert props["limit"]["description"] == "how many hits at most (continued line)"
    assert props["exact"]["type"] == "boolean" and s["parameters"]["required"] == ["query"]
    # hidden arguments never reach the model's schema
    assert set(schemas["remember"]["parameters"]["properties"]) == {"key", "value"}
    assert set(schemas["fetch"]["parameters"]["properties"]) == {"path"}
    assert schemas["fetch"]["parameters"]["properties"]["path"]["description"] == "file path"
    assert make_env(show_tools=False).tool_schemas() is None


def calls_policy(*texts):
    """Turn k replies with texts[k]."""

    def policy(prompt: str) -> str:
        return texts[min(prompt.count("<|im_start|>assistant") - 1, len(texts) - 1)]

    return policy


def call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


async def run(*texts, **kw):
    env = make_env(**kw)
    return await env.rollout(ScriptedClient(calls_policy(*texts)), next(iter(env.dataset())), SamplingParams(max_tokens=1000))


async def test_successful_calls_sync_async_and_stateful():
    t = await run(call("search", query="x", limit=2) + "\n" + call("remember", key="k", value="v"),
                  call("fetch", path="/a.txt"), "done")
    tool_msgs = [m for m in t.messages if m.role == "tool"]
    assert [m.content for m in tool_msgs] == ['["x", "x"]', "stored 1", "hello"]
    assert [m.name for m in tool_msgs] == ["search", "remember", "fetch"]
    assert t.stop_reason == "done" and t.metrics["tool_calls"] == 3 and t.metrics.get("tool_errors", 0) == 0
    assert t.state["memory"] == {"k": "v"}


async def test_every_failure_is_a_tool_message_and_a_metric():
    t = await run(
        "\n".join([
            call("nope"),
            call("search", query="x", limit="many"),
            call("search", query="x", bogus=1),
            call("search"),
            call("explode", n=1),
            call("slow_echo", text="hi"),
            "<tool_call>{broken</tool_call>",
        ]),
        "ok then",
    )
    assert t.error is None and t.stop_reason == "done" and len(t.turns) == 2  # the episode went on
    errors = [m.content for m in t.messages if m.role == "tool"]
    assert all(e.startswith("Error: ") for e in errors) and len(errors) == 7
    text = "\n".join(errors)
    for expected in ["invalid JSON", "unknown tool 'nope'; available tools: search", "limit: Input should be a valid integer",
                     "bogus: Extra inputs", "query: Field required", "ZeroDivisionError: n/0", "timed out after 0.2s"]:
        assert expected in text, expected
    m = t.metrics
    assert (m["tool_errors"], m["tool_parse_errors"], m["tool_unknown"], m["tool_bad_args"], m["tool_raised"], m["tool_timeouts"]) == (7, 1, 1, 3, 1, 1)


async def test_episode_error_from_a_tool_marks_the_episode():
    t = await run(call("infra"), "never")
    assert t.stop_reason == "error" and t.error_kind == "tool"
    assert t.error == "ToolError: tool 'infra' failed: EpisodeError: sandbox died"


async def test_missing_state_for_hidden_arg_is_an_episode_error():
    env = ToolEnv(tools=[fetch], state_args=["sandbox"], dataset=["go"])
    t = await env.rollout(
        ScriptedClient(calls_policy(call("fetch", path="/a"), "x")), Task([Message("user", "go")]), SamplingParams(max_tokens=300)
    )
    assert "setup() did not provide" in t.error


async def test_chat_mode_uses_server_parsed_tool_calls():
    env = make_env()
    client = ScriptedClient(calls_policy(call("search", query="q", limit=1), "fine"))
    t = await env.rollout(client, next(iter(env.dataset())), SamplingParams(max_tokens=300), token_exact=False)
    assert t.error is None and t.stop_reason == "done" and t.sequences == []
    assert t.messages[1].tool_calls[0].name == "search" and t.messages[2].content == '["q"]'


async def test_call_tool_directly_with_raw_arguments():
    env = make_env()
    state = State(Task([Message("user", "x")]))
    assert await env.call_tool(ToolCall("search", "[1]"), state) == "Error: arguments of 'search' must be a JSON object"
    assert (await env.call_tool(ToolCall("search", "{bad"), state)).startswith("Error: arguments of 'search' are not valid JSON")
