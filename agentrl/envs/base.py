"""The Environment contract: the hooks an environment author implements.

    dataset() -> Iterable[Task]            eval_dataset() -> Iterable[Task] | None
    async setup(task) -> State             async step(state, assistant_msg) -> list[Message]
    done(state) -> bool                    async cleanup(state)   (idempotent, always runs)
    rubric: Rubric                         tool_schemas() -> list[dict] | None
    parse_assistant(text, state) -> Message
    demonstrations(n, seed) -> list[list[Message]]   (optional, for warm-start SFT)

The framework owns the loop: :meth:`Environment.rollout` runs one episode through
:func:`agentrl.episode.run_episode` (token exactness, stop reasons, error kinds) and
returns a :class:`~agentrl.types.Trajectory`; it never raises for episode-level failures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from agentrl.episode import PolicyClientLike, run_episode
from agentrl.types import Message, SamplingParams, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.rubrics import Rubric

class State(dict):
    """Per-episode scratch space: a dict the env may fill with anything.

    The framework's own entries are also attributes: ``task``, ``messages`` (the whole
    conversation so far), ``turn`` (model turns taken), ``metrics`` (floats merged into the
    trajectory's metrics), ``done`` (set True from ``step`` to end the episode),
    ``tool_parser`` (the model's tool-call format, for ``parse_assistant``).
    """

    def __init__(self, task: Task, **extra: Any) -> None:
        super().__init__(task=task, messages=list(task.prompt), turn=0, metrics={}, done=False, **extra)

    task: Task = property(lambda self: self["task"])  # type: ignore[assignment]
    messages: list[Message] = property(lambda self: self["messages"])  # type: ignore[assignment]
    metrics: dict[str, float] = property(lambda self: self["metrics"])  # type: ignore[assignment]

    @property
    def turn(self) -> int:
        return self["turn"]

    @turn.setter
    def turn(self, value: int) -> None:
        self["turn"] = value

    @property
    def done(self) -> bool:
        return bool(self["done"])

    @done.setter
    def done(self, value: bool) -> None:
        self["done"] = value

    @property
    def tool_parser(self) -> str:
        """The model's tool-call format (a :mod:`agentrl.tool_format` parser name), set by the
        episode from the policy client before the first turn; ``setup`` may set it instead."""
        return self.get("tool_parser") or "hermes"

    @property
    def answer(self) -> Any:
        return self["task"].answer

    @property
    def info(self) -> dict[str, Any]:
        return self["task"].info

    def count(self, metric: str, by: float = 1.0) -> None:
        """Add ``by`` to a per-episode counter metric."""
        self["metrics"][metric] = self["metrics"].get(metric, 0.0) + by


def as_task(item: Task | dict[str, Any] | str, system_prompt: str | None = None) -> Task:
    """Accept a Task, a plain question string, or a dict with ``prompt``/``question`` + ``answer``.

    A dict's other keys (``difficulty``, ``tests``, ...) are kept in ``task.info`` beside
    its own ``info`` entries (which win on a clash), so a rubric can ask for them.
    """
    if isinstance(item, Task):
        task = item
    elif isinstance(item, str):
        task = Task(prompt=[Message("user", item)])
    elif isinstance(item, dict):
        key = "prompt" if "prompt" in item else "question"
        prompt = item.get(key)
        if isinstance(prompt, str):
            msgs = [Message("user", prompt)]
        elif isinstance(prompt, list):
            msgs = [Message.from_dict(m) for m in prompt]
        else:
            raise ValueError(f"dataset row needs a 'prompt' or 'question' (str or messages): {item!r}")
        own = item.get("info") or {}
        if not isinstance(own, dict):
            raise ValueError(f"dataset row's 'info' must be a dict, got {type(own).__name__}: {item!r}")
        info = {k: v for k, v in item.items() if k not in (key, "answer", "info", "id")} | own
        extra = {"id": item["id"]} if "id" in item else {}
        task = Task(prompt=msgs, answer=item.get("answer"), info=info, **extra)
    else:
        raise TypeError(f"cannot turn {type(item).__name__} into a Task")
    if system_prompt and not (task.prompt and task.prompt[0].role == "system"):
        task = dataclasses.replace(task, prompt=[Message("system", system_prompt), *task.prompt])
    return task


class Environment:
    """Base class: override the hooks; the framework owns :meth:`rollout`.

    Constructor arguments are conveniences so a small env needs no subclass boilerplate:
    ``dataset``/``eval_dataset`` accept Tasks, question strings or dicts (see
    :func:`as_task`); ``system_prompt`` is prepended to tasks that lack one.
    """

    name: str = "env"
    version: str = "0"
    reward_range: tuple[float, float] | None = None
    # the best reward an episode can score; the checker's reference solution must reach it
    # (None: task-dependent, only checked to run without errors)
    max_reward: float | None = 1.0

    def __init__(
        self,
        *,
        dataset: Iterable[Any] | None = None,
        eval_dataset: Iterable[Any] | None = None,
        rubric: Rubric | None = None,
        system_prompt: str | None = None,
        max_turns: int = 8,
        max_total_tokens: int | None = None,
        max_seq_len: int | None = None,
        timeout_s: float | None = None,
        on_length: Literal["end", "continue"] = "end",
        name: str | None = None,
        version: str | None = None,
    ) -> None:
        """``timeout_s``: the episode's wall limit (an episode past it is errored, kind
        ``timeout``).  ``on_length``: what a turn cut off at ``max_tokens`` does: ``"end"``
        the episode (stop reason ``length``), or ``"continue"`` it (``step`` sees the
        cut-off turn)."""
        from agentrl.rubrics import Rubric

        if on_length not in ("end", "continue"):
            raise ValueError(f"on_length must be 'end' or 'continue', not {on_length!r}")

        self.system_prompt = system_prompt
        self._train = None if dataset is None else [as_task(t, system_prompt) for t in dataset]
        self._eval = None if eval_dataset is None else [as_task(t, system_prompt) for t in eval_dataset]
        self.rubric = rubric if rubric is not None else Rubric()
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_seq_len = max_seq_len
        self.timeout_s = timeout_s
        self.on_length = on_length
        if name is not None:
            self.name = name
        if version is not None:
            self.version = version

    # ------------------------------------------------------------------ hooks (override)

    def dataset(self) -> Iterable[Task]:
        """Training tasks."""
        if self._train is None:
            raise NotImplementedError(f"{type(self).__name__} has no dataset: pass dataset= or override dataset()")
        return self._train

    def eval_dataset(self) -> Iterable[Task] | None:
        """Held-out tasks (None: evaluate on :meth:`dataset`)."""
        return self._eval

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """OpenAI tool schemas given to the chat template (None: no tools)."""
        return None

    async def setup(self, task: Task) -> State:
        """Start an episode. Override to acquire per-episode resources (store them in state)."""
        return State(task)

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        """React to the model's turn with env/tool messages (may set ``state.done``): a list of
        :class:`Message` (OpenAI-style dicts are converted); anything else errors the episode,
        kind ``env``, naming this method."""
        raise NotImplementedError

    def done(self, state: State) -> bool:
        """True when the episode is over (checked after each :meth:`step`)."""
        return state.done

    async def cleanup(self, state: State) -> None:
        """Release per-episode resources. Always runs; must be idempotent."""

    async def close(self) -> None:
        """Release what lasts across episodes (sandbox pools, sessions, the rubric's own):
        every command calls it once, inside the event loop its episodes ran in (idempotent).
        Left open, a pool's child processes outlive the loop and print tracebacks at exit."""
        close = getattr(self.rubric, "close", None)
        if close is not None:
            await close()

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """``n`` full solved conversations for warm-start SFT (optional)."""
        raise NotImplementedError(f"{type(self).__name__} provides no demonstrations")

    def reference_policy(self) -> Callable[[Task, list[Message]], Message] | None:
        """Optional: ``policy(task, conversation) -> assistant message`` that solves tasks (the
        checker plays it and requires ``max_reward``); None when the env has none."""
        return None

    def parse_assistant(self, text: str, state: State) -> Message:
        """Turn the model's raw text into the assistant message (ToolEnv parses tool calls)."""
        return Message("assistant", text)

    # ------------------------------------------------------------------ the loop (framework)

    async def rollout(
        self,
        client: PolicyClientLike,
        task: Task,
        sampling: SamplingParams | None = None,
        *,
        max_turns: int | None = None,
        timeout_s: float | None = None,
        token_exact: bool = True,
    ) -> Trajectory:
        """Run one episode (:func:`agentrl.episode.run_episode`); never raises for episode failures."""
        return await run_episode(
            self, client, task, sampling, max_turns=max_turns, timeout_s=timeout_s, token_exact=token_exact
        )
