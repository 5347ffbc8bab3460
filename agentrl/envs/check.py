"""``check_environment(env)``: the executable contract; ``agentrl env test`` runs the same list.

Each check is a named line that passes or fails with a reason (Gymnasium's ``check_env``
habit).  Episodes run against a real policy client when one is given, otherwise against
:class:`ScriptedClient` — a model-free policy with a character-level ChatML tokenizer that
replays the env's own demonstrations when it has them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.base import Environment, State
from agentrl.tool_format import format_assistant_text, get_parser
from agentrl.types import Completion, Message, SamplingParams, Trajectory, messages_to_dicts

IM_START, IM_END = 1, 2
_OFFSET = 3
_START_TEXT, _END_TEXT = "<|im_start|>", "<|im_end|>"


class ScriptedEndpointError(Exception):
    """What ScriptedClient raises when told to fail (an endpoint that is down)."""


def render_chatml(
    messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, strip_old: bool = False,
    tool_parser: str = "hermes",
) -> str:
    """A ChatML rendering (Qwen-like). ``strip_old`` drops ``<think>`` from assistant turns
    before the last user message, as Qwen3's template does — which is not prefix-stable.
    Assistant tool calls are written in ``tool_parser``'s format."""
    import json

    out = []
    if tools:
        out.append(f"{_START_TEXT}system\n# Tools\n" + "\n".join(json.dumps(t) for t in tools) + f"{_END_TEXT}\n")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m["role"] == "assistant":
            from agentrl.types import ToolCall

            calls = [ToolCall.from_dict(tc) for tc in m.get("tool_calls") or []]
            if strip_old and i < last_user and "</think>" in content:
                content = content.split("</think>", 1)[1].lstrip()
            content = get_parser(tool_parser).format(content, calls)
        out.append(f"{_START_TEXT}{m['role']}\n{content}{_END_TEXT}\n")
    if add_generation_prompt:
        out.append(f"{_START_TEXT}assistant\n")
    return "".join(out)


def encode(text: str) -> list[int]:
    ids: list[int] = []
    i = 0
    while i < len(text):
        if text.startswith(_START_TEXT, i):
            ids.append(IM_START)
            i += len(_START_TEXT)
        elif text.startswith(_END_TEXT, i):
            ids.append(IM_END)
            i += len(_END_TEXT)
        else:
            ids.append(ord(text[i]) + _OFFSET)
            i += 1
    return ids


def decode(ids: list[int]) -> str:
    return "".join(_START_TEXT if t == IM_START else _END_TEXT if t == IM_END else chr(t - _OFFSET) for t in ids)


class ScriptedClient:
    """A model-free policy speaking the PolicyClient interface (for checks and unit tests).

    ``policy(prompt_text) -> reply text`` decides each turn.  Every prompt it receives is
    recorded in ``prompts`` so tests can compare it with a fresh rendering.
    """

    def __init__(
        self,
        policy: Callable[[str], str] | None = None,
        *,
        fail: bool = False,
        strip_old_thinking: bool = False,
        version: int = 0,
        tool_parser: str = "hermes",
    ) -> None:
        self.policy = policy or (lambda prompt: "I don't know.")
        self.fail = fail
        self.strip_old = strip_old_thinking
        self.version = version
        self.tool_parser = get_parser(tool_parser).name  # the format its template writes calls in
        self.prompts: list[list[int]] = []

    async def tokenize(self, *, messages=None, tools=None, prompt=None, add_generation_prompt=True) -> list[int]:
        if prompt is not None:
            return encode(prompt)
        return encode(render_chatml(messages or [], tools, add_generation_prompt, self.strip_old, self.tool_parser))

    async def detokenize(self, ids: list[int]) -> str:
        return decode(ids)

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        if self.fail:
            raise ScriptedEndpointError("scripted endpoint is down")
        self.prompts.append(list(prompt_ids))
        out = []
        for _ in range(n):
            ids = encode(self.policy(decode(prompt_ids)))
            finish = "stop"
            if len(ids) >= sampling.max_tokens:
                ids, finish = ids[: sampling.max_tokens], "length"
            else:
                ids = [*ids, IM_END]
            text = decode([t for t in ids if t != IM_END])
            out.append(Completion(text, ids, [-0.5] * len(ids), [self.version] * len(ids), finish))
        return out


    async def chat(self, messages: list[dict], sampling: SamplingParams, tools=None, n: int = 1) -> list[Completion]:
        """Chat-endpoint behaviour: tool calls come back split from the content."""
        prompt_ids = await self.tokenize(messages=messages, tools=tools)
        out = []
        for c in await self.complete(prompt_ids, sampling, n):
            parsed = get_parser(self.tool_parser).parse(c.text)
            text = parsed.content if parsed.tool_calls and not parsed.errors else c.text
            calls = parsed.tool_calls if not parsed.errors else []
            out.append(Completion(text, c.token_ids, c.logprobs, c.versions, c.finish_reason, tool_calls=calls,
                                  prompt_token_ids=prompt_ids))
        return out


