"""OpenAI-compatible HTTP server (FastAPI) around :class:`agentrl.inference.engine.Engine`.

Routes (vLLM names and fields where vLLM has them):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI schema (messages, tools,
  n, max_tokens, temperature, top_p, stop, seed, logprobs/top_logprobs) plus vLLM extras
  ``top_k``, ``return_token_ids`` (→ ``prompt_token_ids`` and per-choice ``token_ids``),
  ``stop_token_ids``, ``ignore_eos``, ``return_tokens_as_token_ids``, token-id prompts on
  ``/v1/completions``; every choice carries ``token_versions`` (weight version per token).
- ``POST /tokenize`` (``prompt`` or ``messages`` + ``tools``), ``POST /detokenize``.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (JSON).
- weights: ``POST /pause`` (mode=keep), ``POST /resume``, ``GET /is_paused``,
  ``POST /update_weights_from_disk`` ``{model_path, weight_version?, lora?}``,
  ``POST /update_weights_from_shm`` ``{path, size, manifest, weight_version?, lora?}``
  (``lora: true``: the tensors are LoRA factors the engine merges into its base weights),
  ``GET /get_weight_version``, ``POST /update_weight_version`` ``{weight_version}``.

Streaming (``stream: true`` on both generation routes) answers ``text/event-stream``: one
``data: {chunk}`` event per engine step that produced text (OpenAI ``chat.completion.chunk``
/ ``text_completion`` chunks; the first chat chunk per choice has ``role``; the last one per
choice has ``finish_reason``), an optional ``usage`` chunk (``stream_options.include_usage``)
and ``data: [DONE]``.  Text is detokenized incrementally and never splits a UTF-8 character
or sends text a stop string would cut off, so the deltas concatenate to the non-streamed
text for the same seed.  A chunk carries the tokens sampled since the previous chunk
(``logprobs``, ``token_versions`` and, with ``return_token_ids``, ``token_ids``; chat puts
``prompt_token_ids`` on its first chunks, completions on each choice's first chunk).  With
``tools`` (and ``tool_choice`` not ``"none"``) a chat choice's text is buffered and sent in
one delta at its end, parsed into ``tool_calls`` exactly as the non-streamed reply is.
Errors known before generation starts are ordinary JSON 4xx responses; an engine failure
mid-stream is sent as a ``data: {"error": ...}`` event before ``[DONE]``.  A client that
disconnects mid-stream aborts its request in the engine.

Every bad request gets an OpenAI-style JSON error (``{"error": {message, type, param,
code}}``) with a 4xx status; an over-long prompt gets code ``context_length_exceeded``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.inference.engine import (
    Engine,
    EngineRequestError,
    Sampling,
    SequenceResult,
    SharedWeights,
    TokenEvent,
    load_safetensors_path,
    read_safetensors,
)
from agentrl.inference.lora import AdapterMerger
from agentrl.inference.render import render_chat_ids
from agentrl.tool_format import parse_tool_calls
from agentrl.types import new_id

# ----------------------------------------------------------------------------- schemas


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _none_is_default(cls, v, info):
        return {"temperature": 1.0, "top_p": 1.0}[info.field_name] if v is None else v


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DiskWeightsRequest(_Body):
    model_path: str
    weight_version: int | None = None
    lora: bool = False  # the tensors are LoRA factors to merge (agentrl.inference.lora)


class ShmWeightsRequest(_Body):
    path: str
    size: int = Field(ge=0)
    manifest: list[dict[str, Any]]
    weight_version: int | None = None
    lora: bool = False


class VersionRequest(_Body):
    weight_version: int


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _from_engine(e: EngineRequestError) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


# ----------------------------------------------------------------------------- app


def _chunk_writer(rid: str, kind: str, created: int, model: str, usage: bool) -> Callable[..., str]:
    """One SSE event per chunk; ``usage: null`` on every chunk when the final usage chunk is asked for."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
        if usage:
            body["usage"] = None
        return _sse({**body, **extra})

    return chunk


