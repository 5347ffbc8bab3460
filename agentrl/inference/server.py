"""OpenAI-compatible HTTP server (FastAPI) around :class:`agentrl.inference.engine.Engine`.

Routes (vLLM names and fields where vLLM has them):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI schema (messages, tools,
  n, max_tokens, temperature, top_p, stop, seed, logprobs/top_logprobs) plus vLLM extras
  ``top_k``, ``min_p``, ``return_token_ids`` (→ ``prompt_token_ids`` and per-choice
  ``token_ids``), ``stop_token_ids``, ``ignore_eos``, ``return_tokens_as_token_ids``,
  token-id prompts on ``/v1/completions``; every choice carries ``token_versions`` (weight
  version per token) and ``token_support`` (the size of the kept set each token was drawn
  from: :mod:`agentrl.inference.sampling`).  ``stream: true``: :mod:`agentrl.inference.streaming`.
  With ``tools``, the chat route splits tool calls out of the text with the model's tool-call
  parser (``--tool-call-parser``, vLLM's names; default: detected from the chat template,
  :mod:`agentrl.tool_format`).
- ``POST /tokenize`` (``prompt`` or ``messages`` + ``tools``), ``POST /detokenize``.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (JSON).
- ``POST /reset_prefix_cache`` (the prefix cache is also cleared by every weight update).
- weights (:mod:`agentrl.inference.weight_routes`): ``POST /pause`` (mode=keep), ``POST /resume``, ``GET /is_paused``,
  ``GET /get_weight_version``, ``POST /update_weight_version``, ``POST /update_weights_from_disk``
  (inside the engine's weights dir only), and a push over shared memory, disk or HTTP chunks:
  ``POST /weights/begin``, ``PUT /weights/chunk``, ``POST /weights/commit``, ``POST /weights/abort``
  (signed with the engine's key; the rules: :mod:`agentrl.weights.receive`).

Prompt size, render deadline and template kwargs: :mod:`agentrl.inference.bounds`.
Keys, Host/Origin checks, body cap and connection deadlines (:mod:`agentrl.guard`): ``/health``
is open; the OpenAI routes (``/v1/*``, ``/tokenize``, ``/detokenize``) need the key when it
was given (``--api-key`` or ``AGENTRL_API_KEY``); every other route always needs it (a server
given none makes one and writes it 0600 to ``--key-file``).

Request schemas and error bodies: :mod:`agentrl.inference.protocol`.  Well-formed generation
requests reach their handler past FastAPI's router (:class:`GenerationFastPath`; the server
thread's CPU per training step measured 26 % lower); every other request, and every malformed
one, takes the FastAPI route.

``--server-process split`` (``inference.server_process``): the engine runs in an engine-core
process of its own and these routes reach it through :class:`~agentrl.inference.core.CoreClient`
(:mod:`agentrl.inference.core`); a core that dies makes every route a 503 and the server exit 1.

The process around these routes (the engine's start, same or split, the port, the key, uvicorn and
the command line): :mod:`agentrl.inference.server_process`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.auth import ServerKey
from agentrl.errors import RequestError
from agentrl.guard import Guard, Limits, Receive, read_body, replay_body
from agentrl.inference import streaming
from agentrl.inference.bounds import RequestBounds
from agentrl.inference.core import CoreClient
from agentrl.inference.engine import Engine, SequenceResult
from agentrl.inference.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingBody,
    TokenizeRequest,
    error_response,
    from_request_error,
)
from agentrl.inference.sampling import EngineSampling
from agentrl.inference.weight_routes import weight_routes
from agentrl.render import render_chat_ids
from agentrl.tool_format import resolve_tool_parser
from agentrl.types import new_id
from agentrl.weights.receive import WeightReceiver


async def _unless_disconnected(work: Any, receive: Receive) -> Any:
    """Await a generation route's work, aborting it in the engine if the client goes away.

    Uvicorn does not cancel a plain handler on disconnect, so without this a client that
    timed out (or an episode the rollout manager cancelled) would keep its engine slots
    busy until ``max_tokens``.  The body has been read, so the next ASGI message is
    ``http.disconnect``: waiting on it costs nothing while the request is alive.
    """
    job = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
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
    # the body is plain JSON types already: a Response skips FastAPI's jsonable_encoder walk
    # (~0.4 ms of the engine's GIL per completion, 10x the json.dumps it ends in)
    return JSONResponse(job.result())


def _json_typed(headers: list[tuple[bytes, bytes]]) -> bool:
    """``Content-Type: application/json`` (parameters allowed).  A request without one is left to
    FastAPI, which reads it as JSON or not depending on its version (``strict_content_type``)."""
    for name, value in headers:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _answer(server: EngineServer, name: str, req: ChatRequest | CompletionRequest, receive: Receive) -> Any:
    """A generation route's response: ``name`` is ``chat`` or ``completions``; a stream from its
    stream handler, else the whole answer (its engine work cancelled if the client leaves)."""
    if req.stream:
        return await getattr(server, f"{name}_stream")(req)
    return await _unless_disconnected(getattr(server, name)(req), receive)


class GenerationFastPath:
    """ASGI middleware: well-formed ``POST /v1/completions`` and ``/v1/chat/completions``
    straight to their handlers, past FastAPI's routing and dependency solving (in a profile
    of a training run, half of the server thread's busy time, on the engine process's GIL).

    It answers only what it is sure of: an ``application/json`` body that parses and validates
    against the route's schema (``model_validate`` on ``json.loads``: what FastAPI runs).
    Anything else (another route or method, another content type, malformed JSON, a schema
    error) goes on to the FastAPI app with the body replayed, so those errors keep one wording.
    An exception from a handler is answered by the app's own exception handler for it, as the
    route would be.  It sits inside :class:`~agentrl.guard.Guard`: every door check has run
    before it (``create_app`` adds it first)."""

    ROUTES = {"/v1/completions": (CompletionRequest, "completions"), "/v1/chat/completions": (ChatRequest, "chat")}

    def __init__(self, app: Any, server: EngineServer, handlers: dict[Any, Any]) -> None:
        """``handlers``: the FastAPI app's ``exception_handlers`` (the dict itself: handlers
        registered after this is built are seen too)."""
        self.app, self.server, self.handlers = app, server, handlers

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        route = self.ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _json_typed(scope["headers"]):
            return await self.app(scope, receive, send)
        body = await read_body(receive)  # the Guard has capped its size
        if body is None:
            return  # the client left before its body was in: nobody to answer
        schema, name = route
        try:
            req = schema.model_validate(json.loads(body))
        except Exception:  # not JSON, not UTF-8, nested past the recursion limit, off the schema: FastAPI words it
            return await self.app(scope, replay_body(body, receive), send)
        try:
            response = await _answer(self.server, name, req, receive)
        except Exception as e:
            handler = next((self.handlers[c] for c in type(e).__mro__ if c in self.handlers), None)
            if handler is None:
                raise  # as from the route: the server's 500
            response = handler(Request(scope, receive), e)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)


class EngineServer:
    """Request handling shared by the routes (tokenization, sampling, response shapes)."""

    def __init__(self, engine: Engine | CoreClient, served_model_name: str, tool_parser: str | None = None):
        self.engine = engine
        self.name = served_model_name
        self.tok = engine.tokenizer
        # how the chat route splits tool calls out of the text: named, else detected from the template
        self.tool_parser = resolve_tool_parser(tool_parser, getattr(self.tok, "chat_template", None))
        self.weights: WeightReceiver | None = None  # set by weight_routes
        self.started = time.time()
        self.bounds = RequestBounds(self.tok, engine.max_model_len)  # sizes, render deadline, template kwargs

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

    async def off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a render or tokenization on the render threads, within the render deadline."""
        return await self.bounds.off_loop(fn, *args, **kwargs)

    async def render_chat(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        if not getattr(self.tok, "chat_template", None):  # the server's setup, not the caller's messages
            raise APIError(400, f"the served model {self.name!r} has no chat template, so this server renders no chat "
                                "messages: send a prompt to /v1/completions, or serve a model whose tokenizer has a "
                                "chat template", code="no_chat_template")  # fmt: skip
        kwargs = dict(req.chat_template_kwargs or {})
        self.bounds.check_template_kwargs(kwargs)
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        self.bounds.check_messages(messages)
        gen = req.add_generation_prompt and not req.continue_final_message
        try:
            return await self.off_loop(
                render_chat_ids, self.tok, messages, req.tools, gen, continue_final_message=req.continue_final_message,
                **kwargs,
            )  # fmt: skip
        except APIError:
            raise
        except Exception as e:  # template errors are the caller's malformed input
            raise APIError(400, f"could not apply the chat template to these messages: {e}", param="messages") from e

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A text prompt's ids: its length checked first, tokenized off the loop."""
        self.bounds.check_bytes(len(text.encode("utf-8", "surrogatepass")), "prompt")
        return await self.off_loop(self.tok.encode, text, add_special_tokens=add_special_tokens)

    def sampling(self, req: SamplingBody, top_logprobs: int) -> EngineSampling:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        max_tokens = req.max_completion_tokens or req.max_tokens or self.engine.max_model_len
        return EngineSampling(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else -1,
            min_p=req.min_p,
            seed=req.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            top_logprobs=top_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )

    async def generate(self, prompt_ids: list[int], sampling: EngineSampling, n: int) -> list[SequenceResult]:
        try:
            fut = self.engine.submit(prompt_ids, sampling, n)
        except RequestError as e:
            raise from_request_error(e) from e
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
        prompt_ids = await self.render_chat(req)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        results = await self.generate(prompt_ids, self.sampling(req, k), req.n)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        choices = []
        for i, r in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = r.finish_reason
            if parse_tools:
                parsed = self.tool_parser.parse(r.text)
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
                "token_support": r.support,
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

    async def chat_stream(self, req: ChatRequest) -> StreamingResponse:
        return await streaming.chat_stream(self, req)

    async def completions_stream(self, req: CompletionRequest) -> StreamingResponse:
        return await streaming.completions_stream(self, req)

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

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported by the embedded engine", param="echo")
        prompts = await self.prompts(req.prompt)
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
                    "token_support": r.support,
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

    async def prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [await self.encode(prompt)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        out = []
        for p in prompt:
            out.extend(await self.prompts(p))
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


def is_openai_route(path: str) -> bool:
    """The routes an explicit key guards (every other one but ``/health`` always needs a key)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def create_app(
    engine: Engine | CoreClient,
    served_model_name: str | None = None,
    tool_parser: str | None = None,
    *,
    key: ServerKey | None = None,
    allowed_hosts: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
    limits: Limits | None = None,
    weights_dir: str | Path | None = None,
    shm_dir: str | Path | None = None,
) -> FastAPI:
    """The FastAPI app; the engine's lifetime is the caller's.  ``tool_parser``: the chat
    route's tool-call format (:mod:`agentrl.tool_format`; None or ``auto``: from the template).
    ``key`` (None: no key checks, and every weight push refused: pushes are signed with it),
    ``allowed_hosts``, ``allowed_origins``, ``limits``: :mod:`agentrl.guard`; ``weights_dir``: where disk
    pushes land (default: a private dir)."""
    srv = EngineServer(engine, served_model_name or engine.model_dir.name, tool_parser)
    # no /docs, /redoc or /openapi.json: nothing a client needs, and fewer routes to walk per request
    app = FastAPI(title="agentrl embedded engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(GenerationFastPath, server=srv, handlers=app.exception_handlers)  # added first: inside the Guard
    app.add_middleware(Guard, key=key, public=is_openai_route, allowed_hosts=allowed_hosts,
                       allowed_origins=allowed_origins, limits=limits or Limits())

    @app.exception_handler(APIError)
    async def _apierror_response(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validationerror_response(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in e.errors()[:5])
        return error_response(400, msg or "invalid request", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _httperror_response(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), type_="NotFoundError" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(ValidationError)
    async def _pyderror_response(_: Request, e: ValidationError):
        return error_response(400, str(e).splitlines()[0])

    _generation_routes(app, srv)
    _token_routes(app, srv)
    _info_routes(app, srv)
    weight_routes(app, srv, key.value if key is not None else None, weights_dir, shm_dir)
    return app


def _generation_routes(app: FastAPI, srv: EngineServer) -> None:
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, http: Request):
        return await _answer(srv, "chat", req, http.receive)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await _answer(srv, "completions", req, http.receive)


def _token_routes(app: FastAPI, srv: EngineServer) -> None:
    engine = srv.engine

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        srv.check_model(req.model)
        if req.messages is not None:
            ids = await srv.render_chat(req)
        elif req.prompt is not None:
            ids = await srv.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either `prompt` or `messages`", param="prompt")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = srv.tok.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        srv.check_model(req.model)
        vocab = engine.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": srv.tok.decode(req.tokens)}


def _info_routes(app: FastAPI, srv: EngineServer) -> None:
    engine = srv.engine

    @app.get("/v1/models")
    async def models():
        card = {
            "id": srv.name,
            "object": "model",
            "created": int(srv.started),
            "owned_by": "agentrl",
            "root": srv.name,  # never the model's path on this host
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        failure = getattr(engine, "failure", None)  # a split engine whose core died
        if failure is not None:
            raise APIError(503, failure, type_="ServiceUnavailableError", code="engine_core_died")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return await asyncio.to_thread(engine.stats)  # a round trip to a split engine's core


if __name__ == "__main__":  # the launcher's command; the process itself: agentrl.inference.server_process
    from agentrl.inference.server_process import main

    main()