def replay_policy(demos: list[list[Message]]) -> Callable[[str], str]:
    """Reply with the k-th assistant turn of a demonstration at the k-th turn.

    A demonstration solves its own task, so it is replayed only on an episode that began
    with its prompt (the messages before its first assistant turn); any other episode gets
    "I don't know." (replayed elsewhere, a stateful tool would rightly refuse its calls).
    """
    scripts = []
    for d in demos:
        turns = [format_assistant_text(m.content, m.tool_calls) for m in d if m.role == "assistant"]
        if turns:
            scripts.append((render_chatml(messages_to_dicts(demo_prompt(d)), None, False), turns))

    def policy(prompt: str) -> str:
        head, _, _ = prompt.partition(f"{_START_TEXT}assistant")
        k = prompt.count(f"{_START_TEXT}assistant") - 1
        fits = [(len(p), turns) for p, turns in scripts if p and head.endswith(p)]
        if not fits:
            return "I don't know."
        turns = max(fits, key=lambda f: f[0])[1]
        return turns[min(k, len(turns) - 1)]

    return policy


def demo_prompt(demo: list[Message]) -> list[Message]:
    """The task prompt a demonstration starts from: its messages before the first assistant turn."""
    first = next((i for i, m in enumerate(demo) if m.role == "assistant"), len(demo))
    return demo[:first]


def _prompt_key(messages: list[Message]) -> tuple:
    return tuple((m.role, m.content) for m in messages)


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class CheckReport:
    results: list[CheckResult] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append(CheckResult(name, ok, detail))

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]


_STOP_REASONS = {"done", "max_turns", "max_tokens", "prompt_too_long", "timeout", "error", "length"}


def _task_key(t: Any) -> str:
    import json

    return json.dumps([[m.role, m.content] for m in t.prompt] + [repr(t.answer)], sort_keys=True)


async def check_environment(
    env: Environment,
    client: Any | None = None,
    *,
    num_episodes: int = 3,
    sampling: SamplingParams | None = None,
) -> CheckReport:
    """Run the contract checklist; returns a report (never raises for env faults).

    1. datasets; 2. rubric and tool schemas; 3. demonstrations (optional); 4. episodes with
    ``client`` (or a scripted policy replaying the demonstrations): the loop's contract,
    cleanup, token accounting, rewards, tools that raised; 5. a failing endpoint gives an
    errored episode; 6. the env's reference policy (optional) scores ``env.max_reward``.
    """
    report = CheckReport()
    sampling = sampling or SamplingParams(max_tokens=256, temperature=1.0)
    tasks = _check_datasets(env, report)
    _check_rubric_and_tools(env, report, tasks)
    demos, demo_tasks = await _check_demonstrations(env, report, tasks, sampling)
    if not tasks:
        return report
    cleanups: list[int] = []
    original_cleanup = env.cleanup

    async def counting_cleanup(state: State) -> None:
        cleanups.append(id(state))
        await original_cleanup(state)

    env.cleanup = counting_cleanup  # type: ignore[method-assign]
    try:
        if client is None and demo_tasks:  # tasks that have a demonstration first: the scripted policy can solve them
            first = {_task_key(t) for t in demo_tasks}
            tasks = demo_tasks + [t for t in tasks if _task_key(t) not in first]
        policy = client or ScriptedClient(replay_policy(demos) if demos else None)
        await _check_episodes(env, policy, tasks[:num_episodes], sampling, report, cleanups)
        before = len(cleanups)
        broken = await env.rollout(ScriptedClient(fail=True), tasks[0], sampling)
        report.add(
            "endpoint_failure",
            broken.error is not None and broken.error_kind == "endpoint" and len(cleanups) > before,
            f"error={broken.error!r} (kind {broken.error_kind}), cleanup ran={len(cleanups) > before}",
        )
        await _check_reference(env, tasks[:num_episodes], sampling, report)
    except Exception as e:
        report.add("episodes_run", False, f"rollout raised {type(e).__name__}: {e} (rollout must never raise)")
    finally:
        del env.cleanup
    return report


