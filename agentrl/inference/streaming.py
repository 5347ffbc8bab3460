"""Server-sent event streams for ``stream: true`` on chat and completions.

One ``data: {chunk}`` event per engine step that produced text (OpenAI
``chat.completion.chunk`` / ``text_completion`` chunks; the first chat chunk per choice has
``role``; the last one per choice has ``finish_reason``), an optional ``usage`` chunk
(``stream_options.include_usage``) and ``data: [DONE]``.  Text is detokenized
incrementally and never splits a UTF-8 character or sends text a stop string would cut
off, so the deltas concatenate to the non-streamed text for the same seed.  A chunk carries
the tokens sampled since the previous chunk (``logprobs``, ``token_versions``,
``token_support`` and, with ``return_token_ids``, ``token_ids``; chat puts
``prompt_token_ids`` on its first chunks, completions on each choice's first chunk).  With
``tools`` (and ``tool_choice`` not ``"none"``) a chat choice's text is buffered and sent in
one delta at its end, parsed into ``tool_calls`` exactly as the non-streamed reply is.
Errors known before generation starts are ordinary JSON 4xx responses; an engine failure
mid-stream is sent as a ``data: {"error": ...}`` event before ``[DONE]``.  A client that
disconnects mid-stream aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from agentrl.errors import RequestError
from agentrl.inference.engine import Engine, SequenceResult, TokenEvent
from agentrl.inference.protocol import APIError, ChatRequest, CompletionRequest, from_request_error
from agentrl.inference.sampling import EngineSampling
from agentrl.types import new_id

if TYPE_CHECKING:
    from agentrl.inference.server import EngineServer


def _chunk_writer(rid: str, kind: str, created: int, model: str, usage: bool) -> Callable[..., str]:
    """One SSE event per chunk; ``usage: null`` on every chunk when the final usage chunk is asked for."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
        if usage:
            body["usage"] = None
        return _sse({**body, **extra})

    return chunk




class IncrementalDetokenizer:
    """Text deltas of a growing list of token ids (vLLM-style prefix/read offsets).

    Each step decodes a short window ``ids[prefix:]`` and compares it with the window's
    already-read part ``ids[prefix:read]``, so the cost does not grow with the text.  A
    token that ends inside a multi-byte character (byte-level BPE) decodes to a trailing
    U+FFFD: its text is held until a later token completes the character.  ``hold`` more
    characters stay back so that the start of a stop string is never sent before the engine
    has seen (and cut off) the whole stop string.  :meth:`finish` sends the rest of the
    engine's final text, which is authoritative (eos, stop truncation, a dangling byte).
    """

    def __init__(self, tokenizer: Any, hold: int = 0):
        self.tok, self.hold = tokenizer, hold
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # clean text of ids[:read]
        self.sent = 0  # characters of text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        end = len(self.text) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def finish(self, final_text: str) -> str:
        delta, self.sent = final_text[self.sent :], len(final_text)
        return delta


class _EngineStream:
    """Streamed engine requests (one per prompt) feeding one asyncio queue.

    The engine thread hands over each step's events with one ``call_soon_threadsafe`` per
    request; a request's done-callback queues ``(prompt, None)`` after its last events.
    """

    def __init__(self, engine: Engine, jobs: list[tuple[list[int], EngineSampling]], n: int):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, list[TokenEvent] | None]] = asyncio.Queue()
        self.futures: list[concurrent.futures.Future] = []
        try:
            for p, (prompt_ids, sampling) in enumerate(jobs):
                fut = engine.submit(prompt_ids, sampling, n, on_tokens=partial(self._handoff, loop, p))
                fut.add_done_callback(lambda _f, p=p: self._handoff(loop, p, None))
                self.futures.append(fut)
        except RequestError as e:
            self.cancel()
            raise from_request_error(e) from e

    def _handoff(self, loop: asyncio.AbstractEventLoop, prompt: int, events: list[TokenEvent] | None) -> None:
        try:
            loop.call_soon_threadsafe(self.queue.put_nowait, (prompt, events))
        except RuntimeError:  # the loop is closed (server shutting down)
            if events is not None:
                raise  # the engine aborts the request

    def cancel(self) -> None:
        """Abort whatever is still running (a no-op for finished requests)."""
        for f in self.futures:
            f.cancel()

    async def batches(self) -> AsyncIterator[list[tuple[int, list[TokenEvent]]]]:
        """Everything that has arrived, in order, until every request is done.

        A consumer that falls behind gets fewer, larger batches (one write each).
        """
        running = len(self.futures)
        while running:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            out = []
            for p, events in items:
                if events is not None:
                    out.append((p, events))
                    continue
                running -= 1
                err = None if self.futures[p].cancelled() else self.futures[p].exception()
                if err is not None:
                    raise err
            if out:
                yield out

    def results(self) -> list[SequenceResult]:
        return [r for f in self.futures for r in f.result()]


