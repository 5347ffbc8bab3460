"""Backends as fixtures, and the leak check every sandbox test ends with.

Docker tests run against whatever engine $DOCKER_HOST names (CI: ``.ci/docker-engine``)
and skip, with the reason, only when no engine answers there.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from procs import descendants

from agentrl.sandbox import SandboxLimits, why_unavailable

BACKEND_PARAMS = [
    pytest.param("bwrap", id="bwrap"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("local", id="local"),
]
ISOLATING = [p for p in BACKEND_PARAMS if p.id != "local"]

# Small limits keep the suite cheap on a shared 2-core machine.
TEST_LIMITS = SandboxLimits(
    timeout_s=3.0, cpu_s=1, memory_bytes=256 << 20, pids=24, output_bytes=64 << 10, disk_bytes=16 << 20
)


def require(backend: str) -> str:
    why = why_unavailable(backend)
    if why:
        pytest.skip(f"{backend} sandbox unavailable: {why}")
    return backend


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return require(request.param)


@pytest.fixture(params=ISOLATING)
def isolating_backend(request: pytest.FixtureRequest) -> str:
    return require(request.param)


def sandbox_leftovers() -> list[str]:
    """What this test process left behind: sandbox processes, containers, temp dirs."""
    from agentrl.sandbox.live import live_sandboxes

    left = [f"registered sandbox {sb.id}" for sb in live_sandboxes()]
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(k in cmd for k in ("bwrap", "agent.py", "_agent", "serve-local", "slirp4netns")):
            left.append(f"process {pid}: {cmd[:80]}")
    from agentrl.sandbox.cgroup import stale_dirs

    for d in stale_dirs(everything=True):  # per-sandbox cgroups of this process
        if f"agentrl-{os.getpid()}-" in d:
            left.append(f"cgroup {d}")
    prefix = f"agentrl.sandbox-{os.getpid()}-"
    left += [f"temp dir {d}" for d in os.listdir(tempfile.gettempdir()) if d.startswith(prefix)]
    if why_unavailable("docker") is None:
        from agentrl.sandbox.docker import client, owner_label

        for c in client().containers.list(all=True, filters={"label": f"agentrl.owner={owner_label()}"}):
            left.append(f"container {c.name}")
    return left


@pytest.fixture
def limits() -> SandboxLimits:
    return TEST_LIMITS


@pytest.fixture(autouse=True, scope="module")
def no_leftovers_after_module():
    yield
    assert sandbox_leftovers() == []
