"""``agentrl sandbox doctor``: what this host gives the sandboxes, checked, in one readable list.

Every line is a fact found here (a probe, a file, a live sandbox), never an assumption:
which backends work, whether the seccomp filter can be generated, whether each sandbox gets
cgroups (and, if not, the real worst case of the per-process fallback), and whether
``network=True`` can be honoured without sharing the host's network.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    status: str
    name: str
    detail: str


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    def add(self, status: str, name: str, detail: str) -> None:
        self.checks.append(Check(status, name, detail))

    @property
    def isolating_backend(self) -> bool:
        """At least one backend that isolates (bwrap or docker) works end to end."""
        return any(c.status == OK and c.name in ("bwrap sandbox", "docker sandbox") for c in self.checks)

    def text(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"[{c.status:>4}] {c.name:<{width}}  {c.detail}" for c in self.checks]
        verdict = (
            "sandboxes isolate on this host"
            if self.isolating_backend
            else "NO isolating sandbox works on this host (only 'local', which is not a security boundary)"
        )
        return "\n".join([*lines, "", verdict])


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


async def _live(backend: str) -> str:
    """Start a sandbox, run one command, report its isolation (raises on failure)."""
    from agentrl.sandbox import make_sandbox

    async with make_sandbox(backend) as sb:
        r = await sb.exec("id -u; grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status | tr -s '\\t\\n' '  '")
        cgroup = "per-sandbox cgroup" if sb._memory_cgroup() else "per-process rlimits only"
        return (f"{sb.info.get('isolation', '?')}, {cgroup}; uid {r.stdout.split()[0]} (host uid {sb.host_uid}); "
                f"{' '.join(r.stdout.split()[1:])}")  # fmt: skip


def doctor(*, live: bool = True) -> DoctorReport:
    """Check everything; ``live`` also starts one sandbox per available backend."""
    from agentrl.sandbox import SandboxLimits, why_unavailable
    from agentrl.sandbox import seccomp as sc
    from agentrl.sandbox.bwrap import slirp_path
    from agentrl.sandbox.cgroup import detect
    from agentrl.sandbox.uids import uid_range

    rep = DoctorReport()
    rep.add(OK, "host", f"{platform.system()} {platform.release()} {platform.machine()}, uid {os.geteuid()}")

    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            n = int(f.read())
        rep.add(OK if n > 0 else FAIL, "user namespaces", f"user.max_user_namespaces = {n}")
    except OSError as e:
        rep.add(WARN, "user namespaces", f"cannot read user.max_user_namespaces: {e}")

    why = sc.why_unavailable()
    if why:
        rep.add(FAIL, "seccomp filter", why)
    else:
        rep.add(OK, "seccomp filter", f"{len(sc.filter_bpf()) // 8} BPF instructions from libseccomp, "
                f"{len(sc.DENIED)} syscalls + namespace clone flags + socket families denied")  # fmt: skip

    cg = detect()
    limits = SandboxLimits()
    if cg.version:
        missing = sorted({"memory", "pids", "cpu"} - cg.controllers)
        rep.add(OK if not missing else WARN, "cgroups (bwrap)", cg.note + (f"; missing: {', '.join(missing)}" if missing else ""))
    else:
        rep.add(WARN, "cgroups (bwrap)", f"{cg.note}. Without them each limit is per process: with the default "
                f"limits one sandbox can pin up to {_mib(limits.worst_case_memory_bytes())} "
                f"({limits.pids} processes x ({_mib(limits.memory_bytes)} address space + {limits.open_files} "
                f"memfds x {_mib(limits.disk_bytes)})), and an out-of-memory is the program's own error, not a flag")  # fmt: skip

    bwrap = shutil.which("bwrap")
    version = ""
    if bwrap:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    why = why_unavailable("bwrap")
    rep.add(OK if why is None else FAIL, "bwrap backend", why or version or "available")
    slirp = slirp_path()
    rep.add(OK if slirp else WARN, "network=True (bwrap)",
            f"slirp4netns at {slirp}: own network namespace, outbound NAT, host loopback unreachable" if slirp
            else "slirp4netns not installed: network=True is refused (apt-get install slirp4netns)")  # fmt: skip

    first, last = uid_range()
    if os.geteuid() == 0:
        rep.add(OK, "per-user counters (bwrap)", f"each sandbox runs as a host uid of its own ({first}-{last})")
    else:
        rep.add(WARN, "per-user counters (bwrap)", f"not root: bwrap sandboxes share uid {os.geteuid()}; per-exec "
                "caps bound each one's share of inotify instances, message queues and queued signals, not their "
                "sum (run as root for a uid per sandbox)")  # fmt: skip

    why_docker = why_unavailable("docker")
    rep.add(OK if why_docker is None else WARN, "docker backend", why_docker or f"engine at {os.environ.get('DOCKER_HOST', 'the default socket')}")
    rep.add(WARN, "local backend", "always available, NOT a security boundary (development only)")

    if live:
        for backend, unavailable in (("bwrap", why), ("docker", why_docker)):
            if unavailable is not None:
                continue
            try:
                rep.add(OK, f"{backend} sandbox", asyncio.run(_live(backend)))
            except Exception as e:  # a failed live check is the finding, not a crash
                rep.add(FAIL, f"{backend} sandbox", f"{type(e).__name__}: {e}")
    return rep
