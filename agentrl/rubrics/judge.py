"""JudgeRubric: an OpenAI-compatible model grades the episodes.

    rubric = JudgeRubric(base_url="http://localhost:8000/v1", model="judge")

By default one reward function, ``judge_correct``, asks the judge whether the final reply
matches the task's answer and scores 1.0 for a reply starting with "yes".  Any reward
function of the rubric may also ask for ``judge`` and call it directly:

    async def style(judge, prompt, completion, answer):
        return float("good" in await judge(prompt, completion, answer, template=STYLE_PROMPT))

The judge caps concurrent requests, retries transient failures with exponential backoff,
and caches replies by (model, rendered prompt), so a group of identical completions costs
one request.  A judge that still fails raises, and the rubric marks that episode errored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
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
        self._cache: dict[tuple[str, str], str] | None = {} if cache else None
        self._pending: dict[tuple[str, str], asyncio.Future[str]] = {}
        self.requests = 0  # HTTP requests sent (retries included)

    def render(self, prompt: Any, completion: str, answer: Any, template: str | None = None) -> str:
        return (template or self.template).format(question=_question(prompt), answer=answer, response=completion)

    async def __call__(self, prompt: Any, completion: str, answer: Any = None, *, template: str | None = None) -> str:
        text = self.render(prompt, completion, answer, template)
        key = (self.model, text)
        if self._cache is not None:
            if key in self._cache:
                return self._cache[key]
            if key in self._pending:  # the same question is already being asked
                return await asyncio.shield(self._pending[key])
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._pending[key] = fut
            try:
                reply = await self._ask(text)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # mark retrieved; waiters re-raise it
                raise
            finally:
                self._pending.pop(key, None)
            self._cache[key] = reply
            fut.set_result(reply)
            return reply
        return await self._ask(text)

    async def _ask(self, text: str) -> str:
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
                return resp.choices[0].message.content or ""
            except (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError) as e:
                last = e
            except openai.APIStatusError as e:
                if e.status_code < 500:
                    raise RuntimeError(f"judge rejected the request ({e.status_code}): {e.message}") from e
                last = e
        raise RuntimeError(f"judge unavailable after {self.max_retries + 1} attempts: {type(last).__name__}: {last}")

    async def close(self) -> None:
        await self._client.close()


def yes_means_correct(reply: str) -> float:
    return 1.0 if reply.strip().lower().lstrip("*\"' ").startswith("yes") else 0.0


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