def _check_datasets(env: Environment, report: CheckReport) -> list[Any]:
    tasks: list[Any] = []
    try:
        for t in env.dataset():
            tasks.append(t)
            if len(tasks) >= 1000:
                break
        bad = [t for t in tasks if not getattr(t, "prompt", None)]
        report.add("dataset", bool(tasks) and not bad, f"{len(tasks)} tasks read" if tasks else "dataset() is empty")
    except Exception as e:
        report.add("dataset", False, f"dataset() raised {type(e).__name__}: {e}")
    try:
        held = env.eval_dataset()
        if held is None:
            report.add("eval_dataset", True, "none (evaluation uses dataset())")
        else:
            held_list = [t for _, t in zip(range(1000), held, strict=False)]
            overlap = {_task_key(t) for t in held_list} & {_task_key(t) for t in tasks}
            report.add(
                "eval_dataset",
                bool(held_list) and not overlap,
                f"{len(held_list)} tasks, {len(overlap)} also in dataset()" if held_list else "eval_dataset() is empty",
            )
    except Exception as e:
        report.add("eval_dataset", False, f"eval_dataset() raised {type(e).__name__}: {e}")
    return tasks


def _check_rubric_and_tools(env: Environment, report: CheckReport, tasks: list[Any]) -> None:
    from agentrl.rubrics import Rubric

    rubric = getattr(env, "rubric", None)
    weighted = isinstance(rubric, Rubric) and any(f.weight != 0 for f in rubric.funcs)
    report.add("rubric", weighted, f"{len(rubric.funcs)} functions" if weighted else "no Rubric with a weighted function")
    asking = [f.name for f in rubric.funcs if {"answer", "answers"} & set(f.params)] if isinstance(rubric, Rubric) else []
    if asking and tasks:  # every episode of a task without one would error inside the rubric
        missing = sum(getattr(t, "answer", None) is None for t in tasks)
        report.add("answers", not missing,
                   f"{missing} of {len(tasks)} tasks have no answer, but reward function(s) {', '.join(asking)} "
                   "ask for answer: give each dataset row an 'answer'" if missing
                   else f"every task has one ({', '.join(asking)} ask for it)")
    try:
        schemas = env.tool_schemas() or []
        bad = [s for s in schemas if s.get("type") != "function" or "name" not in s.get("function", {})
               or s["function"].get("parameters", {}).get("type") != "object"]
        report.add("tool_schemas", not bad, f"{len(schemas)} tools" if not bad else f"malformed: {bad[:1]}")
    except Exception as e:
        report.add("tool_schemas", False, f"tool_schemas() raised {type(e).__name__}: {e}")


