"""The Environment contract and the rollout loop the framework owns.

An environment author implements a few hooks (DESIGN.md):

    dataset() -> Iterable[Task]            eval_dataset() -> Iterable[Task] | None
    async setup(task) -> State             async step(state, assistant_msg) -> list[Message]
    done(state) -> bool                    async cleanup(state)   (idempotent, always runs)
    rubric: Rubric                         tool_schemas() -> list[dict] | None
    demonstrations(n, seed) -> list[list[Message]]   (optional, for warm-start SFT)

:meth:`Environment.rollout` runs one episode against a policy client and returns a
:class:`~agentrl.types.Trajectory`.  It never raises for episode-level failures: the
failure is recorded in ``trajectory.error`` with ``stop_reason = "error"``.

Token exactness: the first prompt is tokenized once with the chat template.  Each model
turn appends exactly the token ids the engine sampled (with μ logprobs and versions).  The
env's reply is appended as forced tokens taken as the *suffix* of the template rendered with
and without the new messages — sampled text is never re-tokenized.  If the template is not
prefix-stable (rendering more messages changes earlier tokens) or the sampled turn did not
end with the template's end-of-turn token, a new :class:`TokenSequence` starts from a fresh
rendering and ``metrics["template_breaks"]`` counts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.types import (
    Message,
    SamplingParams,
    Task,
    TokenSequence,
    ToolCall,
    Trajectory,
    Turn,
    messages_to_dicts,
)

if TYPE_CHECKING:
    from agentrl.rubrics import Rubric

# Template tokens allowed between the sampled end-of-turn token and the next message
# (Qwen renders "<|im_end|>" then "\n"); more than this means we found the wrong token.
_MAX_GLUE_TOKENS = 8


class PolicyClientLike(Protocol):
    """The part of :class:`agentrl.inference.client.PolicyClient` the rollout loop uses."""

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Any]: ...

    async def chat(
        self, messages: list[dict], sampling: SamplingParams, tools: list[dict] | None = None, n: int = 1
    ) -> list[Any]: ...

    async def tokenize(
        self,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        prompt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...


class State(dict):
    """Per-episode scratch space: a dict the env may fill with anything.

    The framework's own entries are also attributes: ``task``, ``messages`` (the whole
    conversation so far), ``turn`` (model turns taken), ``metrics`` (floats merged into the
    trajectory's metrics), ``done`` (set True from ``step`` to end the episode).
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
    def answer(self) -> Any:
        return self["task"].answer

    @property
    def info(self) -> dict[str, Any]:
        return self["task"].info

    def count(self, metric: str, by: float = 1.0) -> None:
        """Add ``by`` to a per-episode counter metric."""
        self["metrics"][metric] = self["metrics"].get(metric, 0.0) + by


def as_task(item: Task | dict[str, Any] | str, system_prompt: str | None = None) -> Task:
    """Accept a Task, a plain question string, or a dict with ``prompt``/``question`` + ``answer``."""
    if isinstance(item, Task):
        task = item
    elif isinstance(item, str):
        task = Task(prompt=[Message("user", item)])
    elif isinstance(item, dict):
        prompt = item.get("prompt", item.get("question"))
        if isinstance(prompt, str):
            msgs = [Message("user", prompt)]
        elif isinstance(prompt, list):
            msgs = [Message.from_dict(m) for m in prompt]
        else:
            raise ValueError(f"dataset row needs a 'prompt' or 'question' (str or messages): {item!r}")
        extra = {"info": item["info"]} if "info" in item else {}
        if "id" in item:
            extra["id"] = item["id"]
        task = Task(prompt=msgs, answer=item.get("answer"), **extra)
    else:
        raise TypeError(f"cannot turn {type(item).__name__} into a Task")
    if system_prompt and not (task.prompt and task.prompt[0].role == "system"):
        task = dataclasses.replace(task, prompt=[Message("system", system_prompt), *task.prompt])
    return task


def _is_context_length_error(e: BaseException) -> bool:
    # Matched by name so any client (ours, a fake, a vLLM adapter) can signal it.
    return any(cls.__name__ == "ContextLengthExceeded" for cls in type(e).__mro__)


def _error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:500] if msg else type(e).__name__


