"""Rubrics: weighted reward functions that ask for their inputs by parameter name.

    def correct(completion, answer) -> float: ...
    async def short(trajectory) -> float: ...
    def diversity(completions) -> list[float]: ...        # group-level (plural names)

    rubric = Rubric([correct, short, diversity], weights=[1.0, 0.0, 0.1])

Per-episode arguments a function may name:

    completion   text of the last assistant message      messages   whole conversation
    prompt       the task's prompt messages               answer     task.answer
    task         the Task                                 info       task.info
    state        the episode State (after rollout)        trajectory the Trajectory
    turns        number of model turns                    metrics    trajectory.metrics so far
    result       an agent program's final answer (HarnessEnv; None for other envs)
    + any name given in ``Rubric(..., context={...})`` (shared objects, e.g. a judge)

Group-level functions name plurals — ``completions``, ``answers``, ``prompts``, ``tasks``,
``infos``, ``states``, ``trajectories``, ``messages_list``, ``results`` — and return one value per
episode.  Weight 0 makes a function a logged metric only.  Functions run in the order
given (an earlier one may cache something in ``state`` for a later one); one function is
evaluated concurrently across the episodes of a group.  Sync functions run inline, on the
event loop every rollout shares: keep them quick or make them async (``await
asyncio.to_thread(slow, ...)`` for blocking work; a worker thread cannot use signal-based
timeouts, math-verify's among them).  A sync call that holds the loop over
:data:`SLOW_SYNC_S` warns once per function, naming it.

Every function's value lands in ``trajectory.metrics[fn_name]``; ``reward`` is the
weighted sum.  A function that raises, returns a non-number, NaN or inf marks that episode
errored with the reason kept; episodes already errored by the rollout are not scored.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.types import Trajectory

_PLURALS = {
    "completions": "completion",
    "answers": "answer",
    "prompts": "prompt",
    "tasks": "task",
    "infos": "info",
    "states": "state",
    "trajectories": "trajectory",
    "messages_list": "messages",
    "results": "result",
}


def completion_text(completion: Any) -> str:
    """The text of the model's final reply, from whatever a reward function received as
    ``completion``: a string, a list of messages (:class:`Message` or OpenAI dicts), or ``None``."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Iterable):
        for m in reversed(list(completion)):
            role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
            if role == "assistant":
                content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
                return str(content or "")
        return ""
    return str(getattr(completion, "content", completion) or "")


def last_assistant_text(traj: Trajectory) -> str:
    for m in reversed(traj.messages):
        if m.role == "assistant":
            return m.content
    return ""


def episode_args(traj: Trajectory) -> dict[str, Any]:
    """Everything a per-episode reward function may ask for (see module docstring)."""
    return {
        "completion": last_assistant_text(traj),
        "messages": traj.messages,
        "prompt": traj.task.prompt,
        "answer": traj.task.answer,
        "task": traj.task,
        "info": traj.task.info,
        "state": getattr(traj, "state", None) or {},
        "trajectory": traj,
        "turns": len(traj.turns),
        "metrics": traj.metrics,
        "result": (getattr(traj, "state", None) or {}).get("result"),
    }