async def _check_demonstrations(
    env: Environment, report: CheckReport, tasks: list[Any], sampling: SamplingParams
) -> tuple[list[list[Message]], list[Any]]:
    """Each demonstration replayed on its own task (found anywhere in the dataset) must run
    without an env fault.  Returns the demonstrations and their tasks (one each, in order)."""
    from agentrl.rubrics import score_episodes

    try:
        demos = env.demonstrations(4, seed=0)
    except NotImplementedError:
        return [], []
    except Exception as e:
        report.add("demonstrations", False, f"demonstrations() raised {type(e).__name__}: {e}")
        return [], []
    shaped = len(demos) == 4 and all(
        d and all(isinstance(m, Message) for m in d) and any(m.role == "assistant" for m in d) for d in demos
    )
    if not shaped:
        report.add("demonstrations", False, "expected 4 lists of Messages with assistant turns")
        return demos, []
    found = _demo_tasks(env, demos, tasks)
    pairs = [(d, found[_prompt_key(demo_prompt(d))]) for d in demos if _prompt_key(demo_prompt(d)) in found]
    # a demonstration is replayed on its own task only (another task's tools may rightly refuse its calls)
    trajs = []
    try:
        for demo, task in pairs:
            longest = max(len(format_assistant_text(m.content, m.tool_calls)) for m in demo if m.role == "assistant")
            # the scripted tokenizer spends a token per character: room for the longest turn
            replay = dataclasses.replace(sampling, max_tokens=max(sampling.max_tokens, longest + 1))
            trajs.append(await env.rollout(ScriptedClient(replay_policy([demo])), task, replay))
        await score_episodes(env.rubric, trajs)
    except Exception as e:
        report.add("demonstrations", False, f"replaying one raised {type(e).__name__}: {e} (rollout must never raise)")
        return demos, []
    faults = [t for t in trajs if t.error and t.error_kind in _ENV_KINDS]
    detail = f"4 conversations, {len(trajs)} replayed on their dataset tasks"
    if trajs:
        detail += f" (rewards {[None if t.error else round(t.reward, 3) for t in trajs]})"
    if len(pairs) < len(demos):
        detail += f"; {len(demos) - len(pairs)} start with no dataset task's prompt (never replayed)"
    if faults:
        detail += f"; a replay errored ({faults[0].error_kind}): {faults[0].error}"
    report.add("demonstrations", not faults, detail)
    return demos, list({_task_key(t): t for _, t in pairs}.values())


_MAX_SCAN = 1_000_000  # dataset tasks read looking for the demonstrations' prompts (a stream may not end)


def _demo_tasks(env: Environment, demos: list[list[Message]], tasks: list[Any]) -> dict[tuple, Any]:
    """The dataset task each demonstration's prompt belongs to, by prompt: the tasks already
    read first, then the whole dataset, read until every prompt is found (demonstrations are
    drawn from all of it: calc's 20,000 tasks, not the 1,000 the dataset check reads)."""
    wanted = {_prompt_key(demo_prompt(d)) for d in demos}
    found = {k: t for t in reversed(tasks) if (k := _prompt_key(t.prompt)) in wanted}
    if len(found) == len(wanted):
        return found
    try:
        for n, t in enumerate(env.dataset()):
            if n >= _MAX_SCAN:
                break
            k = _prompt_key(t.prompt)
            if k in wanted and k not in found:
                found[k] = t
                if len(found) == len(wanted):
                    break
    except Exception:  # dataset() raising is the dataset check's finding
        pass
    return found


class _PolicyClient:
    """A chat client whose replies are a reference policy's assistant messages."""

    def __init__(self, policy: Callable[[Any, list[Message]], Message], task: Any) -> None:
        self.policy, self.task = policy, task

    async def chat(self, messages: list[dict], sampling: SamplingParams, tools=None, n: int = 1) -> list[Completion]:
        reply = self.policy(self.task, [Message.from_dict(m) for m in messages])
        return [Completion(reply.content, finish_reason="stop", tool_calls=list(reply.tool_calls))]


# the env's own fault when an episode errors with one of these (not the endpoint's)
_ENV_KINDS = {"env", "tool", "sandbox", "rubric", "timeout", "program"}


