"""The gateway: an episode-scoped OpenAI-compatible chat endpoint for agent programs.

An agent program written for the ``openai`` SDK (a CLI harness, an in-process coroutine)
talks to ``{base_url}/chat/completions`` as it would to any provider; every call is
rendered with the model's chat template, sampled through the run's policy client
(token ids in and out) and recorded token-exactly: prompt and completion ids, the
behaviour logprobs μ, the support and the weight version of every sampled token.

One :class:`Gateway` (one loopback HTTP server) serves many episodes; :meth:`Gateway.open`
gives each episode a :class:`Session` with its own path (``/episodes/<id>/v1``) and key
(:func:`agentrl.auth.new_key`).  A call without that key (or for an unknown episode) is a
401; a call after the episode ended is a 410.  The key lives only as long as its episode.

**Sequences.**  A call *joins* a sequence when its messages extend that sequence's last call
(its messages, then the assistant reply exactly as the gateway returned it, then anything
new), with the same tools, and the template continues it token-exactly (the episode loop's
rule, :func:`agentrl.render.bridge`): the sampled ids stay as sampled, the new messages are
appended as forced tokens.  Any other call (the program edited history, summarised, forked,
or called while the sequence it extends was busy with another call) starts a new sequence of
the same episode; every sequence after the first counts in ``template_breaks``.  Concurrent
calls never share a sequence, so interleaved calls stay apart.

**Sampling.**  Temperature, top-p, top-k, min-p and the seed are the run's (the trainer
rebuilds μ from them); the program's values are ignored, as are its penalties and its
bookkeeping fields (``user``, ``metadata``, ``store``, ...), vLLM's sampling extras
(``min_tokens``, ``stop_token_ids``, ...) and, with one warning, ``chat_template_kwargs``.  A
field whose effect or reply shape the gateway cannot give (``logprobs``, ``response_format``
other than text, the legacy ``functions``, ``logit_bias``, ...) is a 400 that names it, and so is
a field neither the OpenAI API nor vLLM knows (as the API answers it); a 400 before the model was
called is the program's failure, never the policy's.  ``max_tokens`` /
``max_completion_tokens`` and ``stop`` are honoured within the run's per-turn budget and the
episode's token limits; past ``max_calls`` a call is a 400 (its body unparsed), each further one answered a little
later, one episode's refusals one after another (a retry loop, or many threads, would otherwise spin on the
run's event loop).  A call whose client went away (a timeout, a killed thread) is cancelled: it leaves that
queue, or stops sampling and records nothing (it still counts against ``max_calls``).  ``n`` must be 1.  ``tool_choice``: ``"none"`` returns the text
unparsed; ``"auto"``, ``"required"`` and a named function parse tool calls with the model's
tool-call format but do not constrain decoding (a reply without a call stays text).
``stream: true`` sends the finished reply as server-sent-event chunks (one content chunk,
one per tool call), ``stream_options.include_usage`` adds the usage chunk.

This module imports nothing above the policy-client protocol: envs and the episode loop use
it without importing the inference package.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web

from agentrl.auth import bearer, matches, new_key
from agentrl.errors import ContextLengthExceeded, EndpointError, EpisodeFailure
from agentrl.gateway_request import Refused, read_request
from agentrl.guard import AiohttpDoor, Limits
from agentrl.render import bridge
from agentrl.tool_format import get_parser
from agentrl.types import Completion, SamplingParams, TokenSequence, ToolCall, Turn, new_id

MAX_BODY = 8 << 20  # bytes of one request (a 128k-token conversation is ~1 MB of JSON)
MAX_IN_FLIGHT = 8  # one episode's calls served at once; more wait their turn
JSON, EVENTS = "application/json", "text/event-stream"
ENDED_KEPT = 4096  # ended episodes remembered, so a late call hears "ended" rather than 401
OVER_LIMIT_WAIT_S, OVER_LIMIT_WAIT_MAX_S = 0.02, 1.0  # the k-th refusal past max_calls waits (k-1) x 20 ms, at most 1 s


@dataclasses.dataclass
class _Branch:
    """The open end of one sequence: the call that last extended it."""

    seq: TokenSequence | None  # None until its first call has sampled
    messages: list[dict[str, Any]]  # that call's messages + the reply as returned
    tools: list[dict[str, Any]] | None
    sampled: list[int]  # that call's sampled ids ([] when it cannot be continued: cut off)
    busy: bool = True


class Session:
    """One episode's view of the gateway: its URL, key and everything its calls recorded.

    ``sequences`` / ``turns`` (one :class:`~agentrl.types.Turn` per call) are what the
    episode keeps; ``transcript`` is the last call's messages and reply (the program's
    conversation); ``failure`` is the first endpoint failure a call met (the program saw a
    5xx); ``refusals`` / ``first_refusal`` count the calls answered with an error (a program
    may swallow them); ``hit_limit`` says a call was refused for the episode's ``max_calls``.
    """

    def __init__(
        self,
        gateway: Gateway,
        client: Any,
        sampling: SamplingParams,
        *,
        tool_parser: str,
        max_calls: int,
        max_total_tokens: int | None,
        max_seq_len: int | None,
        token_exact: bool,
    ) -> None:
        self.id, self.key = new_id(), new_key()
        self.gateway, self.client, self.sampling = gateway, client, sampling
        self.parser = get_parser(tool_parser)
        self.max_calls, self.max_total_tokens, self.max_seq_len = max_calls, max_total_tokens, max_seq_len
        self.token_exact = token_exact
        self.sequences: list[TokenSequence] = []
        self.turns: list[Turn] = []
        self.transcript: list[dict[str, Any]] = []
        self.template_breaks = 0
        self.calls = 0  # calls admitted (sampling may still be under way)
        self.sampled_total = 0
        self._reserved = 0  # tokens that calls still sampling may yet add to sampled_total
        self._released = asyncio.Condition()  # a call sampling at once gave back what it did not use
        self.generation_s = self.tokenize_s = 0.0
        self.failure: EpisodeFailure | None = None
        self.refusals = 0  # calls answered with an error (the program may have swallowed them)
        self.admitted_refusals = 0  # of those, calls refused after they were admitted (counted in calls)
        self.first_refusal: str | None = None
        self.deadline: float | None = None  # loop time the episode's wall limit ends (set by the episode loop)
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.hit_limit = False
        self.over_limit = 0  # calls refused for max_calls
        self.closed = False
        self._branches: list[_Branch] = []
        self._lock = asyncio.Lock()
        self._over_limit_lock = asyncio.Lock()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of this episode (ends in ``/v1``)."""
        return f"{self.gateway.url}/episodes/{self.id}/v1"

    def refused(self, e: Refused) -> None:
        self.refusals += 1
        self.first_refusal = self.first_refusal or f"HTTP {e.status}: {e}"[:300]

    def close(self) -> None:
        """The episode is over: later calls are refused, calls still sampling are not recorded."""
        if not self.closed:
            self.closed = True
            self.gateway._end(self)

    # ------------------------------------------------------------------ one call

    async def refuse_if_spent(self) -> None:
        """Past ``max_calls`` a call is refused (before its body is parsed).  A program that keeps calling (a
        retry loop, or many threads of one) would spin on the run's event loop, which every episode shares:
        each further refusal waits a little longer, the first not at all, and the waits of one episode's
        refusals run one after another, so concurrent callers queue instead of each waiting on its own."""
        if self.calls < self.max_calls:
            return
        self.hit_limit = True
        async with self._over_limit_lock:
            if not self.closed:  # once the episode is over, the queue drains at once
                self.over_limit += 1
                await asyncio.sleep(min(OVER_LIMIT_WAIT_MAX_S, OVER_LIMIT_WAIT_S * (self.over_limit - 1)))
        raise Refused(400, f"this episode's limit of {self.max_calls} model calls is spent (max_turns)")

    async def chat(self, body: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, int]]:
        """Serve one chat-completion request: (assistant message, finish reason, usage)."""
        await self.refuse_if_spent()
        messages, tools, max_tokens, stop, parse_tools = read_request(body)
        self.calls += 1
        try:
            if not self.token_exact:
                return await self._chat_untracked(messages, tools, max_tokens, stop, parse_tools)
            return await self._chat_tracked(messages, tools, max_tokens, stop, parse_tools)
        except Exception:  # refused after admission (a cancelled call, whose client left, is not)
            self.admitted_refusals += 1
            raise

    async def _chat_tracked(
        self, messages: list[dict], tools: list[dict] | None, max_tokens: int | None, stop: list[str] | None,
        parse_tools: bool,
    ) -> tuple[dict[str, Any], str, dict[str, int]]:
        async with self._lock:  # choosing a sequence and claiming it is one step for concurrent calls
            branch, prompt = await self._place(messages, tools)
        try:
            async with self._budget(max_tokens, stop, len(prompt)) as sampling:
                t0 = time.perf_counter()
                completion = await self._sample(prompt, sampling)
                latency = time.perf_counter() - t0
                if self.closed:
                    raise Refused(410, "the episode ended while this call was sampling")
                # a turn that may have ended on a stop string has no end-of-turn token of its own: its
                # ids hold the stop string the reply drops, so the next call cannot continue it
                joinable = completion.finish_reason == "stop" and not sampling.stop
                return self._record(branch, messages, tools, prompt, completion, latency, parse_tools, joinable)
        finally:
            branch.busy = False
            if branch.seq is None:  # its first call failed: nothing to extend
                self._branches.remove(branch)

    async def _place(self, messages: list[dict], tools: list[dict] | None) -> tuple[_Branch, list[int]]:
        """The branch this call extends (claimed) and its full prompt ids; a new branch if none."""
        t0 = time.perf_counter()
        try:
            prompt = await self._render(messages, tools, True)
            for br in reversed(self._branches):
                n = len(br.messages)
                if br.busy or not br.sampled or br.tools != tools or len(messages) <= n or messages[:n] != br.messages:
                    continue
                forced = bridge(await self._render(br.messages, tools, False), prompt, br.sampled)
                if forced is not None:
                    assert br.seq is not None
                    br.busy = True
                    return br, br.seq.token_ids + forced
            br = _Branch(None, [], tools, [])
            self._branches.append(br)
            return br, prompt
        finally:
            self.tokenize_s += time.perf_counter() - t0

    async def _render(self, messages: list[dict], tools: list[dict] | None, gen: bool) -> list[int]:
        try:
            return await self.client.tokenize(messages=messages, tools=tools, add_generation_prompt=gen)
        except EpisodeFailure as e:  # a remote /tokenize that failed
            raise self._endpoint_failed(e) from None
        except Exception as e:  # rendered here: the request is what the template refused (raise_exception,
            # a message it cannot render safely, a field it cannot read), not the endpoint
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise Refused(400, f"cannot render these messages with the model's chat template: {why}"[:1000]) from None

    @contextlib.asynccontextmanager
    async def _budget(self, max_tokens: int | None, stop: list[str] | None, prompt_len: int) -> AsyncIterator[SamplingParams]:
        """This call's sampling settings, its ``max_tokens`` held against ``max_total_tokens`` until
        it is recorded: calls sampling at once each see the others' claims (without, ``max_calls``
        concurrent calls each got the whole budget).  A call that finds the budget claimed, not
        spent, waits for the claims to come back before it is refused."""
        if self.max_total_tokens is not None:
            async with self._released:
                await self._released.wait_for(
                    lambda: self._reserved == 0 or self.sampled_total + self._reserved < self.max_total_tokens)
        sampling = self._sampling(max_tokens, stop, prompt_len)  # no await between the check and the claim
        self._reserved += sampling.max_tokens
        try:
            yield sampling
        finally:
            self._reserved -= sampling.max_tokens
            async with self._released:
                self._released.notify_all()

    def _sampling(self, max_tokens: int | None, stop: list[str] | None, prompt_len: int) -> SamplingParams:
        budget = self.sampling.max_tokens if max_tokens is None else min(max_tokens, self.sampling.max_tokens)
        if self.max_total_tokens is not None:
            budget = min(budget, self.max_total_tokens - self.sampled_total - self._reserved)
        if self.max_seq_len is not None:
            budget = min(budget, self.max_seq_len - prompt_len)
        if budget <= 0:
            raise Refused(400, "this episode's token budget is spent (max_total_tokens / max_seq_len)",
                          "context_length_exceeded")  # fmt: skip
        stops = list(self.sampling.stop or []) + list(stop or [])
        return dataclasses.replace(self.sampling, max_tokens=budget, stop=stops or None)

    async def _sample(self, prompt: list[int], sampling: SamplingParams) -> Completion:
        try:
            completions = await self.client.complete(prompt, sampling)
        except ContextLengthExceeded as e:
            raise Refused(400, str(e), "context_length_exceeded") from None
        except Exception as e:
            raise self._endpoint_failed(e) from None
        if not completions:
            raise Refused(502, "the inference endpoint returned no choices", "server_error")
        return completions[0]

    def _record(
        self, br: _Branch, messages: list[dict], tools: list[dict] | None, prompt: list[int], c: Completion,
        latency: float, parse_tools: bool, joinable: bool,
    ) -> tuple[dict[str, Any], str, dict[str, int]]:
        ids, versions = list(c.token_ids or []), list(c.versions or [])
        if br.seq is None:
            self.template_breaks += bool(self.sequences)  # every sequence after the first
            br.seq = TokenSequence()
            self.sequences.append(br.seq)
        br.seq.extend_forced(prompt[len(br.seq) :])
        br.seq.extend_sampled(ids, list(c.logprobs), versions, list(c.support or []))
        self.sampled_total += len(ids)
        self.generation_s += latency
        self.turns.append(Turn(len(prompt), ids, c.text, c.finish_reason, versions, latency, len(ids)))
        reply, finish = self._reply(c.text or "", c.finish_reason, parse_tools)
        br.messages, br.tools = [*messages, reply], tools
        br.sampled = ids if joinable else []  # a cut-off turn has no end-of-turn token either
        self.transcript = br.messages
        return reply, finish, {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                               "total_tokens": len(prompt) + len(ids)}  # fmt: skip

    def _endpoint_failed(self, e: Exception) -> Refused:
        """Remember the first endpoint failure (the episode's cause if the program then fails);
        the program gets a 502.  An exception that names no boundary is the endpoint's."""
        if not isinstance(e, EpisodeFailure):
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            e = EndpointError(f"{type(e).__name__}: {first}"[:500] if first else type(e).__name__)
        self.failure = self.failure or e
        return Refused(502, f"the inference endpoint failed: {e}", "server_error")

    def _reply(self, text: str, finish: str | None, parse_tools: bool) -> tuple[dict[str, Any], str]:
        """The assistant message the program gets (tool calls split out) and its finish reason."""
        calls: list[ToolCall] = []
        content = text
        if parse_tools:
            parsed = self.parser.parse(text)
            if parsed.tool_calls:
                content, calls = parsed.content, parsed.tool_calls
        for k, tc in enumerate(calls):  # numbered by (call, position): unique in the episode, reproducible
            tc.id = f"call_{len(self.turns)}_{k}"
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [tc.to_dict() for tc in calls]
        if finish == "length":
            return msg, "length"
        return msg, "tool_calls" if calls else "stop"

    async def _chat_untracked(
        self, messages: list[dict], tools: list[dict] | None, max_tokens: int | None, stop: list[str] | None,
        parse_tools: bool,
    ) -> tuple[dict[str, Any], str, dict[str, int]]:
        """A chat-only endpoint (evaluation with ``token_exact=False``): passed through, calls
        recorded as turns without token ids."""
        async with self._budget(max_tokens, stop, 0) as sampling:
            t0 = time.perf_counter()
            try:
                (c, *_) = await self.client.chat(messages, sampling, tools=tools if parse_tools else None)
            except Exception as e:
                raise self._endpoint_failed(e) from None
            latency = time.perf_counter() - t0
            if self.closed:
                raise Refused(410, "the episode ended while this call was sampling")
            self.sampled_total += c.completion_tokens
        self.generation_s += latency
        self.turns.append(Turn(c.prompt_tokens, [], c.text, c.finish_reason, [], latency, c.completion_tokens))
        calls = [tc if isinstance(tc, ToolCall) else ToolCall.from_dict(tc) for tc in c.tool_calls]
        msg: dict[str, Any] = {"role": "assistant", "content": c.text or ""}
        if calls:
            msg["tool_calls"] = [tc.to_dict() for tc in calls]
        self.transcript = [*messages, msg]
        finish = "length" if c.finish_reason == "length" else ("tool_calls" if calls else "stop")
        usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                 "total_tokens": c.prompt_tokens + c.completion_tokens}  # fmt: skip
        return msg, finish, usage