async def _unless_disconnected(work: Any, http: Request) -> Any:
    """Await a generation route's work, aborting it in the engine if the client goes away.

    Uvicorn does not cancel a plain handler on disconnect, so without this a client that
    timed out (or an episode the rollout manager cancelled) would keep its engine slots
    busy until ``max_tokens``.  The body has been read, so the next ASGI message is
    ``http.disconnect``: waiting on it costs nothing while the request is alive.
    """
    job = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not job.done():
            job.cancel()  # -> generate() cancels the engine future -> slots freed next step
        gone.cancel()
    if not job.done() or job.cancelled():
        return JSONResponse(status_code=499, content={"error": {"message": "client closed the request"}})
    return job.result()


# ----------------------------------------------------------------------------- streaming


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

    def __init__(self, engine: Engine, jobs: list[tuple[list[int], Sampling]], n: int):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, list[TokenEvent] | None]] = asyncio.Queue()
        self.futures: list[concurrent.futures.Future] = []
        try:
            for p, (prompt_ids, sampling) in enumerate(jobs):
                fut = engine.submit(prompt_ids, sampling, n, on_tokens=partial(self._handoff, loop, p))
                fut.add_done_callback(lambda _f, p=p: self._handoff(loop, p, None))
                self.futures.append(fut)
        except EngineRequestError as e:
            self.cancel()
            raise _from_engine(e) from e

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
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    offset: int = 0  # completions text_offset of the next token
    started: bool = False

    def take(self, events: list[TokenEvent]) -> None:
        for ev in events:
            self.ids.append(ev.token_id)
            self.logprobs.append(ev.logprob)
            self.versions.append(ev.version)
            self.tops.append(ev.top_logprobs)

    def flush(self, choice: dict[str, Any], token_ids: bool) -> dict[str, Any]:
        """Attach the pending tokens to ``choice`` and forget them."""
        choice["token_versions"] = self.versions
        if token_ids:
            choice["token_ids"] = self.ids
        self.ids, self.logprobs, self.versions, self.tops = [], [], [], []
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


