"""SandboxPool (cap, pre-warm, reuse, rate limit, retries) and process-level cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentrl.sandbox import SandboxError, SandboxPool, why_unavailable
from agentrl.sandbox.bwrap import BwrapSandbox
from agentrl.sandbox.live import live_sandboxes


@pytest.fixture
def bwrap():
    why = why_unavailable("bwrap")
    if why:
        pytest.skip(f"bwrap unavailable: {why}")
    return "bwrap"


async def test_cap_on_live_sandboxes_holds_under_a_storm(bwrap, limits):
    peak = 0

    async def episode(pool: SandboxPool) -> str:
        nonlocal peak
        async with pool.acquire() as sb:
            peak = max(peak, len(live_sandboxes()))
            return (await sb.exec("sleep 0.2; echo done")).stdout

    async with SandboxPool(bwrap, limits, max_live=2) as pool:
        outs = await asyncio.gather(*(episode(pool) for _ in range(6)))
        assert outs == ["done\n"] * 6
        assert pool.snapshot().live <= 2
    assert peak <= 2 and pool.stats.created <= 2 and pool.stats.reused >= 4
    assert live_sandboxes() == []


async def test_prewarm_and_reuse_with_reset(bwrap, limits):
    async with SandboxPool(bwrap, limits, max_live=4, prewarm=2) as pool:
        assert pool.snapshot().idle == 2 and pool.stats.created == 2
        async with pool.acquire() as first:
            await first.write_file("left.txt", "from episode 1")
        async with pool.acquire() as second:
            r = await second.exec("ls")
        assert second is first  # reused ...
        assert r.stdout == ""  # ... after a reset
    assert live_sandboxes() == []


async def test_failed_episode_sandbox_is_destroyed_not_reused(bwrap, limits):
    async with SandboxPool(bwrap, limits, max_live=1) as pool:
        with pytest.raises(RuntimeError):
            async with pool.acquire() as sb:
                raise RuntimeError("episode crashed")
        assert not sb.alive and pool.stats.destroyed == 1
        async with pool.acquire() as fresh:
            assert fresh is not sb and (await fresh.exec("echo ok")).stdout == "ok\n"


async def test_creation_rate_limit_spaces_creations(bwrap, limits):
    starts: list[float] = []
    original = BwrapSandbox._start

    async def timed_start(self):
        starts.append(time.monotonic())
        await original(self)

    rate = 10.0
    BwrapSandbox._start = timed_start
    try:
        async with SandboxPool(bwrap, limits, max_live=4, creations_per_s=rate) as pool:
            t0 = time.monotonic()
            await asyncio.gather(*(pool.get() for _ in range(4)))
    finally:
        BwrapSandbox._start = original
    # creation i may start no earlier than its slot, i / rate after the first request; a
    # loaded event loop may wake any of them late (so gaps between wake-ups are not checked)
    assert len(starts) == 4
    assert all(s - t0 >= i / rate * 0.95 for i, s in enumerate(sorted(starts))), [s - t0 for s in starts]


async def test_retries_infrastructure_errors_with_backoff(bwrap, limits, monkeypatch):
    failures = {"left": 2}
    original = BwrapSandbox._start

    async def flaky_start(self):
        if failures["left"]:
            failures["left"] -= 1
            raise SandboxError("engine hiccup")
        await original(self)

    monkeypatch.setattr(BwrapSandbox, "_start", flaky_start)
    async with SandboxPool(bwrap, limits, retries=3, backoff_s=0.01) as pool:
        async with pool.acquire() as sb:
            assert (await sb.exec("echo up")).stdout == "up\n"
        assert pool.stats.create_failures == 2

    failures["left"] = 99
    async with SandboxPool(bwrap, limits, retries=2, backoff_s=0.01) as pool:
        with pytest.raises(SandboxError, match="after 3 attempts"):
            await pool.get()
        assert pool.stats.create_failures == 3
    assert live_sandboxes() == []


async def test_a_command_failure_is_not_retried(bwrap, limits):
    async with SandboxPool(bwrap, limits) as pool:
        async with pool.acquire() as sb:
            r = await sb.exec("exit 7")
        assert r.exit_code == 7 and pool.stats.create_failures == 0 and pool.stats.created == 1


async def test_cancellation_during_creation_and_use_leaves_nothing(bwrap, limits):
    pool = SandboxPool(bwrap, limits, max_live=3)
    await pool.start()

    async def episode():
        async with pool.acquire() as sb:
            await sb.exec("sleep 30")

    tasks = [asyncio.ensure_future(episode()) for _ in range(5)]
    await asyncio.sleep(0.3)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    assert live_sandboxes() == [] and pool.snapshot().live == 0


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from agentrl.sandbox import SandboxPool, SandboxLimits

    async def main():
        pools = [SandboxPool(b, SandboxLimits(), max_live=2) for b in sys.argv[1:]]
        held = []
        for p in pools:
            await p.start()
            held += [await p.get(), await p.get()]
        print("ready", flush=True)
        await asyncio.sleep(300)

    asyncio.run(main())
    """
)


def _spawn_holder(backends: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *backends], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _traces_of(pid: int, start: str) -> list[str]:
    import glob
    import socket
    import tempfile

    left = glob.glob(os.path.join(tempfile.gettempdir(), f"agentrl.sandbox-{pid}-*"))
    if why_unavailable("docker") is None:
        from agentrl.sandbox.docker import client

        owner = f"{socket.gethostname()}:{pid}:{start}"
        left += [c.name for c in client().containers.list(all=True, filters={"label": f"agentrl.owner={owner}"})]
    return left


def _backends_for_signals() -> list[str]:
    return [b for b in ("bwrap", "docker", "local") if why_unavailable(b) is None]


@pytest.mark.slow
def test_sigterm_destroys_every_sandbox_of_the_process():
    from agentrl.sandbox.docker import process_start_time

    proc = _spawn_holder(_backends_for_signals())
    start = process_start_time(proc.pid)
    assert _traces_of(proc.pid, start)  # the check below can see what it looks for
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # still dies by SIGTERM, as before
    assert _traces_of(proc.pid, start) == []


@pytest.mark.slow
def test_prune_removes_what_a_sigkilled_run_left():
    from agentrl.sandbox.docker import process_start_time

    backends = [b for b in _backends_for_signals() if b != "bwrap"]  # bwrap dies with its parent
    if not backends:
        pytest.skip("no backend that can leave orphans")
    proc = _spawn_holder(backends)
    start = process_start_time(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    assert _traces_of(proc.pid, start)  # SIGKILL: nothing could clean up
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "prune"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("removed"), out.stderr
    assert _traces_of(proc.pid, start) == []
