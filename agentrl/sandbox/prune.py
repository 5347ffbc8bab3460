"""Remove what killed runs left behind: labelled containers, local temp dirs, stray bwraps.

A sandbox belongs to the process named by its owner label (host, pid, process start
time).  It is an orphan when that process is gone — the start time guards against a
recycled pid.  Sandboxes of other hosts are left alone unless ``everything`` is asked for.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, field

from agentrl.sandbox.base import LABEL


@dataclass
class PruneReport:
    containers: list[str] = field(default_factory=list)
    temp_dirs: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    docker_note: str = ""

    def summary(self) -> str:
        line = (
            f"removed {len(self.containers)} container(s), {len(self.temp_dirs)} temp dir(s), "
            f"{len(self.processes)} stray sandbox process(es), {len(self.cgroups)} cgroup(s)"
        )
        return line + (f" ({self.docker_note})" if self.docker_note else "")


def owner_is_gone(owner: str) -> bool:
    """True when ``host:pid:start`` names a process of this host that no longer runs."""
    from agentrl.sandbox.docker import process_start_time

    try:
        host, pid, start = owner.rsplit(":", 2)
        pid_i = int(pid)
    except ValueError:
        return True  # unlabelled or malformed: nobody can claim it
    if host != socket.gethostname():
        return False
    return process_start_time(pid_i) != start or not start


def prune(*, everything: bool = False) -> PruneReport:
    """Remove orphaned sandboxes (all agentrl sandboxes with ``everything``)."""
    report = PruneReport()

    from agentrl.sandbox import why_unavailable

    why = why_unavailable("docker")
    if why is None:
        from agentrl.sandbox.docker import client

        for c in client().containers.list(all=True, filters={"label": LABEL}):
            if everything or owner_is_gone(c.labels.get("agentrl.owner", "")):
                try:
                    c.remove(force=True, v=True)
                    report.containers.append(c.name)
                except Exception:
                    pass  # already going away
    else:
        report.docker_note = f"docker skipped: {why}"

    for d in glob.glob(os.path.join(tempfile.gettempdir(), f"{LABEL}-*-*")):
        try:
            pid = int(os.path.basename(d).split("-")[1])
        except (IndexError, ValueError):
            continue
        alive = os.path.exists(f"/proc/{pid}")
        if everything or not alive:
            shutil.rmtree(d, ignore_errors=True)
            report.temp_dirs.append(d)

    # bwrap sandboxes die with their owner (--die-with-parent); one re-parented to init
    # means that guarantee failed somewhere, so kill it.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if argv and argv[0].endswith(b"bwrap") and b"/.agentrl/agent.py" in argv and (everything or ppid == 1):
            try:
                os.kill(int(name), signal.SIGKILL)
                report.processes.append(int(name))
            except OSError:
                pass

    # per-sandbox cgroups (bwrap) whose owner process is gone
    from agentrl.sandbox.cgroup import remove_dirs, stale_dirs

    for d in stale_dirs(everything=everything):
        if remove_dirs([d], timeout=2.0):
            report.cgroups.append(d)
    return report
