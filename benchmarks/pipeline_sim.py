"""How busy does the trainer stay as the staleness bound η grows?

The real RolloutManager, StalenessBuffer and scheduler (``rl_loop``) run unchanged; the
engine and the trainer are timed stand-ins:

* engine: each model call sleeps a heavy-tailed time (log-normal, median ``call_ms``,
  σ = ``sigma``), drawn from an RNG keyed by (task, episode, turn) so every η setting
  sees exactly the same generation times; a weight push pauses nothing (versions simply
  move, as with the real engine's pause/resume which takes milliseconds);
* trainer: a fixed ``train_ms`` per optimizer step (a worker-thread sleep, as the real
  step runs in a thread), plus ``push_ms`` per push.

The manager cancels a running group as soon as it holds a token too stale to ever be
trained (counted as dropped), which frees its admission slot early.

Prints, per η: trainer busy fraction (train time / wall time once the first batch has
arrived; the JSON also has it including the initial pipeline fill), trained episodes/s,
ratio of throughput to η = 0, mean/max staleness and episodes dropped as stale.  The
last line is JSON.  Goal: busy ≥ 0.9 at η ≤ 2.

    python benchmarks/pipeline_sim.py [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from agentrl.buffer import StalenessBuffer
from agentrl.recipes.rl import rl_loop
from agentrl.rollout import RolloutManager, TaskSampler
from agentrl.types import Completion, Message, SamplingParams, Task, TokenSequence, Trajectory


class TimedEngine:
    """Stand-in inference server: heavy-tailed latency, version-tagged tokens."""

    def __init__(self, call_ms: float, sigma: float, seed: int) -> None:
        self.call_ms, self.sigma, self.seed = call_ms, sigma, seed
        self.version = 0

    def latency_s(self, key: tuple) -> float:
        rng = random.Random(f"{self.seed}:{key}")
        return self.call_ms / 1000 * rng.lognormvariate(0.0, self.sigma)

    async def complete(self, prompt_ids, sampling, n=1, *, key=()):
        d = self.latency_s(key)
        # tokens stream out over the call: a push midway tags later tokens with the new version
        ids, vs = [], []
        for _ in range(4):
            await asyncio.sleep(d / 4)
            ids.append(7)
            vs.append(self.version)
        return [Completion("x", ids, [-1.0] * 4, vs, "stop")]


class TwoTurnEnv:
    """Tool-call turn + answer turn; reward alternates so no group is zero-variance."""

    class _Rubric:
        async def score_group(self, trajs):
            for i, t in enumerate(trajs):
                t.reward = float(i % 2)

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns
        self.rubric = self._Rubric()
        self._seen: dict[str, int] = {}

    def dataset(self):
        return [Task(prompt=[Message("user", f"q{i}")], id=f"t{i}") for i in range(10_000)]

    async def rollout(self, client, task, sampling, *, max_turns=None, timeout_s=None):
        ep = self._seen[task.id] = self._seen.get(task.id, -1) + 1  # same key for every η
        seq = TokenSequence()
        seq.extend_forced([1, 2, 3])
        for turn in range(self.turns):
            (c,) = await client.complete(seq.token_ids, sampling, key=(task.id, ep, turn))
            seq.extend_sampled(c.token_ids, c.logprobs, c.versions)
            seq.extend_forced([5])
        return Trajectory(task=task, sequences=[seq], stop_reason="done")


async def simulate(eta: int, overprovision: float, args) -> dict[str, float]:
    engine = TimedEngine(args.call_ms, args.sigma, args.seed)
    env = TwoTurnEnv()
    buffer = StalenessBuffer(args.batch_groups, eta, filter_zero_variance=False, overprovision=overprovision)
    manager = RolloutManager(
        env, engine, buffer, TaskSampler(env.dataset(), seed=args.seed), SamplingParams(),
        group_size=args.group_size, max_in_flight=args.max_in_flight, episode_timeout_s=60,
    )
    busy = 0.0
    first_batch_at: float | None = None
    staleness: list[int] = []

    async def train(batch):
        nonlocal busy, first_batch_at
        staleness.extend(batch.staleness)
        t = time.perf_counter()
        if first_batch_at is None:
            first_batch_at = t
        await asyncio.to_thread(time.sleep, args.train_ms / 1000)
        busy += time.perf_counter() - t
        return {}

    async def push(version):
        await asyncio.sleep(args.push_ms / 1000)
        engine.version = version
        return args.push_ms / 1000

    t0 = time.perf_counter()
    await rl_loop(buffer, manager, start_step=0, steps=args.steps, train=train, push=push)
    wall = time.perf_counter() - t0
    lg = buffer.ledger
    steady = time.perf_counter() - first_batch_at
    return {
        "eta": eta,
        "overprovision": overprovision,
        "busy_frac": busy / steady,  # steady state: after the pipeline's first batch
        "busy_frac_incl_fill": busy / wall,
        "episodes_per_s": lg.trained / wall,
        "wall_s": wall,
        "staleness_mean": sum(staleness) / max(1, len(staleness)),
        "staleness_max": max(staleness, default=0),
        "episodes_stale": lg.stale,
        "episodes_started": lg.started,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-in-flight", type=int, default=192)
    p.add_argument("--call-ms", type=float, default=40.0, help="median model-call latency")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal σ of call latency (heavy tail)")
    p.add_argument("--train-ms", type=float, default=200.0)
    p.add_argument("--push-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--etas", type=str, default="0,1,2,4")
    p.add_argument("--overprovision", type=str, default="0,1",
                   help="extra admitted groups as a fraction of B (0 = strict (eta+1)*B admission)")
    args = p.parse_args()

    rows = [
        asyncio.run(simulate(int(e), float(o), args))
        for o in args.overprovision.split(",") for e in args.etas.split(",")
    ]
    base = rows[0]["episodes_per_s"]  # eta = 0, strict admission: synchronous training
    print(f"pipeline sim: B={args.batch_groups} groups x G={args.group_size}, steps={args.steps}, "
          f"call median {args.call_ms:g} ms (lognormal sigma {args.sigma:g}), train {args.train_ms:g} ms/step, seed {args.seed}")
    print(f"{'eta':>4} {'overprov':>8} {'busy':>6} {'ep/s':>8} {'x eta0':>7} {'stale_mean':>10} {'stale_max':>9} {'dropped':>8} {'started':>8}")
    for r in rows:
        r["ratio_vs_eta0"] = r["episodes_per_s"] / base if base else 0.0
        print(f"{r['eta']:>4} {r['overprovision']:>8g} {r['busy_frac']:>6.3f} {r['episodes_per_s']:>8.1f} {r['ratio_vs_eta0']:>7.2f} "
              f"{r['staleness_mean']:>10.2f} {r['staleness_max']:>9} {r['episodes_stale']:>8} {r['episodes_started']:>8}")
    print(json.dumps({"benchmark": "pipeline_sim", "seed": args.seed, "results": rows}))


if __name__ == "__main__":
    main()
