"""SandboxEnv: a ToolEnv whose ``bash`` and ``python`` tools run in the episode's sandbox.

    env = SandboxEnv(dataset=[...], rubric=..., sandbox_limits=SandboxLimits(timeout_s=10))

Each episode gets its own sandbox in :meth:`setup` (from a :class:`SandboxPool` shared by
the environment: capped, pre-warmed, reset and reused between episodes) and gives it back
in :meth:`cleanup`.  A command's own failure (non-zero exit, timeout, OOM) is tool output
the model reads; a failure of the sandbox itself (:class:`SandboxError`) ends the episode
as errored — recorded, never trained on.  An OOM that took the sandbox's agent with the
command (``ExecResult.oom``, the sandbox gone) is the command's failure too: the model reads
it and the episode goes on in a fresh sandbox (:meth:`setup_sandbox` again; files written
since are gone), so running out of memory on purpose is no way out of an episode.  Subclasses prepare the sandbox by overriding
:meth:`setup_sandbox` (write files, install fixtures).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.envs.base import State
from agentrl.envs.tool_env import EpisodeError, ToolEnv
from agentrl.sandbox import SandboxError, SandboxLimits, SandboxPool
from agentrl.sandbox.base import AgentSandbox
from agentrl.types import Task


class SandboxEnv(ToolEnv):
    """Tools ``bash(command)`` and ``python(code)`` in a per-episode sandbox."""

    def __init__(
        self,
        tools: Iterable[Callable[..., Any]] = (),
        *,
        sandbox_backend: str = "auto",
        sandbox_limits: SandboxLimits | None = None,
        max_sandboxes: int = 32,
        prewarm_sandboxes: int = 0,
        builtin_tools: Iterable[str] = ("bash", "python"),
        **kwargs: Any,
    ) -> None:
        """``sandbox_backend``: auto | bwrap | docker | local (dev only).  ``max_sandboxes``:
        cap on live sandboxes (episodes beyond it wait in setup).  ``builtin_tools``: which of
        ``bash``/``python`` to offer."""
        self.sandbox_backend = sandbox_backend
        self.sandbox_limits = sandbox_limits or SandboxLimits()
        self.max_sandboxes = max_sandboxes
        self.prewarm_sandboxes = prewarm_sandboxes
        # a tool call must outlive the command's own timeout, or it would be cut off mid-exec
        kwargs.setdefault("tool_timeout_s", self.sandbox_limits.timeout_s + 60.0)
        kwargs.setdefault("stop_errors", (EpisodeError, SandboxError))
        super().__init__(tools, **kwargs)
        builtin = {"bash": self.bash, "python": self.python}
        for name in builtin_tools:
            if name not in builtin:
                raise ValueError(f"unknown builtin tool {name!r}; choose from bash, python")
            self.add_tool(builtin[name])
        self._pools: dict[asyncio.AbstractEventLoop, SandboxPool] = {}

    # --- the tools (``state`` is filled by ToolEnv and hidden from the schema)
    async def bash(self, command: str, state: State) -> str:
        """Run a bash command in the sandbox; the working directory is the sandbox's workdir.

        Args:
            command: the bash command line to run
        """
        return await self.run_in_sandbox(state, ["bash", "-c", command])

    async def python(self, code: str, state: State) -> str:
        """Run a Python 3 program in the sandbox and return what it printed.

        Args:
            code: the complete program source
        """
        return await self.run_in_sandbox(state, ["python3", "-c", code])

    async def run_in_sandbox(self, state: State, argv: list[str], stdin: str | None = None) -> str:
        sb: AgentSandbox | None = state.get("sandbox")
        if sb is None:
            raise EpisodeError("no sandbox in this episode (setup did not run?)")
        r = await sb.exec(argv, stdin=stdin)
        state.count("sandbox_execs")
        if r.timed_out:
            state.count("sandbox_timeouts")
        text = r.as_text(self.max_result_chars) or "(no output)"
        if r.oom and not sb.alive:  # the OOM killer took the sandbox with the command
            await self._replace_sandbox(state, sb)
            text += "[the sandbox was replaced by a fresh one: files written in this episode are gone]\n"
        return text

    async def _replace_sandbox(self, state: State, old: AgentSandbox) -> None:
        """A fresh sandbox for the rest of the episode, prepared like the first."""
        state.count("sandbox_replaced")
        del state["sandbox"]
        pool = self.pool()
        await pool.release(old)  # broken: destroyed, its place freed
        sb = await pool.get()
        state["sandbox"] = sb
        await self.setup_sandbox(sb, state)

    # --- episode lifecycle
    def pool(self) -> SandboxPool:
        """The pool for the running event loop (sandboxes cannot cross loops)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = SandboxPool(
                self.sandbox_backend, self.sandbox_limits, max_live=self.max_sandboxes, prewarm=self.prewarm_sandboxes
            )
            self._pools[loop] = pool
        return pool

    async def setup(self, task: Task) -> State:
        state = await super().setup(task)
        pool = self.pool()
        if not pool.snapshot().created and self.prewarm_sandboxes:
            await pool.start()
        sb = await pool.get()
        state["sandbox"] = sb
        await self.setup_sandbox(sb, state)
        return state

    async def setup_sandbox(self, sandbox: AgentSandbox, state: State) -> None:
        """Hook: prepare the fresh (or reset) sandbox for this episode's task."""

    async def cleanup(self, state: State) -> None:
        sb = state.pop("sandbox", None)
        if sb is not None:
            await self.pool().release(sb)
        await super().cleanup(state)

    async def close(self) -> None:
        """Destroy this environment's sandboxes (also happens at interpreter exit)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()
        await super().close()