def as_reward(value: Any) -> float | None:
    """A usable reward (bools count as 0/1), or None for non-numbers, NaN and inf."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    try:  # numpy / torch scalars
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) and not isinstance(value, str) else None


@dataclass
class RewardFn:
    """One reward function with its weight and the arguments it asks for."""

    fn: Callable[..., Any]
    weight: float
    name: str
    params: tuple[str, ...]
    takes_all: bool
    group_level: bool
    warned_slow: bool = False

    @classmethod
    def wrap(cls, fn: Callable[..., Any], weight: float) -> RewardFn:
        sig = inspect.signature(fn)
        params = tuple(
            p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
        takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        group = any(p in _PLURALS for p in params)
        name = getattr(fn, "__name__", type(fn).__name__)
        return cls(fn, float(weight), name, params, takes_all, group)


SLOW_SYNC_S = 0.5  # a sync reward call this long has stalled every rollout (sampling, tools, other rewards)


async def _call(f: RewardFn, kwargs: dict[str, Any]) -> Any:
    t0 = time.perf_counter()
    result = f.fn(**kwargs)
    held = time.perf_counter() - t0
    if held > SLOW_SYNC_S and not f.warned_slow:
        f.warned_slow = True
        warnings.warn(f"reward function {f.name!r} held the event loop for {held:.1f}s: every rollout waits while a "
                      "sync reward function runs; make it async (await asyncio.to_thread(...) for blocking work)",
                      RuntimeWarning, stacklevel=2)
    if inspect.isawaitable(result):
        result = await result
    return result


class Rubric:
    """Weighted reward functions; see the module docstring."""

    def __init__(
        self,
        funcs: Sequence[Callable[..., Any]] = (),
        weights: Sequence[float] | None = None,
        *,
        context: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights")
        self.funcs: list[RewardFn] = []
        self.context: dict[str, Any] = dict(context or {})
        self.timeout_s = timeout_s
        for i, fn in enumerate(funcs):
            self.add(fn, 1.0 if weights is None else weights[i])

    def add(self, fn: Callable[..., Any], weight: float = 1.0) -> Rubric:
        """Add a reward function (weight 0: a metric only)."""
        self.funcs.append(RewardFn.wrap(fn, weight))
        return self

    def add_metric(self, fn: Callable[..., Any]) -> Rubric:
        return self.add(fn, 0.0)

    # ------------------------------------------------------------------ scoring

    async def score(self, trajectory: Trajectory) -> Trajectory:
        await self.score_group([trajectory])
        return trajectory

    async def score_group(self, trajectories: Sequence[Trajectory]) -> None:
        """Set ``reward`` and ``metrics`` on every trajectory (errored ones get reward 0)."""
        results = await self.evaluate(trajectories)
        for traj, (values, error) in zip(trajectories, results, strict=True):
            if traj.error is not None:
                traj.reward = 0.0
                continue
            traj.metrics.update(values)
            if error is not None:
                traj.error, traj.error_kind, traj.reward = error, "rubric", 0.0
                traj.stop_reason = traj.stop_reason or "error"
            else:
                traj.reward = self.reward_from(values)

    def _weighted(self) -> list[RewardFn]:
        return [f for f in self.funcs if f.weight != 0.0]

    def reward_from(self, values: dict[str, float]) -> float:
        return sum(values.get(f.name, 0.0) * f.weight for f in self._weighted())

    async def evaluate(self, trajectories: Sequence[Trajectory]) -> list[tuple[dict[str, float], str | None]]:
        """Per trajectory: ({fn name: value}, error or None). Does not modify trajectories."""
        live = [i for i, t in enumerate(trajectories) if t.error is None]
        values: list[dict[str, float]] = [{} for _ in trajectories]
        errors: list[str | None] = [None] * len(trajectories)
        args = {i: episode_args(trajectories[i]) for i in live}
        for f in self.funcs:
            todo = [i for i in live if errors[i] is None]
            if not todo:
                break
            if f.group_level:
                try:
                    out = await self._run(f, lambda f=f, todo=todo: self._group_kwargs(f, [args[i] for i in todo]))
                    out = list(out)
                    if len(out) != len(todo):
                        raise ValueError(f"returned {len(out)} values for {len(todo)} episodes")
                except Exception as e:
                    for i in todo:
                        errors[i] = _raised(f, e, args[i])
                    continue
                for i, v in zip(todo, out, strict=True):
                    self._record(f, i, v, values, errors)
            else:
                outs = await asyncio.gather(
                    *(self._run(f, lambda f=f, ep=args[i]: self._episode_kwargs(f, ep)) for i in todo),
                    return_exceptions=True,
                )
                for i, v in zip(todo, outs, strict=True):
                    if isinstance(v, BaseException):
                        if isinstance(v, asyncio.CancelledError):
                            raise v
                        errors[i] = _raised(f, v, args[i])
                    else:
                        self._record(f, i, v, values, errors)
        return list(zip(values, errors, strict=True))

    @staticmethod
    def _record(f: RewardFn, i: int, v: Any, values: list[dict[str, float]], errors: list[str | None]) -> None:
        r = as_reward(v)
        if r is None:
            errors[i] = f"reward function {f.name!r} returned {v!r}, not a finite number"[:500]
        else:
            values[i][f.name] = r

    async def _run(self, f: RewardFn, make_kwargs: Callable[[], dict[str, Any]]) -> Any:
        kwargs = make_kwargs()
        if self.timeout_s is None:
            return await _call(f, kwargs)
        return await asyncio.wait_for(_call(f, kwargs), self.timeout_s)

    def _episode_kwargs(self, f: RewardFn, ep: dict[str, Any]) -> dict[str, Any]:
        pool = {**self.context, **ep}
        if f.takes_all:
            return pool
        missing = [p for p in f.params if p not in pool]
        if missing:
            raise TypeError(f"reward function {f.name!r} asks for unknown argument(s) {missing}")
        return {p: pool[p] for p in f.params}

    def _group_kwargs(self, f: RewardFn, eps: list[dict[str, Any]]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for p in f.params:
            if p in _PLURALS:
                kwargs[p] = [ep[_PLURALS[p]] for ep in eps]
            elif p in self.context:
                kwargs[p] = self.context[p]
            else:
                raise TypeError(f"group reward function {f.name!r} asks for {p!r}; use plural names")
        return kwargs


def _raised(f: RewardFn, e: BaseException, ep: dict[str, Any]) -> str:
    """The error of a reward function that raised; names a missing answer, the usual cause."""
    why = ""
    if ep["answer"] is None and ({"answer", "answers"} & set(f.params) or f.takes_all):
        why = " (its task has no answer: give each dataset row an 'answer')"
    return f"reward function {f.name!r} raised {type(e).__name__}: {e}"[: 500 - len(why)] + why


async def score_episodes(rubric: Any, trajectories: Sequence[Trajectory]) -> None:
    """Score finished episodes with ``rubric``; never raises.

    The one scoring entry point of the rollout, held-out evaluation, ``agentrl eval``, the
    checker and the gymnasium bridge.  A rubric that raises as a whole, or leaves a
    non-finite reward, marks the (not already errored) episodes errored, kind ``rubric``.
    """
    live = [t for t in trajectories if t.error is None]
    if not live:
        return
    try:
        await rubric.score_group(live)
    except Exception as e:
        for t in live:
            t.error, t.error_kind, t.reward = f"rubric raised {type(e).__name__}: {e}"[:500], "rubric", 0.0
        return
    for t in live:
        if t.error is None and not (isinstance(t.reward, int | float) and math.isfinite(t.reward)):
            t.error, t.error_kind, t.reward = f"rubric left a non-finite reward {t.reward!r}", "rubric", 0.0
        elif t.error is not None and t.error_kind is None:
            t.error_kind = "rubric"


class RubricGroup(Rubric):
    """Several rubrics scored together: rewards add up, metrics merge, any error wins.

    Function names should be unique across the member rubrics (metrics are keyed by name).
    """

    def __init__(self, rubrics: Sequence[Rubric]) -> None:
        super().__init__()
        self.rubrics = list(rubrics)
        self.funcs = [f for r in self.rubrics for f in r.funcs]

    def reward_from(self, values: dict[str, float]) -> float:
        return sum(r.reward_from(values) for r in self.rubrics)

    async def evaluate(self, trajectories: Sequence[Trajectory]) -> list[tuple[dict[str, float], str | None]]:
        per_rubric = await asyncio.gather(*(r.evaluate(trajectories) for r in self.rubrics))
        merged: list[tuple[dict[str, float], str | None]] = []
        for i in range(len(trajectories)):
            values: dict[str, float] = {}
            error = None
            for res in per_rubric:
                values.update(res[i][0])
                error = error or res[i][1]
            merged.append((values, error))
        return merged


_TAGS: dict[str, tuple[re.Pattern[str], re.Pattern[str]]] = {}


def tagged(text: str, tag: str, *, first_only: bool = False) -> list[str]:
    """Every ``<tag>...</tag>`` block's content (case-insensitive, across lines), as
    ``re.findall(r"<tag>(.*?)</tag>", text, re.S | re.I)`` gives it, in one pass: that regex
    rescans to the end from every unclosed tag, quadratic in a reply full of them."""
    if tag not in _TAGS:
        t = re.escape(tag)
        _TAGS[tag] = (re.compile(rf"<{t}>", re.IGNORECASE), re.compile(rf"</{t}>", re.IGNORECASE))
    opening, closing = _TAGS[tag]
    found, pos = [], 0
    while (o := opening.search(text, pos)) is not None:
        c = closing.search(text, o.end())
        if c is None:  # no closing tag after this opening: none after any later one either
            break
        found.append(text[o.end() : c.start()])
        if first_only:
            break
        pos = c.end()
    return found
