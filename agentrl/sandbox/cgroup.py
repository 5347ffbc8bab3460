"""Per-sandbox cgroups (memory, pids, cpu) for the bwrap backend, where the host gives one.

:func:`detect` finds, once per process, a place where this process may create cgroups:

- cgroup v2: ``$AGENTRL_SANDBOX_CGROUP`` if set, else (as root) the root of the unified
  hierarchy, else the nearest ancestor of our own cgroup that is delegated to us (we may
  create children there and enable controllers, e.g. systemd ``Delegate=yes``).  Sandboxes
  go into ``<that>/agentrl.sandbox/<sandbox id>``.
- cgroup v1 (and the hybrid layout): per controller, a child of our own cgroup in that
  hierarchy, when we may write there (root, usually).

A :class:`SandboxCgroup` caps one sandbox: ``memory.max`` (swap off), ``pids.max``, and a CPU
quota; it counts OOM kills (a kernel event the result flags read) and the processes still
inside.  Its directory name carries the owner pid so that ``agentrl sandbox prune`` can
remove what a killed run left.  Where nothing is delegated, :func:`detect` says why and the
bwrap backend falls back to per-process rlimits (see ``SandboxLimits.worst_case_memory_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass, field

CONTROLLERS = ("memory", "pids", "cpu")
V2_PARENT = "agentrl.sandbox"
PREFIX = "agentrl-"  # sandbox ids: agentrl-<owner pid>-<hex>


@dataclass
class CgroupSupport:
    """What this host lets us do with cgroups."""

    version: str | None = None
    """"v2", "v1" or None (no usable delegation)."""
    dirs: dict[str, str] = field(default_factory=dict)
    """controller -> directory under which per-sandbox cgroups are created."""
    note: str = ""
    """How it was found, or why nothing is available."""

    @property
    def controllers(self) -> set[str]:
        return set(self.dirs)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for the unified hierarchy) -> our cgroup path in it."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, superopts = (right.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((left.split()[4], fstype, superopts.split(",")))
    return out


def _probe_dir(parent: str, needs: list[str]) -> bool:
    """True when we can create a child of ``parent`` that has ``needs`` files."""
    probe = os.path.join(parent, f"{PREFIX}probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        return all(os.path.exists(os.path.join(probe, n)) for n in needs)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def _detect_v2(mount: str, own: str) -> CgroupSupport | None:
    try:
        available = set(_read(os.path.join(mount, "cgroup.controllers")).split())
    except OSError:
        return None
    wanted = [c for c in CONTROLLERS if c in available]
    if "memory" not in wanted or "pids" not in wanted:
        return None
    candidates = []
    env = os.environ.get("AGENTRL_SANDBOX_CGROUP")
    if env:
        candidates.append(env if env.startswith(mount) else os.path.join(mount, env.lstrip("/")))
    if os.geteuid() == 0:
        candidates.append(mount)
    parts = [p for p in own.split("/") if p]
    for i in range(len(parts) - 1, 0, -1):  # ancestors of our own cgroup, nearest first
        candidates.append(os.path.join(mount, *parts[:i]))
    plus = " ".join(f"+{c}" for c in wanted)
    for cand in candidates:
        base = cand if env and cand == candidates[0] else os.path.join(cand, V2_PARENT)
        try:
            if base != cand:
                have = set(_read(os.path.join(cand, "cgroup.subtree_control")).split())
                if not set(wanted) <= have:
                    _write(os.path.join(cand, "cgroup.subtree_control"), plus)
                os.makedirs(base, exist_ok=True)
            have = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
            if not set(wanted) <= have:
                _write(os.path.join(base, "cgroup.subtree_control"), plus)
        except OSError:
            continue
        if _probe_dir(base, ["memory.max", "pids.max", "cgroup.procs"]):
            return CgroupSupport("v2", {c: base for c in wanted}, f"cgroup v2, sandboxes under {base}")
    return None


def _detect_v1(mounts: list[tuple[str, str, list[str]]], own: dict[str, str]) -> CgroupSupport | None:
    dirs = {}
    files = {"memory": "memory.limit_in_bytes", "pids": "pids.max", "cpu": "cpu.cfs_quota_us"}
    for ctrl in CONTROLLERS:
        for point, fstype, opts in mounts:
            if fstype == "cgroup" and ctrl in opts and ctrl in own:
                base = os.path.join(point, own[ctrl].lstrip("/"))
                if os.access(base, os.W_OK) and _probe_dir(base, [files[ctrl], "cgroup.procs"]):
                    dirs[ctrl] = base
                break
    if "memory" not in dirs or "pids" not in dirs:
        return None
    where = ", ".join(f"{c}: {d}" for c, d in dirs.items())
    return CgroupSupport("v1", dirs, f"cgroup v1, sandboxes under {where}")


@functools.lru_cache(maxsize=1)
def detect() -> CgroupSupport:
    """Where this process can give each sandbox its own memory/pids(/cpu) cgroup (cached)."""
    if os.environ.get("AGENTRL_SANDBOX_CGROUP") == "off":
        return CgroupSupport(note="disabled by AGENTRL_SANDBOX_CGROUP=off")
    try:
        own, mounts = _own_cgroups(), _mounts()
    except OSError as e:
        return CgroupSupport(note=f"cannot read this process's cgroups: {e}")
    for point, fstype, _ in mounts:
        if fstype == "cgroup2":
            found = _detect_v2(point, own.get("", "/"))
            if found:
                return found
    found = _detect_v1(mounts, own)
    if found:
        return found
    kinds = sorted({fstype for _, fstype, _ in mounts}) or ["none"]
    return CgroupSupport(
        note=f"no delegated cgroup with memory+pids controllers (mounted: {', '.join(kinds)}); "
        "run as root, under a systemd scope with Delegate=yes, or set AGENTRL_SANDBOX_CGROUP"
    )


class SandboxCgroup:
    """One sandbox's cgroup(s): limits, OOM-kill counter, membership, removal."""

    def __init__(self, support: CgroupSupport, name: str) -> None:
        self.version = support.version
        self.paths: dict[str, str] = {}
        for ctrl, parent in support.dirs.items():
            path = os.path.join(parent, name)
            if path not in self.paths.values():
                os.mkdir(path)
            self.paths[ctrl] = path

    def _dirs(self) -> list[str]:
        return sorted(set(self.paths.values()))

    def limit(self, *, memory_bytes: int, pids: int, cpus: float) -> None:
        mem, pid = self.paths["memory"], self.paths["pids"]
        if self.version == "v2":
            _write(os.path.join(mem, "memory.max"), str(memory_bytes))
            with contextlib.suppress(OSError):
                _write(os.path.join(mem, "memory.swap.max"), "0")
            _write(os.path.join(pid, "pids.max"), str(pids))
            if "cpu" in self.paths and cpus > 0:
                _write(os.path.join(self.paths["cpu"], "cpu.max"), f"{int(cpus * 100_000)} 100000")
            return
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        _write(os.path.join(pid, "pids.max"), str(pids))
        if "cpu" in self.paths and cpus > 0:
            _write(os.path.join(self.paths["cpu"], "cpu.cfs_period_us"), "100000")
            _write(os.path.join(self.paths["cpu"], "cpu.cfs_quota_us"), str(int(cpus * 100_000)))

    def add(self, pid: int) -> None:
        for d in self._dirs():
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def oom_kills(self) -> int | None:
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            text = _read(os.path.join(self.paths["memory"], name))
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def procs(self) -> list[int]:
        out: set[int] = set()
        for d in self._dirs():
            with contextlib.suppress(OSError):
                out.update(int(x) for x in _read(os.path.join(d, "cgroup.procs")).split())
        return sorted(out)

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill whatever is still inside and remove the cgroup(s); True when all are gone."""
        return remove_dirs(self._dirs(), timeout)


def remove_dirs(dirs: list[str], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    left = list(dirs)
    while left:
        for d in list(left):
            with contextlib.suppress(OSError):
                _write(os.path.join(d, "cgroup.kill"), "1")  # v2, kernel >= 5.14
            try:
                pids = [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
            except FileNotFoundError:
                left.remove(d)
                continue
            except OSError:
                pids = []
            for p in pids:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            try:
                os.rmdir(d)
                left.remove(d)
            except FileNotFoundError:
                left.remove(d)
            except OSError:
                pass
        if left:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    return True


def stale_dirs(everything: bool = False) -> list[str]:
    """Per-sandbox cgroups whose owner process is gone (all of ours with ``everything``)."""
    support = detect()
    out = []
    for parent in sorted(set(support.dirs.values())):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PREFIX) or not os.path.isdir(os.path.join(parent, name)):
                continue
            try:
                pid = int(name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if everything or not os.path.exists(f"/proc/{pid}"):
                out.append(os.path.join(parent, name))
    return out
