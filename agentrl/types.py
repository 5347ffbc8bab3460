"""Plain data that flows between agentrl's modules.

Task → (Environment.rollout) → Trajectory → Group → (Trainer).  Everything here is a
dataclass that round-trips through JSON (``to_dict`` / ``from_dict``) so rollouts can be
written to ``rollouts.jsonl`` and read back exactly.

Token provenance: a :class:`TokenSequence` holds the exact token ids the
engine sampled (never re-tokenized from text) interleaved with env/tool tokens.  Per token:
``loss_mask`` (1 = sampled by the policy, 0 = forced prompt/env tokens), ``logprobs``
(μ, the behaviour logprob reported by the engine; 0.0 where mask is 0) and ``versions``
(the weight version that sampled the token; -1 where mask is 0).  Staleness of a token is
the trainer's version minus its version (:meth:`Group.staleness`).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


def json_default(v: Any) -> Any:
    """``json.dumps(default=...)`` for what JSON cannot hold (a set in ``task.info``, an object):
    a list, or its repr — a log line or a checkpoint never fails on user data."""
    if isinstance(v, set | frozenset):
        return sorted(v, key=repr)
    if isinstance(v, tuple):
        return list(v)
    return repr(v)


def new_id(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex[:16]}"


@dataclass
class ToolCall:
    """A function call the model asked for. ``arguments`` is the raw JSON text it wrote."""

    name: str
    arguments: str = "{}"
    id: str = field(default_factory=lambda: new_id("call_"))

    def to_dict(self) -> dict[str, Any]:
        """OpenAI wire format."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCall:
        fn = d.get("function", d)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        return cls(name=fn["name"], arguments=args, id=d.get("id") or new_id("call_"))


@dataclass
class Message:
    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI chat message (what ``chat.completions`` and chat templates take)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Message) -> Message:
        if isinstance(d, Message):
            return d
        return cls(
            role=d["role"],
            content=d.get("content") or "",
            tool_calls=[ToolCall.from_dict(t) for t in d.get("tool_calls") or []],
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
        )


def _flat_dict(obj: Any) -> dict[str, Any]:
    """A dataclass whose fields are scalars or lists of scalars (a TokenSequence, a Turn) as a
    dict, lists copied."""
    return {f.name: list(v) if isinstance(v := getattr(obj, f.name), list) else v for f in fields(obj)}


def messages_to_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    return [m.to_dict() for m in messages]


@dataclass
class SamplingParams:
    """How one model call samples (OpenAI/vLLM field names).

    The one sampling type from config to engine: the rollout builds it from
    ``[rollout]``, the client sends every field, the embedded engine extends it only with
    engine-only fields (``agentrl.inference.sampling.EngineSampling``).  The behaviour
    logprob μ of a token is taken after temperature, top-k, top-p and min-p.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None


@dataclass
class Completion:
    """One sampled choice, token-exact: what every policy client returns for one call.

    ``logprobs`` are the behaviour logprobs μ of ``token_ids``; ``versions`` the weight
    version that sampled each token.  On a chat endpoint that returns no token ids (a
    hosted API) ``token_ids``/``logprobs``/``versions`` are empty and ``usage`` counts stand
    in for lengths.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    support: list[int] = field(default_factory=list)  # kept-set size per token (0: not reported)
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # from the server's usage (the prompt length)
    completion_tokens: int = 0


def oldest_version(versions: Any) -> int | None:
    """The oldest (smallest) weight version among sampled tokens; None if there are none.

    The one place a version minimum is computed: sequences, trajectories, groups and the
    rollout manager's running groups all call it.
    """
    return min((v for v in versions if v >= 0), default=None)


@dataclass
class Task:
    """One problem from an environment's dataset.

    ``prompt`` is the opening conversation; ``answer`` whatever the rubric compares to;
    ``info`` free-form per-task data (test cases, a seed, a gym env id ...).
    """

    prompt: list[Message]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: new_id("task_"))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "prompt": messages_to_dicts(self.prompt), "answer": self.answer, "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(
            prompt=[Message.from_dict(m) for m in d["prompt"]],
            answer=d.get("answer"),
            info=d.get("info") or {},
            id=d.get("id") or new_id("task_"),
        )


@dataclass
class TokenSequence:
    """One training sample: exact tokens with per-token provenance (see module docstring)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # size K of the kept set (top-k/top-p/min-p) each sampled token was drawn from; 0 where
    # the mask is 0 or the engine did not report it (then the trainer uses the full vocabulary)
    support: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend_forced(self, ids: list[int]) -> None:
        """Append prompt / env / tool tokens (not trained on)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))
        self.support.extend([0] * len(ids))

    def extend_sampled(
        self, ids: list[int], logprobs: list[float], versions: list[int], support: list[int] | None = None
    ) -> None:
        """Append tokens the policy sampled, with their behaviour logprobs μ, versions and support."""
        support = list(support) if support else [0] * len(ids)
        if not (len(ids) == len(logprobs) == len(versions) == len(support)):
            raise ValueError("sampled ids, logprobs, versions and support must have equal length")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.support.extend(support)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def sampled_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    def staleness(self, trainer_version: int) -> list[int]:
        """Per sampled token: trainer version minus the version that sampled it."""
        return [trainer_version - v for v in self.sampled_versions()]

    def validate(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == len(self.support) == n):
            raise ValueError("TokenSequence fields have different lengths")