class Gateway:
    """One loopback HTTP server for the episodes of one process (see the module docstring).

    Started on the first :meth:`open` inside the running event loop (again if the loop
    changed); :meth:`close` stops it (idempotent).
    """

    def __init__(self, host: str = "127.0.0.1", limits: Limits = Limits()) -> None:  # noqa: B008 (frozen)
        self.host = host
        self.url = ""
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> key of ended episodes
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._limits = limits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def open(self, client: Any, sampling: SamplingParams, **limits: Any) -> Session:
        """A new episode's session (``limits``: see :class:`Session`)."""
        await self._start()
        session = Session(self, client, sampling, **limits)
        self._sessions[session.id] = session
        return session

    def _end(self, session: Session) -> None:
        self._sessions.pop(session.id, None)
        self._ended[session.id] = session.key
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._runner is not None and self._loop is loop:
            return
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        async with self._starting[1]:  # concurrent first episodes: one server, not one each (the others leaked)
            if self._runner is None or self._loop is not loop:
                await self._serve(loop)

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        # loopback names and IPs; header, body and idle deadlines; a connection cap (one door per
        # loop: connections of a loop that is gone never report their end)
        door = AiohttpDoor(limits=self._limits, flags=False)
        app = web.Application(client_max_size=MAX_BODY, middlewares=[door.middleware])
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        # an ended episode's calls still sampling are not recorded: close does not wait long for them.
        # handler_cancellation: a call whose client went away is cancelled where it waits (aiohttp's
        # default runs it on): it leaves the refusal queue, and its sampling stops unrecorded
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True,
                               lingering_time=0)  # a refused body is not read on
        await runner.setup()
        self._server = await door.listen(runner, self.host, 0)
        self._runner, self._loop = runner, loop
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        server, self._server = self._server, None
        for s in list(self._sessions.values()):
            s.close()
        if runner is not None and self._loop is asyncio.get_running_loop():
            if server is not None:
                server.close()
            await runner.cleanup()

    # ------------------------------------------------------------------ HTTP

    async def call(self, method: str, path: str, authorization: str | None, body: bytes) -> tuple[int, str, bytes]:
        """One request without the HTTP hop (the in-process agents' transport): the same routes,
        keys and answers as the server; returns (status, content type, body)."""
        parts = path.split("/", 4)  # "", "episodes", id, "v1", route
        route = (method, parts[4]) if len(parts) == 5 and parts[1] == "episodes" and parts[3] == "v1" else None
        if route == ("POST", "chat/completions"):
            if len(body) > MAX_BODY:
                return _error_body(_too_large())

            async def read() -> bytes:
                return body

            return await self._answer(parts[2], authorization, read)
        if route == ("GET", "models"):
            return self._list_models(parts[2], authorization)
        return _error_body(Refused(404, f"no route {method} {path}: the gateway serves POST .../v1/chat/completions "
                                        "and GET .../v1/models"))  # fmt: skip

    def _session(self, eid: str, authorization: str | None) -> Session:
        """The caller's session; 401 without its key (an unknown episode looks the same), 410 once ended."""
        token = bearer(authorization)
        session = self._sessions.get(eid)
        if session is not None and matches(session.key, token):
            return session
        ended = self._ended.get(eid)
        if ended is not None and matches(ended, token):
            raise Refused(410, "this episode has ended: its gateway no longer serves calls")
        raise Refused(401, "missing or wrong API key for this episode (use the OPENAI_API_KEY it was given)",
                      "invalid_api_key")  # fmt: skip

    def _list_models(self, eid: str, authorization: str | None) -> tuple[int, str, bytes]:
        try:
            session = self._session(eid, authorization)
        except Refused as e:
            return _error_body(e)
        model = {"id": str(getattr(session.client, "model", "policy")), "object": "model", "owned_by": "agentrl"}
        return 200, JSON, json.dumps({"object": "list", "data": [model]}).encode()

    async def _answer(self, eid: str, authorization: str | None, read: Any) -> tuple[int, str, bytes]:
        """A chat completion: JSON, or the finished reply as server-sent events (``stream``).  ``read()``
        gives the body, read once the call is under the limit (then it waits for one of its episode's
        slots: waiting with its body unread, a call would be cut off by the server's body deadline)."""
        session = None
        try:
            session = self._session(eid, authorization)
            await session.refuse_if_spent()  # a flood past the limit: no body of it is read
            raw = await read()
            async with session.slots:  # many calls of one episode at once wait here
                try:
                    body = json.loads(raw)
                except ValueError:
                    raise Refused(400, "the request body is not JSON") from None
                message, finish, usage = await session.chat(body)
        except Exception as e:  # a bug here must reach the program as an error, not a hang
            refusal = e if isinstance(e, Refused) else Refused(
                500, f"the gateway failed: {type(e).__name__}: {e}"[:500], "server_error")  # fmt: skip
            if session is not None:
                session.refused(refusal)
            return _error_body(refusal)
        cid, model, created = "chatcmpl-" + new_id(), str(body.get("model") or "policy"), int(time.time())
        if not body.get("stream"):
            return 200, JSON, json.dumps({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage,
            }).encode()  # fmt: skip
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [b"data: " + json.dumps({**head, **c}).encode() + b"\n\n" for c in _chunks(message, finish, usage, with_usage)]
        return 200, EVENTS, b"".join(events) + b"data: [DONE]\n\n"

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return _response(self._list_models(request.match_info["episode"], request.headers.get("Authorization")))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        eid, authorization = request.match_info["episode"], request.headers.get("Authorization")
        try:  # the key before the body: a caller without one must not make the gateway buffer MAX_BODY
            self._session(eid, authorization)
            if (request.content_length or 0) > MAX_BODY:
                raise _too_large()
        except Refused as e:
            refused = _response(_error_body(e))
            refused.force_close()  # its body unread: the connection goes with the answer
            return refused
        read = [False]

        async def body() -> bytes:
            read[0] = True
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:  # a chunked body past MAX_BODY: the caller's, not a gateway bug
                raise _too_large() from None

        status, content_type, data = await self._answer(eid, authorization, body)
        answer = _response((status, content_type, data))
        if not read[0] or status == 413:
            answer.force_close()  # refused with its body unread: the connection goes with the answer
        return answer


def _too_large() -> Refused:
    return Refused(413, f"the request body is over {MAX_BODY} bytes")


def _response(answer: tuple[int, str, bytes]) -> web.Response:
    status, content_type, body = answer
    headers = {"Cache-Control": "no-cache"} if content_type == EVENTS else None
    return web.Response(status=status, body=body, content_type=content_type, headers=headers)


def _chunks(message: dict[str, Any], finish: str, usage: dict[str, int], with_usage: bool) -> Iterator[dict[str, Any]]:
    """A finished reply as stream chunks: role, content, one chunk per tool call, finish (usage)."""

    def delta(d: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": d, "finish_reason": finish_reason, "logprobs": None}]}

    yield delta({"role": "assistant", "content": ""})
    if message.get("content"):
        yield delta({"content": message["content"]})
    for k, tc in enumerate(message.get("tool_calls") or []):
        yield delta({"tool_calls": [{"index": k, **tc}]})
    yield delta({}, finish)
    if with_usage:
        yield {"choices": [], "usage": usage}


def _error_body(e: Refused) -> tuple[int, str, bytes]:
    return e.status, JSON, json.dumps({"error": {"message": str(e), "type": e.code, "code": e.code}}).encode()


__all__ = ["Gateway", "Refused", "Session"]
