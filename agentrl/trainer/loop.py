"""The async RL scheduler: rollouts keep flowing while the trainer steps.

:func:`rl_loop` owns the order of one training step and nothing else, so the real run
(:mod:`agentrl.trainer.run`) and the pipeline benchmark share it::

    batch = await buffer.take()          # 1) data: B groups within the staleness bound
    stats = await train(batch)           # 2) loss on π_θ/μ, backward, optimizer step
    push_s = await push(version + 1)     # 3) live push to every engine (every K steps)
    buffer.commit_step(version + 1)      # 4) ledger: trained; admission opens for v + 1
    await on_step(report)                # 5) metrics, eval, checkpoint

The rollout manager runs beside it in the same event loop for the whole loop; training
runs in a worker thread (``train`` is awaited), so generation never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agentrl.buffer import Batch, StalenessBuffer
from agentrl.rollout import RolloutManager


@dataclass
class StepReport:
    step: int  # 0-based optimizer step just applied
    version: int  # trainer version after it (= step + 1)
    batch: Batch
    stats: dict[str, float]
    trained_ids: list[str]
    wait_s: float  # trainer idle, waiting for data
    train_s: float
    push_s: float
    step_wall_s: float  # wall time of this whole step (wait + train + push)
    extra: dict[str, float] = field(default_factory=dict)


async def rl_loop(
    buffer: StalenessBuffer,
    manager: RolloutManager,
    *,
    start_step: int,
    steps: int,
    train: Callable[[Batch], Awaitable[dict[str, float]]],
    push: Callable[[int], Awaitable[float]],
    on_step: Callable[[StepReport], Awaitable[None]] | None = None,
    push_every: int = 1,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Run optimizer steps ``start_step .. steps-1``; returns the number of the next step."""
    runner = asyncio.create_task(manager.run())
    step = start_step
    try:
        while step < steps and not should_stop():
            t0 = time.perf_counter()
            take = asyncio.create_task(buffer.take())
            done, _ = await asyncio.wait({take, runner}, return_when=asyncio.FIRST_COMPLETED)
            if take not in done:  # the rollout manager died: surface its exception
                take.cancel()
                runner.result()
                raise RuntimeError("rollout manager stopped unexpectedly")
            batch = take.result()
            t1 = time.perf_counter()
            stats = await train(batch)
            t2 = time.perf_counter()
            version = step + 1
            push_s = 0.0
            if version % push_every == 0 or version == steps:
                push_s = await push(version)
            trained_ids = buffer.commit_step(version)
            t3 = time.perf_counter()
            report = StepReport(
                step=step, version=version, batch=batch, stats=stats, trained_ids=trained_ids,
                wait_s=t1 - t0, train_s=t2 - t1, push_s=push_s, step_wall_s=t3 - t0,
            )
            buffer.adapt(report.wait_s / max(report.step_wall_s, 1e-9), stats.get("mismatch_kl", 0.0))
            if on_step is not None:
                await on_step(report)
            step += 1
    finally:
        manager.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    return step
