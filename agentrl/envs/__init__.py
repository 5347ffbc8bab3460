"""Environments: the contract (base.py), the simple shapes, tool use, and the checker."""

from agentrl.envs.base import Environment, State, as_task
from agentrl.envs.check import ScriptedClient, check_environment
from agentrl.envs.multiturn import MultiTurnEnv, SingleTurnEnv
from agentrl.envs.tool_env import EpisodeError, Tool, ToolEnv

__all__ = [
    "Environment",
    "EpisodeError",
    "MultiTurnEnv",
    "SingleTurnEnv",
    "State",
    "ScriptedClient",
    "Tool",
    "ToolEnv",
    "as_task",
    "check_environment",
]