@dataclass
class _ChoiceStream:
    """One choice being streamed: its detokenizer and the tokens no chunk has carried yet."""

    detok: IncrementalDetokenizer
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    support: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    offset: int = 0  # completions text_offset of the next token
    started: bool = False

    def take(self, events: list[TokenEvent]) -> None:
        for ev in events:
            self.ids.append(ev.token_id)
            self.logprobs.append(ev.logprob)
            self.versions.append(ev.version)
            self.support.append(ev.support)
            self.tops.append(ev.top_logprobs)

    def flush(self, choice: dict[str, Any], token_ids: bool) -> dict[str, Any]:
        """Attach the pending tokens to ``choice`` and forget them."""
        choice["token_versions"] = self.versions
        choice["token_support"] = self.support
        if token_ids:
            choice["token_ids"] = self.ids
        self.ids, self.logprobs, self.versions, self.support, self.tops = [], [], [], [], []
        return choice


def _by_choice(batch: list[tuple[int, list[TokenEvent]]], n: int) -> dict[int, list[TokenEvent]]:
    """Group a batch's events by global choice index (prompt * n + choice), keeping order."""
    out: dict[int, list[TokenEvent]] = {}
    for p, events in batch:
        for ev in events:
            out.setdefault(p * n + ev.index, []).append(ev)
    return out


def _sse(body: Any) -> str:
    return f"data: {json.dumps(body)}\n\n"


ChoiceBuilder = Callable[[int, _ChoiceStream, list[TokenEvent]], "dict[str, Any] | None"]


