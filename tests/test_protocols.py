"""The Ray seams: the local buffer, ledger, sampler and rollout manager and their Ray-side
stand-ins (agentrl.distributed.pool) implement the same protocols, member by member, with the
same parameters (the recipe cannot tell them apart)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from agentrl.buffer import StalenessBuffer
from agentrl.ledger import Ledger
from agentrl.protocols import (
    AdmissionBuffer,
    LedgerView,
    RolloutSource,
    SamplerState,
    TaskSource,
    TrainingBuffer,
)
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.types import SamplingParams, Task

pool = pytest.importorskip("agentrl.distributed.pool")  # needs ray
roles = pytest.importorskip("agentrl.distributed.roles")


def members(proto: type) -> list[str]:
    """The protocol's own members: methods, properties and annotated attributes."""
    names = {n for n in vars(proto) if not n.startswith("_")} | set(vars(proto).get("__annotations__", {}))
    return sorted(names)


def params(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) after ``self``; annotations may differ in spelling, not the call."""
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in list(sig.parameters.values())[1:]]


def differences(proto: type, obj: object) -> list[str]:
    """Every member of ``proto`` that ``obj`` lacks or has with other parameters (read without
    running properties: a Ray-side one would call its actor)."""
    out = []
    for name in members(proto):
        want = vars(proto).get(name)
        try:
            have = inspect.getattr_static(obj, name)
        except AttributeError:
            out.append(f"{type(obj).__name__}.{name}: missing")
            continue
        if inspect.isfunction(want):
            if not inspect.isfunction(have):
                out.append(f"{type(obj).__name__}.{name}: not a method")
            elif params(want) != params(have):
                out.append(f"{type(obj).__name__}.{name}{inspect.signature(have)} != protocol {inspect.signature(want)}")
            elif inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
                out.append(f"{type(obj).__name__}.{name}: async in one, not in the other")
    return out


def local_and_remote() -> list[tuple[type, object, object]]:
    buffer, sampler = StalenessBuffer(2, 1), TaskSampler([Task(prompt=[{"role": "user", "content": "hi"}])])
    manager = RolloutManager(None, None, buffer, sampler, SamplingParams())
    actor = object()  # never called: only the shape is compared
    workers = pool.WorkerPool(actor, [], None, None, episode_timeout_s=1.0, max_turns=None)
    leased = roles.LeasedBuffer(actor, "w0", lambda: 0)  # what a worker's RolloutManager admits through
    return [
        (LedgerView, Ledger(), pool.RemoteLedger(actor)),
        (TrainingBuffer, buffer, pool.RemoteBuffer(actor)),
        (SamplerState, sampler, pool.RemoteSampler(actor)),
        (RolloutSource, manager, workers),
        (AdmissionBuffer, buffer, leased),
        (TaskSource, sampler, leased),
    ]


@pytest.mark.parametrize("i", range(6), ids=["ledger", "buffer", "sampler", "rollouts", "admission", "tasks"])
def test_local_and_ray_side_implement_the_same_protocol(i: int) -> None:
    proto, local, remote = local_and_remote()[i]
    assert differences(proto, local) == []
    assert differences(proto, remote) == []
    assert isinstance(local, proto)
    if not isinstance(remote, pool.RemoteBuffer):  # its properties ask the actor; checked statically above
        assert isinstance(remote, proto)


def test_a_missing_method_or_other_parameters_are_reported() -> None:
    class Drifted:
        version = max_staleness = 0
        ledger = adaptive = ready_groups = None

        async def take(self, n: int) -> Any: ...  # a new parameter
        def commit_step(self, version: int, skipped: Any = None) -> list[str]: ...  # renamed
        def skip_step(self, reason: str, skipped: Any = None) -> list[str]: ...
        def close_out(self, reason: str) -> dict[str, int]: ...
        def adapt(self, trainer_idle_frac: float, mismatch_kl: float) -> int: ...
        def state_dict(self) -> dict[str, Any]: ...  # held_ids missing

    found = differences(TrainingBuffer, Drifted())
    assert len(found) == 3, found
    assert any(f.startswith("Drifted.held_ids: missing") for f in found)
    assert any(f.startswith("Drifted.take(") for f in found)
    assert any(f.startswith("Drifted.commit_step(") for f in found)
    assert not isinstance(Drifted(), TrainingBuffer)
