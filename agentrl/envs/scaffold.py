"""``agentrl env init NAME``: write a ready-to-install environment package."""

from __future__ import annotations

import re
from pathlib import Path

from agentrl.errors import AgentrlError

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")

PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{name}: an agentrl environment"
requires-python = ">=3.11"
dependencies = ["agentrl"]

[project.entry-points."agentrl.environments"]
{name} = "{module}:load_environment"

[tool.setuptools]
py-modules = ["{module}"]
'''

MODULE = '''"""{name}: reverse a word with the `reverse` tool, then answer with the result."""

import json
import random

from agentrl.envs import ToolEnv
from agentrl.rubrics import Rubric
from agentrl.types import Message, ToolCall


def reverse(text: str) -> str:
    """Reverse a piece of text.

    Args:
        text: the text to reverse
    """
    return text[::-1]


def correct(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)


class ReverseEnv(ToolEnv):
    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """Solved conversations, each starting with a training task's prompt: the warm start
        (SFT) a freshly built model needs before RL (`agentrl run`'s [sft] section)."""
        rng, tasks, out = random.Random(seed), list(self.dataset()), []
        for _ in range(n):
            task = rng.choice(tasks)
            word = task.answer[::-1]
            call = ToolCall("reverse", json.dumps({{"text": word}}))
            out.append([*task.prompt, Message("assistant", "", tool_calls=[call]),
                        Message("tool", reverse(word), tool_call_id=call.id, name="reverse"),
                        Message("assistant", task.answer)])
        return out


def load_environment(num_tasks: int = 200, seed: int = 0, **kwargs) -> ToolEnv:
    rng = random.Random(seed)
    words = sorted({{"".join(rng.choices("abcdefgh", k=5)) for _ in range(num_tasks + 50)}})
    rng.shuffle(words)
    data = [{{"question": f"Reverse {{w}}", "answer": w[::-1]}} for w in words]
    return ReverseEnv(
        tools=[reverse],
        dataset=data[50:],
        eval_dataset=data[:50],
        rubric=Rubric([correct]),
        max_turns=3,
        **kwargs,
    )
'''

TEST = '''import asyncio

from {module} import load_environment, reverse

from agentrl.envs.check import check_environment


def test_tool():
    assert reverse("abc") == "cba"


def test_environment_contract():
    report = asyncio.run(check_environment(load_environment(num_tasks=20)))
    assert report.ok, report.failures()
'''

README = '''# {dist}

An [agentrl](https://example.invalid/agentrl) environment: `{name}`.

    pip install -e .                      # registers the `{name}` entry point
    agentrl env test {name}               # contract checklist with a scripted policy
    agentrl eval {name} --model MODEL_DIR -n 20 -r 4

Edit `{module}.py`: the dataset, the tools, the rubric's reward functions, and the
demonstrations a fresh model warm-starts on before RL (`agentrl run`).
Its arguments are `load_environment()`'s keyword arguments (their defaults hold however the
package is installed); `--env-args '{{"num_tasks": 50}}'` overrides them.
'''


def scaffold_environment(name: str, parent: str | Path = ".") -> Path:
    """Create ``parent/name/`` with pyproject, module, README and a test; returns the dir."""
    if not _NAME.match(name):
        raise AgentrlError(f"bad environment name {name!r}: use lowercase letters, digits, '-' or '_'")
    module = name.replace("-", "_")
    dist = f"agentrl-env-{name.replace('_', '-')}"
    root = Path(parent) / name
    if root.exists():
        raise AgentrlError(f"{root} already exists; pick another name or remove it")
    root.mkdir(parents=True)
    fields = {"name": name, "module": module, "dist": dist}
    (root / "pyproject.toml").write_text(PYPROJECT.format(**fields))
    (root / f"{module}.py").write_text(MODULE.format(**fields))
    (root / f"test_{module}.py").write_text(TEST.format(**fields))
    (root / "README.md").write_text(README.format(**fields))
    return root
