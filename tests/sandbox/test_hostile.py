"""Hostile code against the isolating backends (bwrap, docker).

Each attack must be contained: the call returns within its timeout plus a grace period,
with the right flag; the host and this test process are unaffected; and nothing of the
sandbox (process, container, temp dir) remains afterwards (module-level check in
conftest, plus a host-wide scan for the attacks' marker commands).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import threading

import pytest

from agentrl.sandbox import ExecResult, make_sandbox, why_unavailable

GRACE_S = 10.0  # wall-clock deadline beyond the exec timeout; a hang fails the test
MARK = "4242"  # `sleep 4242` marks attack processes so the host can be scanned for them


@pytest.fixture
async def sb(isolating_backend, limits):
    async with make_sandbox(isolating_backend, limits) as box:
        yield box
    assert host_processes_matching(f"sleep {MARK}") == []


async def run(box, cmd, *, timeout: float | None = None) -> ExecResult:
    limit = (timeout or box.limits.timeout_s) + GRACE_S
    return await asyncio.wait_for(box.exec(cmd, timeout=timeout), limit)


def host_processes_matching(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text in cmd and state not in (b"Z", b"X"):
                found.append(int(name))
    return found


def assert_host_fine() -> None:
    assert subprocess.run(["true"], timeout=10).returncode == 0  # we can still fork and exec


async def assert_sandbox_fine(box) -> None:
    r = await run(box, "echo fine")
    assert r.ok and r.stdout == "fine\n"


async def test_fork_bomb(sb):
    r = await run(sb, ["bash", "-c", ":(){ :|:& };:; sleep 30"], timeout=1.0)
    assert r.timed_out  # and every bomb process died with it (see the sb fixture / module check)
    counter = "import os,time\nn=0\ntry:\n while True:\n  if os.fork()==0:\n   time.sleep(60); os._exit(0)\n  n+=1\nexcept OSError as e:\n print(n, e.errno)"
    r = await run(sb, ["python3", "-c", counter])
    forked, errno_ = map(int, r.stdout.split())
    assert errno_ == 11 and forked <= sb.limits.pids + 2  # EAGAIN at the process limit
    assert_host_fine()
    await assert_sandbox_fine(sb)


async def test_memory_bomb(sb):
    r = await run(sb, ["python3", "-c", "x = []\nwhile True: x.append(bytearray(8 << 20))"])
    assert r.oom and not r.timed_out and r.exit_code != 0
    assert_host_fine()
    await assert_sandbox_fine(sb)


async def test_disk_fill(sb):
    # many 1 MiB files: the tmpfs size, not the per-file limit, is what must stop this
    n = sb.limits.disk_bytes // (1 << 20) * 2
    fill = (f"for d in . /tmp /dev/shm; do for i in $(seq {n}); do "
            "head -c 1048576 /dev/zero > $d/fill$i 2>/dev/null || { echo full $d; break; }; done; done; "
            "head -c 1 /dev/zero > /fill; du -sk . | cut -f1")  # fmt: skip
    r = await run(sb, fill)
    assert r.stdout.count("full") == 3 and "Read-only file system" in r.stderr
    assert int(r.stdout.split()[-1]) * 1024 <= sb.limits.disk_bytes
    r = await run(sb, "rm fill* && echo recovered > ok.txt && cat ok.txt")
    assert r.stdout == "recovered\n"
    assert_host_fine()


async def test_infinite_loop_hits_wall_timeout(isolating_backend, limits):
    lim = dataclasses.replace(limits, cpu_s=60)  # only the wall clock can stop it
    async with make_sandbox(isolating_backend, lim) as box:
        r = await run(box, ["python3", "-c", "while True: pass"], timeout=1.0)
        assert r.timed_out and not r.cpu_exceeded
        await assert_sandbox_fine(box)
    assert_host_fine()


async def test_cpu_spin_hits_cpu_limit(isolating_backend, limits):
    lim = dataclasses.replace(limits, cpu_s=1, timeout_s=30.0)  # only the CPU limit can stop it
    async with make_sandbox(isolating_backend, lim) as box:
        r = await run(box, ["python3", "-c", "while True: pass"])
        assert r.cpu_exceeded and not r.timed_out
        await assert_sandbox_fine(box)


class _Server:
    """A loopback TCP server that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


_CONNECT = (
    "import socket,sys\n"
    "for host in sys.argv[2:]:\n"
    "    try:\n"
    "        socket.create_connection((host, int(sys.argv[1])), timeout=1).close(); print('connected', host)\n"
    "    except OSError as e: print('blocked', host, e.errno)\n"
)


async def test_network_egress_is_blocked(sb):
    server = _Server()
    try:
        hosts = ["127.0.0.1", "localhost"]
        try:
            hosts.append(socket.gethostbyname(socket.gethostname()))
        except OSError:
            pass
        r = await run(sb, ["python3", "-c", _CONNECT, str(server.port), *hosts])
        assert r.stdout.count("blocked") == len(hosts) and "connected" not in r.stdout
        assert server.accepted == 0
    finally:
        server.close()


async def test_network_opt_in_reaches_the_same_server(limits):
    """The control for the test above: with network on, the very same probe connects."""
    why = why_unavailable("bwrap")  # only bwrap shares the host's own loopback when networked
    if why:
        pytest.skip(f"bwrap unavailable: {why}")
    server = _Server()
    try:
        async with make_sandbox("bwrap", dataclasses.replace(limits, network=True)) as box:
            r = await run(box, ["python3", "-c", _CONNECT, str(server.port), "127.0.0.1"])
        assert r.stdout.startswith("connected") and server.accepted == 1
    finally:
        server.close()


async def test_host_files_outside_workdir(sb, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    repo_file = os.path.abspath("pyproject.toml")
    r = await run(sb, f"cat {secret}; cat {repo_file}; cat /etc/shadow; ls /root; "
                      f"echo owned > {secret}; echo owned > {tmp_path}/new.txt; "
                      "touch /usr/owned /etc/owned /owned; echo done")  # fmt: skip
    assert "host secret" not in r.stdout and "[project]" not in r.stdout and "root:" not in r.stdout
    assert r.stdout.endswith("done\n")
    assert secret.read_text() == "host secret"
    assert not (tmp_path / "new.txt").exists()
    assert not any(os.path.exists(p) for p in ("/usr/owned", "/etc/owned", "/owned"))


async def test_kill_host_process_by_pid(sb):
    victim = subprocess.Popen(["sleep", "300"])
    try:
        pid = victim.pid
        r = await run(sb, f"kill -9 {pid}; python3 -c 'import os; os.kill({pid}, 9)'; kill -9 -1; echo tried")
        assert "tried" in r.stdout
        assert victim.poll() is None  # still running
        assert_host_fine()
        await assert_sandbox_fine(sb)
    finally:
        victim.kill()
        victim.wait()


async def test_100mb_of_output(sb):
    r = await run(sb, "head -c 100000000 /dev/zero | tr '\\0' x; head -c 100000000 /dev/zero >&2")
    assert r.ok and r.stdout_truncated and r.stderr_truncated
    assert len(r.stdout) == sb.limits.output_bytes and set(r.stdout) == {"x"}
    await assert_sandbox_fine(sb)


async def test_sleep_past_timeout_with_children_ignoring_sigterm(sb):
    cmd = f"trap '' TERM; for i in 1 2 3; do (trap '' TERM; exec sleep {MARK}) & done; exec sleep {MARK}"
    r = await run(sb, ["bash", "-c", cmd], timeout=1.0)
    assert r.timed_out
    assert host_processes_matching(f"sleep {MARK}") == []
    await assert_sandbox_fine(sb)
