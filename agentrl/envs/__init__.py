"""What an environment author imports: the contract, its shapes, tool use, and the checker.

``Environment`` (the hooks, ``envs/base.py``), ``SingleTurnEnv`` and ``MultiTurnEnv``,
``ToolEnv`` (Python functions as tools; ``with_latency`` makes one slow on purpose), ``SandboxEnv`` (``bash``/``python`` tools in a
per-episode sandbox), ``HarnessEnv`` (an existing agent program, a command or an async
function, calling the model through an episode-scoped OpenAI-compatible gateway), ``GymEnv`` (a gymnasium environment played in text) and
``as_gymnasium`` (the other way round); ``check_environment`` is the executable contract
``agentrl env test`` runs.  The episode loop itself is the framework's
(``agentrl.episode``).
"""

from typing import Any

from agentrl.envs.base import Environment, State, as_task
from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.envs.latency import ToolLatency, with_latency
from agentrl.envs.multiturn import MultiTurnEnv, SingleTurnEnv
from agentrl.envs.tool_env import Tool, ToolEnv
from agentrl.errors import EpisodeError, ToolError

__all__ = [
    "Environment",
    "EpisodeError",
    "GymEnv",
    "HarnessEnv",
    "MultiTurnEnv",
    "SandboxEnv",
    "ScriptedClient",
    "SingleTurnEnv",
    "State",
    "Tool",
    "ToolEnv",
    "ToolError",
    "ToolLatency",
    "as_gymnasium",
    "as_task",
    "check_environment",
    "with_latency",
]


def __getattr__(name: str) -> Any:
    # imported on first use: gymnasium and the sandbox backends are not needed by every env
    if name == "SandboxEnv":
        from agentrl.envs.sandbox_env import SandboxEnv

        return SandboxEnv
    if name == "HarnessEnv":
        from agentrl.envs.harness import HarnessEnv

        return HarnessEnv
    if name == "GymEnv":
        from agentrl.envs.gym import GymEnv

        return GymEnv
    if name == "as_gymnasium":
        from agentrl.envs.as_gym import as_gymnasium

        return as_gymnasium
    raise AttributeError(f"module 'agentrl.envs' has no attribute {name!r}")
