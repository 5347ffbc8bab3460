"""Small stand-ins for the engine and environment (unit tests only; the real path is
tested end to end in test_e2e.py)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from agentrl.types import Completion, Message, SamplingParams, Task, TokenSequence, Trajectory


@dataclass
class FakeEngine:
    """A shared 'server': its weight version moves when the test pushes."""

    version: int = 0
    latency_s: float = 0.0
    jitter: random.Random = field(default_factory=lambda: random.Random(0))
    heavy_tail: bool = False
    fail_next: int = 0  # raise ConnectionError for this many calls
    calls: int = 0


class FakeClient:
    """One stand-in endpoint, or several (``FakeClient([e1, e2])``): a group pins the least-loaded
    one, as :meth:`agentrl.inference.PolicyClient.pin` does."""

    def __init__(self, engine: FakeEngine | list[FakeEngine]) -> None:
        self.engines = engine if isinstance(engine, list) else [engine]
        self.engine = self.engines[0]
        self.load = {id(e): 0 for e in self.engines}

    def pin(self, weight: int = 1) -> _Pinned:
        engine = min(self.engines, key=lambda e: self.load[id(e)])
        self.load[id(engine)] += weight
        return _Pinned(self, engine, weight)

    async def complete(self, prompt_ids, sampling, n=1):
        eng = self.engine
        eng.calls += 1
        if eng.fail_next > 0:
            eng.fail_next -= 1
            raise ConnectionError("transient")
        # tokens are produced across the latency; the version may change midway
        out_ids, out_lp, out_v = [], [], []
        for _ in range(4):
            d = eng.latency_s / 4
            if eng.heavy_tail:
                d *= eng.jitter.paretovariate(1.5)
            if d:
                await asyncio.sleep(d)
            out_ids.append(7)
            out_lp.append(-0.5)
            out_v.append(eng.version)
        return [Completion("x", out_ids, out_lp, out_v, "stop")]

    async def tokenize(self, **kw):
        return [1, 2, 3]


class _Pinned(FakeClient):
    def __init__(self, parent: FakeClient, engine: FakeEngine, weight: int) -> None:
        self.parent, self.engine, self.engines, self.weight = parent, engine, [engine], weight

    def release(self) -> None:
        self.parent.load[id(self.engine)] -= self.weight


class FakeRubric:
    def __init__(self, p_success: float = 0.5, seed: int = 0, raise_on: set[str] | None = None) -> None:
        self.rng = random.Random(seed)
        self.p = p_success
        self.raise_on = raise_on or set()

    async def score_group(self, trajs):
        if any(t.task.answer in self.raise_on for t in trajs):
            raise RuntimeError("rubric exploded")
        for t in trajs:
            t.reward = float(self.rng.random() < self.p)


class FakeEnv:
    """Two model turns per episode, tokens recorded with their versions."""

    def __init__(self, turns: int = 2, rubric: FakeRubric | None = None, crash_on: str | None = None,
                 hang_on: str | None = None) -> None:
        self.turns = turns
        self.rubric = rubric or FakeRubric()
        self.crash_on = crash_on
        self.hang_on = hang_on

    def dataset(self):
        return [Task(prompt=[Message("user", f"q{i}")], answer=f"a{i}") for i in range(50)]

    async def rollout(self, client, task, sampling: SamplingParams, *, max_turns=None, timeout_s=None):
        try:
            async with asyncio.timeout(timeout_s):
                return await self._rollout(client, task, sampling)
        except TimeoutError:  # like the real episode loop: a wall limit is an error of kind timeout
            return Trajectory(task=task, error="episode exceeded its wall limit", error_kind="timeout",
                              stop_reason="error")

    async def _rollout(self, client, task, sampling: SamplingParams):
        if task.answer == self.hang_on:
            await asyncio.sleep(3600)
        seq = TokenSequence()
        seq.extend_forced([1, 2, 3])
        try:
            for _ in range(self.turns):
                if task.answer == self.crash_on:
                    raise RuntimeError("sandbox died")
                (c,) = await client.complete(seq.token_ids, sampling)
                seq.extend_sampled(c.token_ids, c.logprobs, c.versions)
                seq.extend_forced([5])
        except Exception as e:  # like the real env: errors become data
            return Trajectory(task=task, sequences=[seq], error=f"{type(e).__name__}: {e}", error_kind="env")
        return Trajectory(task=task, sequences=[seq], stop_reason="done")


def make_traj(versions: list[int], reward: float = 0.0, error: str | None = None) -> Trajectory:
    seq = TokenSequence()
    seq.extend_forced([1])
    seq.extend_sampled([2] * len(versions), [-0.1] * len(versions), versions)
    return Trajectory(task=Task(prompt=[Message("user", "q")]), sequences=[seq], reward=reward, error=error)