async def _check_episodes(
    env: Environment, policy: Any, tasks: list[Any], sampling: SamplingParams, report: CheckReport,
    cleanups: list[int],
) -> None:
    """The loop's contract on real episodes: errors, stop reasons, tokens, rewards, tools, cleanup."""
    from agentrl.rubrics import score_episodes

    trajs = [await env.rollout(policy, t, sampling) for t in tasks]
    await score_episodes(env.rubric, trajs)
    report.trajectories = trajs
    errored = [t for t in trajs if t.error]
    env_fault = [t for t in errored if t.error_kind in _ENV_KINDS]
    ok = not env_fault and len(errored) < len(trajs)
    detail = f"{len(trajs)} episodes, {len(errored)} errored"
    if errored:
        first = (env_fault or errored)[0]
        detail += f"; first ({first.error_kind}): {first.error}"
    report.add("episodes_run", ok, detail)
    bad_stop = [t.stop_reason for t in trajs if t.stop_reason not in _STOP_REASONS]
    report.add("stop_reasons", not bad_stop, ", ".join(sorted({str(t.stop_reason) for t in trajs})))
    token_problems = []
    for t in trajs:
        try:
            for s in t.sequences:
                s.validate()
            sampled = sum(len(turn.completion_ids) for turn in t.turns)
            if sampled != t.num_sampled_tokens:
                token_problems.append(f"{sampled} sampled tokens in turns but {t.num_sampled_tokens} in sequences")
        except ValueError as e:
            token_problems.append(str(e))
    report.add("token_sequences", not token_problems, token_problems[0] if token_problems else "consistent")
    lo, hi = env.reward_range or (-math.inf, math.inf)
    valid = [t for t in trajs if not t.error]
    bad_rewards = [t.reward for t in valid if not (math.isfinite(t.reward) and lo <= t.reward <= hi)]
    report.add("rewards", bool(valid) and not bad_rewards,
               f"rewards {[round(t.reward, 3) for t in valid]}" if valid else "no episode was scored (all errored)")
    _check_tools_raised(trajs, report)
    report.add("cleanup", len(cleanups) >= len(trajs), f"cleanup ran {len(cleanups)}× for {len(trajs)} episodes")


def _check_tools_raised(trajs: list[Trajectory], report: CheckReport) -> None:
    """A tool that raised on every call is broken (the model cannot tell it from its own mistake)."""
    calls: dict[str, float] = {}
    raised: dict[str, float] = {}
    for t in trajs:
        for k, v in t.metrics.items():
            if k.startswith("tool_calls/"):
                calls[k.split("/", 1)[1]] = calls.get(k.split("/", 1)[1], 0) + v
            elif k.startswith("tool_raised/"):
                raised[k.split("/", 1)[1]] = raised.get(k.split("/", 1)[1], 0) + v
    if not calls:
        return
    always = sorted(name for name, n in raised.items() if n >= calls.get(name, 0) > 0)
    detail = ", ".join(f"{name} raised {int(raised.get(name, 0))}/{int(n)}" for name, n in sorted(calls.items()))
    # every call of such a tool raised, so each of its tool messages is the exception's text
    said = {m.name: m.content.removeprefix("Error: ") for t in reversed(trajs) for m in t.completion
            if m.role == "tool" and m.name in always}
    named = ", ".join(f"{name} ({said[name]})" if name in said else name for name in always)
    report.add("tools", not always, (f"always raised: {named}; " if always else "") + detail)


async def _check_reference(env: Environment, tasks: list[Any], sampling: SamplingParams, report: CheckReport) -> None:
    """The env's reference policy (``env.reference_policy()``), if it has one, must score ``env.max_reward``."""
    from agentrl.rubrics import score_episodes

    policy = env.reference_policy()
    if policy is None:
        return
    trajs = [await env.rollout(_PolicyClient(policy, task), task, sampling, token_exact=False) for task in tasks]
    await score_episodes(env.rubric, trajs)
    errored = [t for t in trajs if t.error]
    short = [t.reward for t in trajs if not t.error and env.max_reward is not None and t.reward < env.max_reward]
    detail = f"rewards {[round(t.reward, 3) for t in trajs]}"
    if env.max_reward is not None:
        detail += f" (max {env.max_reward:g})"
    if errored:
        detail = f"errored ({errored[0].error_kind}): {errored[0].error}"
    report.add("reference_solution", not errored and not short, detail)