class EngineServer:
    """Request handling shared by the routes (tokenization, sampling, response shapes)."""

    def __init__(self, engine: Engine, served_model_name: str):
        self.engine = engine
        self.name = served_model_name
        self.tok = engine.tokenizer
        self.shared = SharedWeights()
        self.adapters = AdapterMerger()
        self.started = time.time()

    # -- helpers

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.name, str(self.engine.model_dir)):
            raise APIError(
                404,
                f"The model `{model}` does not exist. Available: {self.name!r}.",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )

    def render_chat(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        gen = req.add_generation_prompt and not req.continue_final_message
        try:
            return render_chat_ids(
                self.tok,
                messages,
                req.tools,
                gen,
                continue_final_message=req.continue_final_message,
                **dict(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # template errors are the caller's malformed input
            raise APIError(400, f"could not apply the chat template to these messages: {e}", param="messages") from e

    def sampling(self, req: _SamplingBody, top_logprobs: int) -> Sampling:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        max_tokens = req.max_completion_tokens or req.max_tokens or self.engine.max_model_len
        return Sampling(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else -1,
            seed=req.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            top_logprobs=top_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int) -> list[SequenceResult]:
        try:
            fut = self.engine.submit(prompt_ids, sampling, n)
        except EngineRequestError as e:
            raise _from_engine(e) from e
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def token_str(self, tid: int, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids else self.tok.decode([tid])

    # -- chat

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        self.check_model(req.model)
        prompt_ids = self.render_chat(req)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        results = await self.generate(prompt_ids, self.sampling(req, k), req.n)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = r.finish_reason
            if parse_tools:
                parsed = parse_tool_calls(r.text)
                if parsed.tool_calls:
                    message["tool_calls"] = [tc.to_dict() for tc in parsed.tool_calls]
                    message["content"] = (parsed.content or None) if not parsed.errors else r.text
                    if finish == "stop":
                        finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": self.chat_logprobs(r, req) if req.logprobs else None,
                "token_versions": r.versions,
            }
            if req.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": self.usage(len(prompt_ids), results),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    def chat_logprobs(self, r: SequenceResult, req: ChatRequest) -> dict[str, Any]:
        tops = [r.top_logprobs[j] if j < len(r.top_logprobs) else [] for j in range(len(r.token_ids))]
        return {"content": self.chat_logprob_entries(r.token_ids, r.logprobs, tops, req.return_tokens_as_token_ids)}

    def chat_logprob_entries(
        self, token_ids: list[int], logprobs: list[float], tops: list[Any], as_ids: bool
    ) -> list[dict[str, Any]]:
        content = []
        for tid, lp, top in zip(token_ids, logprobs, tops, strict=True):
            s = self.token_str(tid, as_ids)
            content.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": self.token_str(t, as_ids), "logprob": v, "bytes": list(self.token_str(t, as_ids).encode())}
                        for t, v in top or []
                    ],
                }
            )
        return content

    def chat_stream(self, req: ChatRequest) -> StreamingResponse:
        """Validate and submit now (errors stay JSON 4xx), then stream the chunks."""
        self.check_model(req.model)
        prompt_ids = self.render_chat(req)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        sampling = self.sampling(req, k)
        stream = _EngineStream(self.engine, [(prompt_ids, sampling)], req.n)
        return _EventStream(self._chat_events(req, prompt_ids, sampling, stream), stream.cancel)

    async def _chat_events(
        self, req: ChatRequest, prompt_ids: list[int], sampling: Sampling, stream: _EngineStream
    ) -> AsyncIterator[str]:
        rid, created = new_id("chatcmpl-"), int(time.time())
        usage = bool(req.stream_options and req.stream_options.include_usage)
        # buffered: the whole text is needed to tell tool calls from content
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        hold = max((len(x) for x in sampling.stop), default=1) - 1

        chunk = _chunk_writer(rid, "chat.completion.chunk", created, self.name, usage)

        first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
        yield "".join(
            chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **first)
            for i in range(req.n)
        )
        choices = [_ChoiceStream(IncrementalDetokenizer(self.tok, hold)) for _ in range(req.n)]

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
                delta, finish = self._tool_delta(last.text or "", finish)
            else:
                delta = {"content": c.detok.finish(last.text or "")}
            logprobs = None
            if req.logprobs:
                entries = self.chat_logprob_entries(c.ids, c.logprobs, c.tops, req.return_tokens_as_token_ids)
                logprobs = {"content": entries}
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        async for event in _stream_chunks(
            stream, req.n, choices, chunk, build, token_ids=req.return_token_ids,
            usage=(lambda: self.usage(len(prompt_ids), stream.results())) if usage else None,
        ):
            yield event

    @staticmethod
    def _tool_delta(text: str, finish: str) -> tuple[dict[str, Any], str]:
        """A tools-enabled choice's one delta: what the non-streamed message would hold."""
        parsed = parse_tool_calls(text)
        if not parsed.tool_calls:
            return {"content": text}, finish
        delta: dict[str, Any] = {}
        content = (parsed.content or None) if not parsed.errors else text
        if content is not None:
            delta["content"] = content
        delta["tool_calls"] = [{"index": j, **tc.to_dict()} for j, tc in enumerate(parsed.tool_calls)]
        return delta, "tool_calls" if finish == "stop" else finish

    # -- completions

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported by the embedded engine", param="echo")
        prompts = self.prompts(req.prompt)
        k = req.logprobs or 0
        sampling = [self.sampling(req, k) for _ in prompts]
        batches = await asyncio.gather(*(self.generate(p, s, req.n) for p, s in zip(prompts, sampling, strict=True)))
        choices = []
        for p_ids, results in zip(prompts, batches, strict=True):
            for r in results:
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "logprobs": self.completion_logprobs(r, req) if req.logprobs is not None else None,
                    "token_versions": r.versions,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = p_ids
                    choice["token_ids"] = r.token_ids
                choices.append(choice)
        return {
            "id": new_id("cmpl-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": self.usage(sum(len(p) for p in prompts), [r for b in batches for r in b]),
        }

    def completions_stream(self, req: CompletionRequest) -> StreamingResponse:
        """Validate and submit every prompt now (errors stay JSON 4xx), then stream."""
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported by the embedded engine", param="echo")
        prompts = self.prompts(req.prompt)
        samplings = [self.sampling(req, req.logprobs or 0) for _ in prompts]  # one each: submit() trims max_tokens
        stream = _EngineStream(self.engine, list(zip(prompts, samplings, strict=True)), req.n)
        return _EventStream(self._completion_events(req, prompts, samplings[0], stream), stream.cancel)

    async def _completion_events(
        self, req: CompletionRequest, prompts: list[list[int]], sampling: Sampling, stream: _EngineStream
    ) -> AsyncIterator[str]:
        rid, created = new_id("cmpl-"), int(time.time())
        usage = bool(req.stream_options and req.stream_options.include_usage)
        hold = max((len(x) for x in sampling.stop), default=1) - 1
        as_ids = req.return_tokens_as_token_ids

        chunk = _chunk_writer(rid, "text_completion", created, self.name, usage)

        choices = [_ChoiceStream(IncrementalDetokenizer(self.tok, hold)) for _ in range(len(prompts) * req.n)]

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
                choice["logprobs"] = lp = self.completion_logprob_fields(c.ids, c.logprobs, c.tops, as_ids, c.offset)
                c.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else c.offset
            if req.return_token_ids and not c.started:
                choice["prompt_token_ids"] = prompts[i // req.n]
            c.started = True
            return choice

        async for event in _stream_chunks(
            stream, req.n, choices, chunk, build, token_ids=req.return_token_ids,
            usage=(lambda: self.usage(sum(len(p) for p in prompts), stream.results())) if usage else None,
        ):
            yield event

    def prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tok.encode(prompt, add_special_tokens=False)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        out = []
        for p in prompt:
            out.extend(self.prompts(p))
        return out

    def completion_logprobs(self, r: SequenceResult, req: CompletionRequest) -> dict[str, Any]:
        tops = r.top_logprobs or None
        return self.completion_logprob_fields(
            r.token_ids, r.logprobs, tops or [None] * len(r.token_ids), req.return_tokens_as_token_ids, 0
        )

    def completion_logprob_fields(
        self, token_ids: list[int], logprobs: list[float], tops: list[Any], as_ids: bool, offset: int
    ) -> dict[str, Any]:
        """Legacy completions logprobs; ``offset`` is where these tokens' text starts."""
        tokens = [self.token_str(t, as_ids) for t in token_ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        top_dicts = None
        if any(row is not None for row in tops):
            top_dicts = [{self.token_str(t, as_ids): v for t, v in row or []} for row in tops]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}

    @staticmethod
    def usage(prompt_tokens: int, results: list[SequenceResult]) -> dict[str, int]:
        completion = sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def create_app(engine: Engine, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app; the engine's lifetime is the caller's."""
    srv = EngineServer(engine, served_model_name or engine.model_dir.name)
    app = FastAPI(title="agentrl embedded engine")
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in e.errors()[:5])
        return _error(400, msg or "invalid request", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), type_="NotFoundError" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(ValidationError)
    async def _pyd_error(_: Request, e: ValidationError):
        return _error(400, str(e).splitlines()[0])

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, http: Request):
        if req.stream:
            return srv.chat_stream(req)
        return await _unless_disconnected(srv.chat(req), http)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        if req.stream:
            return srv.completions_stream(req)
        return await _unless_disconnected(srv.completions(req), http)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        srv.check_model(req.model)
        if req.messages is not None:
            ids = srv.render_chat(req)
        elif req.prompt is not None:
            ids = srv.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either `prompt` or `messages`", param="prompt")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = srv.tok.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        srv.check_model(req.model)
        vocab = engine.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": srv.tok.decode(req.tokens)}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": srv.name,
            "object": "model",
            "created": int(srv.started),
            "owned_by": "agentrl",
            "root": str(engine.model_dir),
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return engine.stats()

    @app.post("/pause")
    async def pause(mode: str = "keep"):
        if mode != "keep":
            raise APIError(400, f"pause mode {mode!r} is not supported; use mode=keep", param="mode")
        await asyncio.to_thread(engine.pause)
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        engine.resume()
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.version}

    @app.post("/update_weight_version")
    async def update_weight_version(req: VersionRequest):
        version = await asyncio.to_thread(engine.update_weights, lambda m: None, req.weight_version)
        return {"success": True, "weight_version": version}

    async def _update(version: int | None, lora: bool, load: Callable, read_factors: Callable) -> dict[str, Any]:
        """Full weights (``load(model)``) or LoRA factors (``read_factors()``) as ``version``."""

        def apply(model) -> int:
            if lora:
                return srv.adapters.apply(model, read_factors())
            n = load(model)
            srv.adapters.reset()  # new base weights: adapters merged before no longer apply
            return n

        t0 = time.perf_counter()
        count: list[int] = []
        try:
            new = await asyncio.to_thread(engine.update_weights, lambda m: count.append(apply(m)), version)
        except EngineRequestError as e:
            raise _from_engine(e) from e
        return {"success": True, "weight_version": new, "num_tensors": count[0] if count else 0,
                "seconds": time.perf_counter() - t0}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(req: DiskWeightsRequest):
        return await _update(
            req.weight_version, req.lora,
            lambda m: load_safetensors_path(m, req.model_path), lambda: read_safetensors(req.model_path),
        )

    @app.post("/update_weights_from_shm")
    async def update_from_shm(req: ShmWeightsRequest):
        return await _update(
            req.weight_version, req.lora,
            lambda m: srv.shared.apply(m, req.path, req.manifest, req.size),
            lambda: srv.shared.views(req.path, req.manifest, req.size),
        )

    return app


# ----------------------------------------------------------------------------- serve


def _watch_parent(ppid: int) -> None:
    """Exit when the process that started us is gone (no orphaned engines)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(0)


def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: int = 64,
    max_model_len: int = 1024,
    device: str = "auto",
    served_model_name: str | None = None,
    port_file: str | None = None,
    parent_pid: int | None = None,
    log_level: str = "warning",
) -> None:
    """Load the model, bind ``host:port`` (0 = a free port), serve until interrupted."""
    import uvicorn

    engine = Engine(model_dir, max_batch_size=max_batch_size, max_model_len=max_model_len, device=device)
    app = create_app(engine, served_model_name)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit this; without it keep-alive requests stall ~40 ms (Nagle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    if parent_pid:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if port_file:
        tmp = Path(port_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": bound, "pid": os.getpid()}))
        tmp.replace(port_file)
    print(f"agentrl engine: serving {app.state.server.name!r} on http://{host}:{bound}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m agentrl.inference.server MODEL_DIR [--port ...]`` (used by the launcher)."""
    import argparse

    ap = argparse.ArgumentParser(prog="agentrl-engine")
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--port-file", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    a = ap.parse_args(argv)
    serve(
        a.model_dir,
        host=a.host,
        port=a.port,
        max_batch_size=a.max_batch_size,
        max_model_len=a.max_model_len,
        device=a.device,
        served_model_name=a.served_model_name,
        port_file=a.port_file,
        parent_pid=a.parent_pid,
    )


if __name__ == "__main__":
    main()