async def _stream_chunks(
    stream: _EngineStream, n: int, choices: list[_ChoiceStream], chunk: Callable[..., str], build: ChoiceBuilder,
    *, token_ids: bool, usage: Callable[[], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """What chat and completions streams share: per engine step, one chunk for each choice
    ``build`` has something to say about (None = hold it back), then usage and ``[DONE]``."""
    try:
        async for batch in stream.batches():
            out = []
            for i, events in _by_choice(batch, n).items():
                c = choices[i]
                c.take(events)
                choice = build(i, c, events)
                if choice is not None:
                    out.append(chunk([c.flush(choice, token_ids)]))
            if out:
                yield "".join(out)
    except Exception as e:  # the engine failed mid-stream: the status line is long gone
        yield _sse({"error": {"message": str(e), "type": "internal_server_error", "param": None, "code": 500}})
    else:
        if usage is not None:
            yield chunk([], usage=usage())
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends.

    On a client disconnect Starlette cancels the body iterator (ASGI spec < 2.4) or the
    send fails (>= 2.4); either way ``__call__`` ends and ``on_close`` cancels the engine
    futures, which the engine drops at its next step (``requests_aborted``).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # already closing
                    pass



async def chat_stream(srv: EngineServer, req: ChatRequest) -> StreamingResponse:
    """Validate and submit now (errors stay JSON 4xx), then stream the chunks."""
    srv.check_model(req.model)
    prompt_ids = await srv.render_chat(req)
    k = (req.top_logprobs or 0) if req.logprobs else 0
    sampling = srv.sampling(req, k)
    stream = _EngineStream(srv.engine, [(prompt_ids, sampling)], req.n)
    return _EventStream(_chat_events(srv, req, prompt_ids, sampling, stream), stream.cancel)


async def _chat_events(
    srv: EngineServer, req: ChatRequest, prompt_ids: list[int], sampling: EngineSampling, stream: _EngineStream
) -> AsyncIterator[str]:
    rid, created = new_id("chatcmpl-"), int(time.time())
    usage = bool(req.stream_options and req.stream_options.include_usage)
    # buffered: the whole text is needed to tell tool calls from content
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    hold = max((len(x) for x in sampling.stop), default=1) - 1

    chunk = _chunk_writer(rid, "chat.completion.chunk", created, srv.name, usage)

    first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
    yield "".join(
        chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **first)
        for i in range(req.n)
    )
    choices = [_ChoiceStream(IncrementalDetokenizer(srv.tok, hold)) for _ in range(req.n)]

    def build(i: int, c: _ChoiceStream, events: list[TokenEvent]) -> dict[str, Any] | None:
        last = events[-1]
        finish = last.finish_reason
        if finish is None:
            if parse_tools:
                return None
            text = c.detok.add([ev.token_id for ev in events])
            if not text:
                return None  # held back; its tokens ride on the next chunk
            delta: dict[str, Any] = {"content": text}
        elif parse_tools:
            delta, finish = _tool_delta(srv, last.text or "", finish)
        else:
            delta = {"content": c.detok.finish(last.text or "")}
        logprobs = None
        if req.logprobs:
            entries = srv.chat_logprob_entries(c.ids, c.logprobs, c.tops, req.return_tokens_as_token_ids)
            logprobs = {"content": entries}
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async for event in _stream_chunks(
        stream, req.n, choices, chunk, build, token_ids=req.return_token_ids,
        usage=(lambda: srv.usage(len(prompt_ids), stream.results())) if usage else None,
    ):
        yield event


def _tool_delta(srv: EngineServer, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A tools-enabled choice's one delta: what the non-streamed message would hold."""
    parsed = srv.tool_parser.parse(text)
    if not parsed.tool_calls:
        return {"content": text}, finish
    delta: dict[str, Any] = {}
    content = (parsed.content or None) if not parsed.errors else text
    if content is not None:
        delta["content"] = content
    delta["tool_calls"] = [{"index": j, **tc.to_dict()} for j, tc in enumerate(parsed.tool_calls)]
    return delta, "tool_calls" if finish == "stop" else finish

# -- completions



async def completions_stream(srv: EngineServer, req: CompletionRequest) -> StreamingResponse:
    """Validate and submit every prompt now (errors stay JSON 4xx), then stream."""
    srv.check_model(req.model)
    if req.echo:
        raise APIError(400, "echo=true is not supported by the embedded engine", param="echo")
    prompts = await srv.prompts(req.prompt)
    samplings = [srv.sampling(req, req.logprobs or 0) for _ in prompts]  # one each: submit() trims max_tokens
    stream = _EngineStream(srv.engine, list(zip(prompts, samplings, strict=True)), req.n)
    return _EventStream(_completion_events(srv, req, prompts, samplings[0], stream), stream.cancel)


async def _completion_events(
    srv: EngineServer, req: CompletionRequest, prompts: list[list[int]], sampling: EngineSampling, stream: _EngineStream
) -> AsyncIterator[str]:
    rid, created = new_id("cmpl-"), int(time.time())
    usage = bool(req.stream_options and req.stream_options.include_usage)
    hold = max((len(x) for x in sampling.stop), default=1) - 1
    as_ids = req.return_tokens_as_token_ids

    chunk = _chunk_writer(rid, "text_completion", created, srv.name, usage)

    choices = [_ChoiceStream(IncrementalDetokenizer(srv.tok, hold)) for _ in range(len(prompts) * req.n)]

    def build(i: int, c: _ChoiceStream, events: list[TokenEvent]) -> dict[str, Any] | None:
        last = events[-1]
        if last.finish_reason is None:
            text = c.detok.add([ev.token_id for ev in events])
            if not text:
                return None  # held back; its tokens ride on the next chunk
        else:
            text = c.detok.finish(last.text or "")
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        if req.logprobs is not None:
            choice["logprobs"] = lp = srv.completion_logprob_fields(c.ids, c.logprobs, c.tops, as_ids, c.offset)
            c.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else c.offset
        if req.return_token_ids and not c.started:
            choice["prompt_token_ids"] = prompts[i // req.n]
        c.started = True
        return choice

    async for event in _stream_chunks(
        stream, req.n, choices, chunk, build, token_ids=req.return_token_ids,
        usage=(lambda: srv.usage(sum(len(p) for p in prompts), stream.results())) if usage else None,
    ):
        yield event
