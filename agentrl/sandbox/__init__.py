"""Sandboxed execution of model-written code.

    from agentrl.sandbox import make_sandbox, SandboxLimits

    async with make_sandbox("auto", SandboxLimits(timeout_s=5)) as sb:
        await sb.write_file("main.py", "print(6 * 7)")
        r = await sb.exec(["python3", "main.py"])      # ExecResult(exit_code=0, stdout="42\\n", ...)

Backends: ``bwrap`` (default where bubblewrap works: namespaces, seccomp, a cgroup per
sandbox where the host delegates one; no daemon), ``docker`` (any Docker Engine API at
$DOCKER_HOST, podman included; the agent is the container's pid 1), ``local`` (plain
subprocess + rlimits — development only, NOT a security boundary, warns when created; never
chosen by ``auto``).  :class:`SandboxPool` caps, pre-warms, resets (verified) and reuses
sandboxes.  ``agentrl sandbox doctor`` says what this host gives them.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Literal

from agentrl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from agentrl.sandbox.live import install_cleanup_hooks
from agentrl.sandbox.pool import SandboxPool

Backend = Literal["auto", "bwrap", "docker", "local"]
BACKENDS = ("bwrap", "docker", "local")

__all__ = [
    "Backend", "ExecResult", "Sandbox", "SandboxError", "SandboxLimits", "SandboxPool",
    "available_backends", "make_sandbox", "resolve_backend", "why_unavailable",
]  # fmt: skip

_probe_lock = threading.Lock()
_probes: dict[str, str | None] = {}  # backend -> None if usable, else why not


def _probe_bwrap() -> str | None:
    import subprocess

    from agentrl.sandbox.bwrap import sandbox_python

    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "bwrap not installed (apt-get install bubblewrap)"
    if not sandbox_python():
        return "no python3 under /usr or /bin for the sandbox agent"
    # the real thing in miniature: the same namespaces, as the same user
    drop = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        p = subprocess.run(
            [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--proc", "/proc",
             "--", "/bin/true"],
            capture_output=True, timeout=20, cwd="/", **drop,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap does not run here: {e}"
    if p.returncode != 0:
        return f"bwrap cannot create namespaces here: {p.stderr.decode(errors='replace').strip()[:200]}"
    return None


def _probe_docker() -> str | None:
    from agentrl.sandbox.docker import client

    try:
        client()
    except SandboxError as e:
        return str(e)
    return None


def why_unavailable(backend: str) -> str | None:
    """None when ``backend`` works on this machine, else the reason (cached per process)."""
    if backend == "local":
        return None
    with _probe_lock:
        if backend not in _probes:
            from agentrl.sandbox.seccomp import why_unavailable as no_filter

            # both isolating backends install the same host-generated filter: no filter, no sandbox
            _probes[backend] = no_filter() or (_probe_bwrap() if backend == "bwrap" else _probe_docker())
        return _probes[backend]


def available_backends() -> list[str]:
    return [b for b in BACKENDS if why_unavailable(b) is None]


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` -> bwrap, else docker; never local.  Raises SandboxError with the reasons."""
    if backend not in ("auto", *BACKENDS):
        raise SandboxError(f"unknown sandbox backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    if backend != "auto":
        why = why_unavailable(backend)
        if why:
            raise SandboxError(f"sandbox backend {backend!r} unavailable: {why}")
        return backend
    reasons = []
    for b in ("bwrap", "docker"):
        why = why_unavailable(b)
        if why is None:
            return b
        reasons.append(f"{b}: {why}")
    raise SandboxError(
        "no sandbox backend available (" + "; ".join(reasons) + "). "
        "backend='local' runs code unsandboxed (development only)."
    )


def make_sandbox(backend: str = "auto", limits: SandboxLimits | None = None, **options: object) -> Sandbox:
    """A new, not yet started sandbox (start it with ``async with`` or ``await sb.start()``).

    ``options`` go to the backend (docker: ``image=``).  Installs the atexit/SIGTERM
    cleanup hooks on first use.
    """
    name = resolve_backend(backend)
    install_cleanup_hooks()
    if name == "bwrap":
        from agentrl.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(limits, **options)  # type: ignore[arg-type]
    if name == "docker":
        from agentrl.sandbox.docker import DockerSandbox

        return DockerSandbox(limits, **options)  # type: ignore[arg-type]
    from agentrl.sandbox.local import LocalSandbox

    return LocalSandbox(limits, **options)  # type: ignore[arg-type]