class Environment:
    """Base class: override the hooks; the framework owns :meth:`rollout`.

    Constructor arguments are conveniences so a small env needs no subclass boilerplate:
    ``dataset``/``eval_dataset`` accept Tasks, question strings or dicts (see
    :func:`as_task`); ``system_prompt`` is prepended to tasks that lack one.
    """

    name: str = "env"
    version: str = "0"
    reward_range: tuple[float, float] | None = None

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
        name: str | None = None,
        version: str | None = None,
    ) -> None:
        from agentrl.rubrics import Rubric

        self.system_prompt = system_prompt
        self._train = None if dataset is None else [as_task(t, system_prompt) for t in dataset]
        self._eval = None if eval_dataset is None else [as_task(t, system_prompt) for t in eval_dataset]
        self.rubric = rubric if rubric is not None else Rubric()
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_seq_len = max_seq_len
        self.timeout_s = timeout_s
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
        """React to the model's turn with env/tool messages (may set ``state.done``)."""
        raise NotImplementedError

    def done(self, state: State) -> bool:
        """True when the episode is over (checked after each :meth:`step`)."""
        return state.done

    async def cleanup(self, state: State) -> None:
        """Release per-episode resources. Always runs; must be idempotent."""

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """``n`` full solved conversations for warm-start SFT (optional)."""
        raise NotImplementedError(f"{type(self).__name__} provides no demonstrations")

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
        """Run one episode. Never raises for episode-level failures (see module docstring).

        ``token_exact=False`` talks to a plain chat endpoint instead (``client.chat``): for
        evaluating models behind APIs without ``/tokenize``; no token sequences are recorded.
        """
        sampling = sampling or SamplingParams()
        traj = Trajectory(task=task, messages=list(task.prompt), env_name=self.name, env_version=str(self.version))
        timing = {"setup_s": 0.0, "generation_s": 0.0, "env_s": 0.0, "tokenize_s": 0.0}
        traj.timing = timing
        start = time.perf_counter()
        state: State | None = None
        limit = timeout_s if timeout_s is not None else self.timeout_s
        try:
            async with asyncio.timeout(limit):
                t0 = time.perf_counter()
                state = await self.setup(task)
                timing["setup_s"] = time.perf_counter() - t0
                traj.messages = state.messages
                traj.stop_reason = await self._loop(
                    client, state, traj, sampling, max_turns or self.max_turns, token_exact
                )
        except TimeoutError:
            traj.stop_reason = "timeout"
        except asyncio.CancelledError:
            traj.stop_reason, traj.error = "error", "cancelled"
            raise
        except Exception as e:  # a bad episode is data, not a crash
            traj.stop_reason, traj.error = "error", _error_text(e)
        finally:
            if state is not None:
                try:
                    await asyncio.shield(self.cleanup(state))
                except Exception as e:
                    if traj.error is None:
                        traj.stop_reason, traj.error = "error", f"cleanup failed: {_error_text(e)}"
                traj.metrics.update(state.metrics)
                traj.state = state  # transient (not serialized): rubric functions may ask for it
            timing["total_s"] = time.perf_counter() - start
            traj.metrics["turns"] = float(len(traj.turns))
            traj.metrics.setdefault("template_breaks", 0.0)
        return traj

    async def _loop(
        self,
        client: PolicyClientLike,
        state: State,
        traj: Trajectory,
        sampling: SamplingParams,
        max_turns: int,
        token_exact: bool,
    ) -> str:
        timing = traj.timing
        tools = self.tool_schemas() or None
        seq = TokenSequence()
        if token_exact:
            t0 = time.perf_counter()
            seq.extend_forced(await client.tokenize(messages=messages_to_dicts(state.messages), tools=tools))
            timing["tokenize_s"] += time.perf_counter() - t0
            traj.sequences.append(seq)
        sampled_total = 0
        while True:
            if state.turn >= max_turns:
                return "max_turns"
            # the turn's token budget and, if it gets cut off, which limit did it
            budget, cut_reason = sampling.max_tokens, "length"
            if self.max_total_tokens is not None and self.max_total_tokens - sampled_total <= budget:
                budget, cut_reason = self.max_total_tokens - sampled_total, "max_tokens"
                if budget <= 0:
                    return "max_tokens"
            if self.max_seq_len is not None and self.max_seq_len - len(seq) <= budget:
                budget, cut_reason = self.max_seq_len - len(seq), "prompt_too_long"
                if budget <= 0:
                    return "prompt_too_long"
            turn_sampling = sampling if budget == sampling.max_tokens else dataclasses.replace(sampling, max_tokens=budget)

            # 1) the model's turn: exact sampled ids, μ logprobs, versions
            t0 = time.perf_counter()
            try:
                if token_exact:
                    completion = (await client.complete(seq.token_ids, turn_sampling))[0]
                else:
                    completion = (await client.chat(messages_to_dicts(state.messages), turn_sampling, tools=tools))[0]
            except Exception as e:
                if _is_context_length_error(e):
                    return "prompt_too_long"
                raise
            latency = time.perf_counter() - t0
            timing["generation_s"] += latency
            ids = list(completion.token_ids or [])
            versions = list(completion.versions or [])
            if token_exact:
                seq.extend_sampled(ids, list(completion.logprobs), versions)
                prompt_len = len(seq) - len(ids)
            else:
                prompt_len = len(getattr(completion, "prompt_token_ids", None) or [])
            sampled_total += len(ids)
            traj.turns.append(Turn(prompt_len, ids, completion.text, completion.finish_reason, versions, latency))
            state.turn += 1
            assistant = self._assistant_message(completion, state, token_exact)
            state.messages.append(assistant)
            if completion.finish_reason == "length":
                return cut_reason  # a cut-off turn has no end-of-turn token to continue from

            # 2) the env's reply
            t0 = time.perf_counter()
            reply = list(await self.step(state, assistant))
            timing["env_s"] += time.perf_counter() - t0
            before = list(state.messages)
            state.messages.extend(reply)
            if self.done(state):
                return "done"
            if state.turn >= max_turns:
                return "max_turns"

            # 3) env tokens: suffix of the template, appended without re-tokenizing sampled text
            if not token_exact:
                continue
            t0 = time.perf_counter()
            forced = await self._bridge(client, before, reply, tools, ids)
            if forced is None:
                traj.metrics["template_breaks"] = traj.metrics.get("template_breaks", 0.0) + 1
                seq = TokenSequence()
                seq.extend_forced(await client.tokenize(messages=messages_to_dicts(state.messages), tools=tools))
                traj.sequences.append(seq)
            else:
                seq.extend_forced(forced)
            timing["tokenize_s"] += time.perf_counter() - t0

    def _assistant_message(self, completion: Any, state: State, token_exact: bool) -> Message:
        calls = getattr(completion, "tool_calls", None)
        if calls and not token_exact:  # a chat endpoint already split out the tool calls
            parsed = [c if isinstance(c, ToolCall) else ToolCall.from_dict(c) for c in calls]
            return Message("assistant", completion.text or "", tool_calls=parsed)
        return self.parse_assistant(completion.text or "", state)

    async def _bridge(
        self,
        client: PolicyClientLike,
        before: list[Message],
        reply: list[Message],
        tools: list[dict] | None,
        sampled: list[int],
    ) -> list[int] | None:
        """Forced tokens that continue the sampled turn with ``reply`` and the next generation prompt.

        None when that cannot be done token-exactly (a template break).
        """
        if not sampled:
            return None
        closed = await client.tokenize(messages=messages_to_dicts(before), tools=tools, add_generation_prompt=False)
        extended = await client.tokenize(
            messages=messages_to_dicts(before + reply), tools=tools, add_generation_prompt=True
        )
        if extended[: len(closed)] != closed:
            return None  # template rewrites earlier turns once more messages follow
        end_of_turn = sampled[-1]
        for i in range(len(closed) - 1, max(len(closed) - 1 - _MAX_GLUE_TOKENS, -1), -1):
            if closed[i] == end_of_turn:
                return closed[i + 1 :] + extended[len(closed) :]
        return None  # the sampled turn did not end the way the template closes a turn

