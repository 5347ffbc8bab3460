"""The multi-turn token loop: one episode of any environment against a policy client.

Every environment shape (single-turn, multi-turn, tool, sandbox, gym), the checker,
held-out evaluation, ``agentrl eval`` and the RL rollout run episodes through
:func:`run_episode`.  The environment (``agentrl.envs.base``) only supplies hooks:
``setup``, ``step``, ``done``, ``cleanup``, ``parse_assistant`` and ``tool_schemas``.

Token exactness: the first prompt is rendered once with the chat template.  Each model turn
appends exactly the token ids the engine sampled, with their behaviour logprobs μ and
versions.  The env's reply is appended as forced tokens taken as the *suffix* of the
template rendered with and without the new messages; sampled text is never re-tokenized.
If the template is not prefix-stable (rendering more messages changes earlier tokens), or
the sampled turn did not end with the template's end-of-turn token, a new
:class:`~agentrl.types.TokenSequence` starts from a fresh rendering and
``metrics["template_breaks"]`` counts it.

Program-driven envs (``HarnessEnv``: an env with ``run_program`` and a ``gateway``) turn the
loop around: an agent program calls the model through an episode-scoped OpenAI-compatible
gateway session (:mod:`agentrl.gateway`), which records every call token-exactly with the
same bridge rule; the program's final answer becomes ``state["result"]``.

Fates of an episode (the one timeout story, README "Fates, error kinds and exit codes"):

- the env says done → ``stop_reason = "done"``; ``max_turns`` reached → ``"max_turns"``;
  the token budget of the env ran out → ``"max_tokens"`` / ``"prompt_too_long"``: all
  trained;
- a turn cut off by ``sampling.max_tokens`` (``finish_reason == "length"``): the env's
  ``on_length`` decides: ``"end"`` (default) ends the episode with ``stop_reason =
  "length"``; ``"continue"`` hands the cut-off turn to ``step`` like any other and the next
  prompt starts a new sequence (no end-of-turn token to extend from; counted in
  ``metrics["length_continues"]``);
- a failure becomes ``error`` + ``error_kind`` on the trajectory (never raised): ``endpoint``
  (the server failed after the client's retries), ``parse`` (the server's reply was
  malformed), ``context_length`` (the first prompt does not fit; later turns that do not fit
  end the episode as ``prompt_too_long``), ``env`` (a hook raised), ``tool`` (a tool raised
  :class:`~agentrl.errors.EpisodeError`), ``sandbox`` (the sandbox itself failed),
  ``timeout`` (the episode's wall limit), ``rubric`` (set later, by scoring).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, Any, Protocol, get_args

from agentrl.errors import (
    ContextLengthExceeded,
    EndpointError,
    EpisodeError,
    EpisodeFailure,
    MalformedResponse,
    error_kind_of,
)
from agentrl.render import MAX_GLUE_TOKENS, bridge
from agentrl.tool_format import DEFAULT_PARSER, get_parser, is_mistral_id
from agentrl.types import (
    Completion,
    Message,
    Role,
    SamplingParams,
    Task,
    TokenSequence,
    ToolCall,
    Trajectory,
    Turn,
    messages_to_dicts,
)

if TYPE_CHECKING:
    from agentrl.envs.base import Environment, State


class PolicyClientLike(Protocol):
    """The part of :class:`agentrl.inference.client.PolicyClient` an episode uses (and, if it
    has one, its ``tool_parser`` attribute: the model's tool-call format)."""

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]: ...

    async def chat(
        self, messages: list[dict], sampling: SamplingParams, tools: list[dict] | None = None, n: int = 1
    ) -> list[Completion]: ...

    async def tokenize(
        self,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        prompt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...


async def _endpoint(call: Any) -> Any:
    """Await a policy-client call; an exception that names no boundary is the endpoint's."""
    try:
        return await call
    except Exception as e:
        if getattr(type(e), "error_kind", None) is None:
            raise EndpointError(error_text(e)) from e
        raise


ROLES: tuple[str, ...] = get_args(Role)


def env_messages(value: Any, where: str) -> list[Message]:
    """What an env hook (``where``, e.g. ``MyEnv.step()``) gave as messages: a list of
    :class:`Message`, or of OpenAI-style dicts (converted); anything else is the env's error,
    named here, rather than an ``AttributeError`` from whoever reads it later."""
    if isinstance(value, (str, bytes, dict, Message)) or not hasattr(value, "__iter__"):
        raise EpisodeError(f"{where} must return a list of Message; it returned {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict):
            role, content = m.get("role"), m.get("content")
            if role not in ROLES or not (content is None or isinstance(content, str)):
                raise EpisodeError(
                    f"{where} returned a dict at [{i}] that is not a chat message (role one of {', '.join(ROLES)}, "
                    f"content a string): {str(m)[:120]}; return Message(role=..., content=...)"
                )
            try:
                m = Message.from_dict(m)
            except (KeyError, TypeError, AttributeError) as e:
                raise EpisodeError(f"{where} returned a malformed message at [{i}]: {error_text(e)}") from e
        elif not isinstance(m, Message):
            raise EpisodeError(f"{where} returned {type(m).__name__} at [{i}]; it must return a list of Message")
        if m.role not in ROLES or not isinstance(m.content, str):
            raise EpisodeError(
                f"{where} returned a Message at [{i}] with role {m.role!r} and content of type "
                f"{type(m.content).__name__}; role must be one of {', '.join(ROLES)} and content a string"
            )
        out.append(m)
    return out


def error_text(e: BaseException) -> str:
    """One line naming the exception: ``Type: first line of the message`` (≤ 500 chars)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:500] if msg else type(e).__name__


async def run_episode(
    env: Environment,
    client: PolicyClientLike,
    task: Task,
    sampling: SamplingParams | None = None,
    *,
    max_turns: int | None = None,
    timeout_s: float | None = None,
    token_exact: bool = True,
    tool_parser: str | None = None,
) -> Trajectory:
    """Run one episode; never raises except on cancellation (see the module docstring).

    ``timeout_s`` (default: the env's ``timeout_s``) is the episode's wall limit.
    ``token_exact=False`` talks to a plain chat endpoint (``client.chat``): for evaluating
    models behind APIs without token ids; no token sequences are recorded.
    ``tool_parser`` (default: the client's ``tool_parser``, else ``hermes``) names the
    model's tool-call format (:mod:`agentrl.tool_format`); the episode puts it in
    ``state["tool_parser"]`` (unless ``setup`` chose one) for ``parse_assistant``.
    """
    parser = tool_parser or getattr(client, "tool_parser", None)
    episode = _Episode(env, client, task, sampling or SamplingParams(), max_turns or env.max_turns, token_exact)
    episode.tool_parser = get_parser(parser).name if parser is not None else DEFAULT_PARSER
    limit = timeout_s if timeout_s is not None else env.timeout_s
    await episode.run(limit)
    return episode.traj


class _Episode:
    """The state of one running episode; :meth:`run` drives it (module docstring)."""

    def __init__(
        self, env: Environment, client: PolicyClientLike, task: Task, sampling: SamplingParams, max_turns: int,
        token_exact: bool,
    ) -> None:
        self.env, self.client, self.sampling = env, client, sampling
        self.max_turns, self.token_exact = max_turns, token_exact
        self.tools = env.tool_schemas() or None
        self.traj = Trajectory(task=task, messages=list(task.prompt), env_name=env.name, env_version=str(env.version))
        self.traj.timing = {"setup_s": 0.0, "generation_s": 0.0, "env_s": 0.0, "tokenize_s": 0.0}
        self.state: State | None = None
        self.seq: TokenSequence | None = None
        self.sampled_total = 0
        self._latency = 0.0
        self._deadline: float | None = None  # loop time the wall limit ends
        self.tool_parser = DEFAULT_PARSER

    async def run(self, limit: float | None) -> None:
        traj, start = self.traj, time.perf_counter()
        wall = asyncio.timeout(limit)
        try:
            async with wall:
                self._deadline = wall.when()
                t0 = time.perf_counter()
                state = await self.env.setup(traj.task)
                if not isinstance(getattr(state, "messages", None), list):  # a State is a dict with .messages
                    setup = f"{type(self.env).__name__}.setup()"
                    raise EpisodeError(f"{setup} must return a State (State(task)); it returned {type(state).__name__}")
                self.state = state
                state.messages[:] = env_messages(state.messages, f"{type(self.env).__name__}.setup()'s state.messages")
                traj.timing["setup_s"] = time.perf_counter() - t0
                traj.messages = self.state.messages
                self.state.setdefault("tool_parser", self.tool_parser)
                program = getattr(self.env, "run_program", None)
                traj.stop_reason = await (self._program(program) if program is not None else self._turns())
        except TimeoutError as e:
            if wall.expired():
                self._fail("timeout", f"episode exceeded its wall limit of {limit:g}s")
            else:  # raised by env code, not by the wall limit
                self._fail(error_kind_of(e), error_text(e))
        except asyncio.CancelledError:
            self._fail("cancelled", "cancelled")
            raise
        except Exception as e:  # a bad episode is data, not a crash
            self._fail(error_kind_of(e), error_text(e))
        finally:
            await self._cleanup()
            traj.timing["total_s"] = time.perf_counter() - start
            traj.metrics["turns"] = float(len(traj.turns))
            traj.metrics.setdefault("template_breaks", 0.0)

    def _fail(self, kind: str, message: str) -> None:
        self.traj.stop_reason, self.traj.error, self.traj.error_kind = "error", message, kind

    async def _cleanup(self) -> None:
        state, traj = self.state, self.traj
        if state is None:
            return
        try:
            # shielded: a cancelled episode still closes what it opened (a remote env's episode, a
            # sandbox); the cleanup then outlives the episode, so whoever closes the env settles it first
            await asyncio.shield(outlive(self.env.cleanup(state)))
        except Exception as e:
            if traj.error is None:
                self._fail("env", f"cleanup failed: {error_text(e)}")
        traj.metrics.update(state.metrics)
        traj.state = state  # transient (not serialized): rubric functions may ask for it

    # ------------------------------------------------------------------ a program's calls

    async def _program(self, program: Any) -> str:
        """A program-driven env (``HarnessEnv``): the program calls the model through an
        episode-scoped gateway session (:mod:`agentrl.gateway`); its calls become the episode's
        turns and sequences, its final answer ``state["result"]``."""
        env, state, traj = self.env, self.state, self.traj
        assert state is not None
        session = await env.gateway.open(
            self.client, self.sampling, tool_parser=self.tool_parser, max_calls=self.max_turns,
            max_total_tokens=env.max_total_tokens, max_seq_len=env.max_seq_len, token_exact=self.token_exact,
        )  # fmt: skip
        session.deadline = self._deadline  # the program's own limit ends before it, so its env names why
        try:
            state["result"] = await program(state, session)
        except EpisodeFailure:
            if session.failure is not None:  # the program failed because the endpoint did: say so
                raise session.failure from None
            raise
        finally:
            session.close()
            traj.sequences, traj.turns = session.sequences, session.turns
            state.turn = len(session.turns)
            traj.timing["generation_s"] += session.generation_s
            traj.timing["tokenize_s"] += session.tokenize_s
            traj.metrics["template_breaks"] = float(session.template_breaks)
            if session.transcript:
                state.messages[:] = [Message.from_dict(m) for m in session.transcript]
        return "max_turns" if session.hit_limit else "done"

    # ------------------------------------------------------------------ the turns

    async def _turns(self) -> str:
        """Model turn, env reply, env tokens, until a stop reason."""
        state, traj = self.state, self.traj
        assert state is not None
        if state.done:  # setup ended it (an OpenEnv reset that answered done): a turn would act on a finished game
            raise EpisodeError(f"{type(self.env).__name__}.setup() set state.done: the episode ended before the model's "
                               "first turn, so there is nothing to sample or train on; fix the task or the env's reset")
        if self.token_exact:
            await self._new_sequence()
        while True:
            if state.turn >= self.max_turns:
                return "max_turns"
            budget = self._budget()
            if isinstance(budget, str):
                return budget
            turn_sampling, cut_reason = budget
            completion = await self._sample(turn_sampling)
            if completion is None:
                return "prompt_too_long"
            ids = self._record(completion)
            assistant = self._assistant_message(completion)
            state.messages.append(assistant)
            cut = completion.finish_reason == "length"
            if cut and (cut_reason != "length" or self.env.on_length == "end"):
                return cut_reason  # a cut-off turn has no end-of-turn token to continue from

            t0 = time.perf_counter()
            reply = env_messages(await self.env.step(state, assistant), f"{type(self.env).__name__}.step()")
            traj.timing["env_s"] += time.perf_counter() - t0
            before = list(state.messages)
            state.messages.extend(reply)
            if self.env.done(state):
                return "done"
            if state.turn >= self.max_turns:
                return "max_turns"
            if self.token_exact:
                if cut:
                    traj.metrics["length_continues"] = traj.metrics.get("length_continues", 0.0) + 1
                    await self._new_sequence()
                else:
                    await self._extend(before, reply, ids)

    def _budget(self) -> tuple[SamplingParams, str] | str:
        """This turn's sampling (its token budget) and which limit a cut-off means; or the stop reason."""
        env, sampling = self.env, self.sampling
        budget, cut_reason = sampling.max_tokens, "length"
        if env.max_total_tokens is not None and env.max_total_tokens - self.sampled_total <= budget:
            budget, cut_reason = env.max_total_tokens - self.sampled_total, "max_tokens"
            if budget <= 0:
                return "max_tokens"
        seq_len = len(self.seq) if self.seq is not None else 0
        if env.max_seq_len is not None and env.max_seq_len - seq_len <= budget:
            budget, cut_reason = env.max_seq_len - seq_len, "prompt_too_long"
            if budget <= 0:
                return "prompt_too_long"
        if budget == sampling.max_tokens:
            return sampling, cut_reason
        return dataclasses.replace(sampling, max_tokens=budget), cut_reason

    async def _sample(self, sampling: SamplingParams) -> Completion | None:
        """One model call; None when the prompt no longer fits the context (after turn 1)."""
        state, t0 = self.state, time.perf_counter()
        assert state is not None
        try:
            if self.token_exact:
                assert self.seq is not None
                completions = await _endpoint(self.client.complete(self.seq.token_ids, sampling))
            else:
                call = self.client.chat(messages_to_dicts(state.messages), sampling, tools=self.tools)
                completions = await _endpoint(call)
        except ContextLengthExceeded:
            if state.turn == 0:
                raise  # nothing was sampled: the task itself does not fit (error kind context_length)
            return None
        if not completions:
            raise MalformedResponse("the endpoint returned no choices")
        self.traj.timing["generation_s"] += time.perf_counter() - t0
        self._latency = time.perf_counter() - t0
        return completions[0]

    def _record(self, c: Completion) -> list[int]:
        """Append the sampled tokens (μ, versions) and the turn record; returns the ids."""
        ids, versions = list(c.token_ids or []), list(c.versions or [])
        if self.token_exact:
            assert self.seq is not None
            self.seq.extend_sampled(ids, list(c.logprobs), versions, list(c.support or []))
            prompt_len = len(self.seq) - len(ids)
        else:
            prompt_len = c.prompt_tokens or len(c.prompt_token_ids or [])
        self.sampled_total += len(ids) or c.completion_tokens
        self.traj.turns.append(
            Turn(prompt_len, ids, c.text, c.finish_reason, versions, self._latency, len(ids) or c.completion_tokens)
        )
        assert self.state is not None
        self.state.turn += 1
        return ids

    def _assistant_message(self, c: Completion) -> Message:
        assert self.state is not None
        if c.tool_calls and not self.token_exact:  # a chat endpoint already split out the tool calls
            calls = [tc if isinstance(tc, ToolCall) else ToolCall.from_dict(tc) for tc in c.tool_calls]
            msg = Message("assistant", c.text or "", tool_calls=calls)
            written = {tc.id for tc in calls if is_mistral_id(tc.id)}  # the model's own ids come back as it wrote them
        else:
            msg = self.env.parse_assistant(c.text or "", self.state)
            written = {tc.id for tc in msg.tool_calls if tc.id and tc.id in (c.text or "")}
        # ids the model did not write are numbered (turn, position), not drawn at random: the
        # same seed gives the same transcript, ids included (a Mistral-shaped id keeps its shape)
        for k, tc in enumerate(msg.tool_calls):
            if tc.id not in written:
                numbered = f"call_{self.state.turn}_{k}"
                tc.id = hashlib.sha256(numbered.encode()).hexdigest()[:9] if is_mistral_id(tc.id) else numbered
        return msg

    # ------------------------------------------------------------------ env tokens

    async def _render(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return await _endpoint(
            self.client.tokenize(
                messages=messages_to_dicts(messages), tools=self.tools, add_generation_prompt=add_generation_prompt
            )
        )

    async def _new_sequence(self) -> None:
        """Start a sample from a fresh rendering of the whole conversation."""
        assert self.state is not None
        t0 = time.perf_counter()
        self.seq = TokenSequence()
        self.seq.extend_forced(await self._render(self.state.messages))
        self.traj.sequences.append(self.seq)
        self.traj.timing["tokenize_s"] += time.perf_counter() - t0

    async def _extend(self, before: list[Message], reply: list[Message], sampled: list[int]) -> None:
        """Append the env's reply as forced tokens, or start a new sequence at a template break."""
        t0 = time.perf_counter()
        forced = await self._bridge(before, reply, sampled)
        self.traj.timing["tokenize_s"] += time.perf_counter() - t0
        if forced is None:
            self.traj.metrics["template_breaks"] = self.traj.metrics.get("template_breaks", 0.0) + 1
            await self._new_sequence()
        else:
            assert self.seq is not None
            self.seq.extend_forced(forced)

    async def _bridge(self, before: list[Message], reply: list[Message], sampled: list[int]) -> list[int] | None:
        """Forced tokens that continue the sampled turn with ``reply`` and the next generation
        prompt; None when that cannot be done token-exactly (a template break)."""
        if not sampled:
            return None
        closed = await self._render(before, add_generation_prompt=False)
        return bridge(closed, await self._render(before + reply), sampled)


_outliving: set[asyncio.Future] = set()  # env cleanups still running (their episode may be cancelled)


def outlive(aw: Any) -> asyncio.Future:
    """Run ``aw`` as a task that :func:`settle_cleanups` waits for: work an episode's env must
    finish even when the episode is cancelled (closing what it opened)."""
    fut = asyncio.ensure_future(aw)
    _outliving.add(fut)
    fut.add_done_callback(_outliving.discard)
    return fut


async def settle_cleanups(timeout: float = 30.0) -> int:
    """Wait up to ``timeout`` s for env cleanups that outlived their cancelled episodes (in this
    event loop), so closing the env does not cut them off: a remote env's episodes would stay
    open on its server.  Returns how many were still running after the wait."""
    loop = asyncio.get_running_loop()
    pending = [f for f in _outliving if not f.done() and f.get_loop() is loop]
    if not pending:
        return 0
    _, still = await asyncio.wait(pending, timeout=timeout)
    return len(still)


__all__ = ["MAX_GLUE_TOKENS", "PolicyClientLike", "error_text", "outlive", "run_episode", "settle_cleanups"]
