"""JudgeRubric: an OpenAI-compatible model grades the episodes.

    rubric = JudgeRubric(base_url="http://localhost:8000/v1", model="judge")

By default one reward function, ``judge_correct``, asks the judge whether the final reply
matches the task's answer and reads the verdict with :func:`yes_means_correct`: the judge's
whole reply must be the word "yes" (1.0) or "no" (0.0), any case, optionally wrapped in
whitespace, markdown (``**Yes**``) or quotes, with a full stop or "!" (and an opening
``<think>...</think>`` block is skipped).  Anything else ("", "Correct.", "Yes, it is
incorrect", "yesno", a reply cut at ``max_tokens``) raises ``ValueError``, so the episode is
marked errored (kind ``rubric``), counted, and rerun by ``agentrl eval --resume``; scoring
it 0 would teach the policy that a right answer was wrong.  ``JudgeRubric(parse=...)``
replaces the parser: it gets the reply as a :class:`JudgeReply`, a ``str`` whose
``finish_reason`` says why the judge stopped ("length": cut at ``max_tokens``).

Any reward function of the rubric may also ask for ``judge`` and call it directly:

    async def style(judge, prompt, completion, answer):
        return float("good" in await judge(prompt, completion, answer, template=STYLE_PROMPT))

The judge caps concurrent requests, retries transient failures with exponential backoff,
and caches replies by (model, rendered prompt), so a group of identical completions costs
one request: it runs as its own task, which each asker awaits shielded, so one asker's
cancellation or timeout never reaches the others (the request is cancelled when no asker
is left).  A judge that still fails raises, and the rubric marks that episode errored.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.rubrics.rubric import Rubric
from agentrl.types import Message

DEFAULT_PROMPT = (
    "Question:\n{question}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
    "Is the response correct given the reference answer? Reply with yes or no."
)


def _question(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    for m in reversed(list(prompt or [])):
        m = Message.from_dict(m)
        if m.role == "user":
            return m.content
    return ""


class JudgeReply(str):
    """The judge's reply text, with the API's ``finish_reason`` ("stop", "length", ...)."""

    finish_reason: str | None

    def __new__(cls, text: str, finish_reason: str | None = None) -> JudgeReply:
        reply = super().__new__(cls, text)
        reply.finish_reason = finish_reason
        return reply


@dataclass
class _Pending:
    """One judge request in flight and how many askers still wait for it."""

    task: asyncio.Task[JudgeReply]
    waiters: int = 0


class Judge:
    """Callable judge: ``await judge(prompt, completion, answer) -> reply text``."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        template: str = DEFAULT_PROMPT,
        max_concurrency: int = 8,
        max_retries: int = 3,
        timeout_s: float = 60.0,
        max_tokens: int = 32,
        temperature: float = 0.0,
        cache: bool = True,
        backoff_s: float = 0.5,
    ) -> None:
        import openai

        self.model = model
        self.template = template
        self.max_retries = max_retries
        self.max_tokens, self.temperature = max_tokens, temperature
        self.backoff_s = backoff_s
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self._gate = asyncio.Semaphore(max_concurrency)
        self._cache: dict[tuple[str, str], JudgeReply] | None = {} if cache else None
        self._pending: dict[tuple[str, str], _Pending] = {}
        self.requests = 0  # HTTP requests sent (retries included)

    def render(self, prompt: Any, completion: str, answer: Any, template: str | None = None) -> str:
        return (template or self.template).format(question=_question(prompt), answer=answer, response=completion)

    async def __call__(
        self, prompt: Any, completion: str, answer: Any = None, *, template: str | None = None
    ) -> JudgeReply:
        text = self.render(prompt, completion, answer, template)
        key = (self.model, text)
        if self._cache is None:
            return await self._ask(text)
        if key in self._cache:
            return self._cache[key]
        pending = self._pending.get(key)
        if pending is None:  # the first to ask: the request runs as its own task
            pending = self._pending[key] = _Pending(asyncio.create_task(self._ask(text)))
            pending.task.add_done_callback(lambda task: self._settle(key, pending))
        pending.waiters += 1
        try:
            # shielded: this asker's cancellation (a timeout) stops its wait, not the request
            return await asyncio.shield(pending.task)
        finally:
            pending.waiters -= 1
            if pending.waiters == 0 and not pending.task.done():
                # nobody waits any more; a later asker starts afresh rather than joining a
                # request that is being cancelled
                self._pending.pop(key, None)
                pending.task.cancel()

    def _settle(self, key: tuple[str, str], pending: _Pending) -> None:
        """A request finished: cache its reply; errors reach the askers through the task."""
        if self._pending.get(key) is pending:
            del self._pending[key]
        if pending.task.cancelled():
            return
        if pending.task.exception() is None and self._cache is not None:  # (marks it retrieved)
            self._cache[key] = pending.task.result()

    async def _ask(self, text: str) -> JudgeReply:
        import openai

        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._gate:
                    self.requests += 1
                    resp = await self._client.chat.completions.create(
                        model=self.model,
                        messages=[{"role": "user", "content": text}],
                        max_tokens=self.max_tokens,
                        temperature=self.temperature,
                    )
                choice = resp.choices[0]
                return JudgeReply(choice.message.content or "", choice.finish_reason)
            except (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError) as e:
                last = e
            except openai.APIStatusError as e:
                if e.status_code < 500:
                    raise RuntimeError(f"judge rejected the request ({e.status_code}): {e.message}") from e
                last = e
        raise RuntimeError(f"judge unavailable after {self.max_retries + 1} attempts: {type(last).__name__}: {last}")

    async def close(self) -> None:
        await self._client.close()


_THINKING = re.compile(r"\s*<think>.*?</think>", re.S | re.I)
_VERDICT = re.compile(r"[\s*_`'\"]*(yes|no)[\s*_`'\".!]*", re.I)


def yes_means_correct(reply: str) -> float:
    """1.0 for "yes", 0.0 for "no"; raises ``ValueError`` for any other reply (module docstring)."""
    thinking = _THINKING.match(reply)
    verdict = _VERDICT.fullmatch(reply[thinking.end() :] if thinking else reply)
    if verdict:
        return 1.0 if verdict[1].lower() == "yes" else 0.0
    if getattr(reply, "finish_reason", None) == "length":
        fix = "the reply was cut at max_tokens: raise the judge's max_tokens (a reasoning judge needs room)"
    else:
        fix = "the judge must reply only yes or no: use a model that follows the prompt, or JudgeRubric(parse=...)"
    raise ValueError(f"judge verdict unparseable: {reply[:80]!r}; {fix}")


class JudgeRubric(Rubric):
    """A rubric whose functions can ask a judge model; see the module docstring."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        funcs: Sequence[Callable[..., Any]] | None = None,
        weights: Sequence[float] | None = None,
        parse: Callable[[str], float] = yes_means_correct,
        **judge_kwargs: Any,
    ) -> None:
        self.judge = Judge(base_url=base_url, model=model, **judge_kwargs)
        self.parse = parse

        async def judge_correct(judge: Judge, prompt: Any, completion: str, answer: Any) -> float:
            return self.parse(await judge(prompt, completion, answer))

        super().__init__(funcs if funcs is not None else [judge_correct], weights, context={"judge": self.judge})
