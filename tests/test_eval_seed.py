"""`agentrl eval --seed` reproduces an eval, tool-call ids included, at any concurrency (issue 23, friction 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agentrl_cli import agentrl
from testkit import env_package

pytestmark = pytest.mark.slow

# every reply is a command: parsed into a call of `shell` (ids made by the framework, not the model)
SHELL_ENV = '''
from agentrl.envs import ToolEnv
from agentrl.rubrics import Rubric
from agentrl.types import Message, ToolCall


def shell(command: str) -> str:
    """Run a command.

    Args:
        command: the command line
    """
    return f"ran {len(command)} characters"


def said(completion) -> float:
    return float(len(completion) > 3)


class Shell(ToolEnv):
    def parse_assistant(self, text, state):
        if state.turn >= 2:
            return Message("assistant", text)
        return Message("assistant", text, tool_calls=[ToolCall("shell", '{"command": "ls"}')])


def load_environment():
    return Shell(tools=[shell], dataset=[f"list folder {i}" for i in range(4)], rubric=Rubric([said]), max_turns=3)
'''


def test_the_same_seed_gives_the_same_transcripts_at_any_concurrency(tmp_path, tiny_model):
    pkg = env_package(tmp_path / "shell_env", "shell-env", "shell_env", SHELL_ENV)
    model = tiny_model

    def run(out: Path, concurrency: int) -> list[list[dict]]:
        r = agentrl("eval", pkg, "--model", model, "-n", "4", "-r", "2", "-c", concurrency, "-T", "1.0",
                    "--seed", "7", "--max-tokens", "16", "--out", out)
        assert r.returncode == 0, r.stderr[-2000:]
        recs = sorted((json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()),
                      key=lambda x: (x["task_index"], x["rollout"]))
        meta = json.loads((out / "meta.json").read_text())
        assert meta["sampling"]["seed"] == 7 and meta["sampling"]["temperature"] == 1.0, meta
        return [x["messages"] for x in recs]

    first, again, wide = run(tmp_path / "a", 1), run(tmp_path / "b", 1), run(tmp_path / "c", 4)
    assert sum(m.get("tool_calls") is not None for t in first for m in t) >= 8, "every episode calls the tool"
    assert first == again
    assert first == wide