@dataclass
class Turn:
    """One model call inside an episode (for logs and debugging, not for the loss)."""

    prompt_len: int
    completion_ids: list[int]
    completion_text: str
    finish_reason: str | None = None
    versions: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    completion_tokens: int = 0  # from usage when the endpoint returns no token ids


@dataclass
class Trajectory:
    """One finished episode.

    ``sequences`` usually holds one :class:`TokenSequence` for the whole multi-turn
    episode; a new one starts only where the chat template could not be extended
    token-exactly (counted in ``metrics['template_breaks']``).
    ``error`` is set for infrastructure failures (endpoint, sandbox, env or rubric crash):
    such an episode is recorded and counted but never trained on.
    """

    task: Task
    messages: list[Message] = field(default_factory=list)
    sequences: list[TokenSequence] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    advantage: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None  # agentrl.errors.ERROR_KINDS, set with error
    timing: dict[str, float] = field(default_factory=dict)
    env_name: str = ""
    env_version: str = ""
    id: str = field(default_factory=lambda: new_id("ep_"))
    group_id: str = ""

    @property
    def errored(self) -> bool:
        return self.error is not None

    @property
    def num_sampled_tokens(self) -> int:
        return sum(s.num_sampled for s in self.sequences)

    def oldest_version(self) -> int | None:
        """Oldest weight version among sampled tokens (None if nothing was sampled)."""
        return oldest_version(v for s in self.sequences for v in s.sampled_versions())

    def staleness(self, trainer_version: int) -> list[int]:
        """Per sampled token: how many versions behind ``trainer_version`` it is."""
        return [x for s in self.sequences for x in s.staleness(trainer_version)]

    @property
    def completion(self) -> list[Message]:
        """Messages after the task prompt (what the model and env said)."""
        return self.messages[len(self.task.prompt):]

    def to_dict(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` gives (nothing aliased), built field by field: asdict deep-copies
        every token id one by one, and each episode is logged (~10x the cost of this)."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["task"] = {**self.task.to_dict(), "info": copy.deepcopy(self.task.info), "answer": copy.deepcopy(self.task.answer)}
        d["messages"] = messages_to_dicts(self.messages)
        d["sequences"] = [_flat_dict(s) for s in self.sequences]
        d["turns"] = [_flat_dict(t) for t in self.turns]
        d["metrics"], d["timing"] = copy.deepcopy(self.metrics), copy.deepcopy(self.timing)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["task"] = Task.from_dict(d["task"])
        d["messages"] = [Message.from_dict(m) for m in d.get("messages", [])]
        d["sequences"] = [_sequence(s) for s in d.get("sequences", [])]
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


def _sequence(d: dict[str, Any]) -> TokenSequence:
    seq = TokenSequence(**d)
    if len(seq.support) != len(seq.token_ids):  # written before support was recorded
        seq.support = [0] * len(seq.token_ids)
    return seq


@dataclass
class Group:
    """G episodes of the same task; advantages are computed within a group."""

    task: Task
    trajectories: list[Trajectory] = field(default_factory=list)
    id: str = field(default_factory=lambda: new_id("grp_"))

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def oldest_version(self) -> int | None:
        return oldest_version(v for t in self.trajectories if (v := t.oldest_version()) is not None)

    def drop_env_state(self) -> Group:
        """Before the group leaves this process: the env state its episodes keep (``traj.state``:
        sandboxes, sockets) stays behind; nothing downstream of scoring reads it."""
        for t in self.trajectories:
            t.__dict__.pop("state", None)
        return self

    def assign_advantages(self, std_normalize: bool = False, eps: float = 1e-6) -> None:
        """GRPO-style: each episode's reward minus the group mean (÷ the group std if asked).

        Set when the group is scored, so the advantage logged with an episode is the one trained.
        """
        rewards = [t.reward for t in self.trajectories]
        if not rewards:
            return
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        for t in self.trajectories:
            t.advantage = (t.reward - mean) / (std + eps) if std_normalize and len(rewards) > 1 else t.reward - mean

    def staleness(self, trainer_version: int) -> list[int]:
        return [x for t in self.trajectories for x in t.staleness(trainer_version)]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "task": self.task.to_dict(), "trajectories": [t.to_dict() for t in self.trajectories]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(
            task=Task.from_dict(d["task"]),
            trajectories=[Trajectory.from_dict(t) for t in d["trajectories"]],
            id=d["id"],
        )
