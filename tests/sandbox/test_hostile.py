"""Hostile code against the isolating backends (bwrap, docker).

Each attack must be contained: the call returns within its timeout plus a grace period,
with the right flag; the host and this test process are unaffected; and nothing of the
sandbox (process, container, temp dir) remains afterwards (module-level check in
conftest, plus a host-wide scan for the attacks' marker commands).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import threading

import pytest
from procs import processes_matching

from agentrl.sandbox import ExecResult, SandboxError, SandboxPool, make_sandbox, why_unavailable

GRACE_S = 10.0  # wall-clock deadline beyond the exec timeout; a hang fails the test
MARK = "4242"  # `sleep 4242` marks attack processes so the host can be scanned for them


@pytest.fixture
async def sb(isolating_backend, limits):
    async with make_sandbox(isolating_backend, limits) as box:
        yield box
    assert processes_matching(f"sleep {MARK}") == []


async def run(box, cmd, *, timeout: float | None = None) -> ExecResult:
    limit = (timeout or box.limits.timeout_s) + GRACE_S
    return await asyncio.wait_for(box.exec(cmd, timeout=timeout), limit)


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


async def test_memory_bomb(isolating_backend, limits):
    lim = dataclasses.replace(limits, cpu_s=10)  # only memory can stop it, even on a loaded machine
    async with make_sandbox(isolating_backend, lim) as sb:
        r = await run(sb, ["python3", "-c", "x = []\nwhile True: x.append(bytearray(8 << 20))"])
        if sb._memory_cgroup():
            assert r.oom and r.signal == signal.SIGKILL  # the kernel's OOM killer, seen in the cgroup
        else:  # per-process address space: the allocation fails, the kernel kills nothing
            assert not r.oom and "MemoryError" in r.stderr
        assert not r.timed_out and r.exit_code != 0
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
    assert processes_matching(f"sleep {MARK}") == []
    await assert_sandbox_fine(sb)


# ----------------------------------------------------------------------------- limits per sandbox


async def test_limits_hold_for_the_sandbox_not_each_process(isolating_backend, limits):
    """memfd, SysV shm and many processes each under the per-process limit: the total is capped."""
    lim = dataclasses.replace(limits, cpu_s=10, timeout_s=20.0)
    async with make_sandbox(isolating_backend, lim) as sb:
        if not sb._memory_cgroup():
            pytest.skip("no memory cgroup on this host: per-process limits only (see sandbox doctor)")
        # each memfd stops at RLIMIT_FSIZE; an attacker simply opens the next one
        memfd = ("import os\nfds = [os.memfd_create('x')]\nchunk = b'x' * (4 << 20)\nwhile True:\n"
                 "    try: os.write(fds[-1], chunk)\n    except OSError: fds.append(os.memfd_create('x'))")  # fmt: skip
        r = await run(sb, ["python3", "-c", memfd])
        assert r.oom, r  # memfd pages are charged to the sandbox's memory cgroup
        shm = ("import ctypes, ctypes.util\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "libc.shmat.restype = ctypes.c_void_p\nsegs = []\nwhile True:\n"
               "    i = libc.shmget(0, 32 << 20, 0o1600)\n"
               "    if i < 0: print('shmget', ctypes.get_errno()); break\n"
               "    a = libc.shmat(i, None, 0); ctypes.memset(a, 1, 32 << 20); segs.append(a)")  # fmt: skip
        r = await run(sb, ["python3", "-c", shm])
        assert r.oom, r  # SysV shm too
        many = f"for i in $(seq 12); do python3 -c 'x = bytearray({lim.memory_bytes // 4}); import time; time.sleep(3)' & done; wait"
        r = await run(sb, ["bash", "-c", many], timeout=15.0)
        assert r.oom, r  # 12 x (memory/4) cannot all fit
        await assert_sandbox_fine(sb)
    assert_host_fine()


# memory no process maps (memfds), after the command lowered its own oom_score_adj from the 1000
# the sandbox gave it back to 0: the OOM killer then weighs the agent (the largest RSS) first
OOM_THE_AGENT = ("import os\nopen('/proc/self/oom_score_adj', 'w').write('0')\n"
                 "fds = [os.memfd_create('x')]\nchunk = b'x' * (4 << 20)\nwhile True:\n"
                 "    try: os.write(fds[-1], chunk)\n    except OSError: fds.append(os.memfd_create('x'))")  # fmt: skip


async def test_an_oom_that_takes_the_agent_is_still_the_commands_oom(isolating_backend, limits):
    """The attack: make the OOM killer take the sandbox's agent instead of the command.  The exec
    raised SandboxError (kind ``sandbox``: the episode left its group, untrained): running out of
    memory on purpose escaped a wrong answer.  bwrap: the cgroup's OOM-kill counter moved during the
    exec; docker: the container's pid 1 died of a SIGKILL agentrl did not send.  Either way it is the
    command's ``oom`` (a counted failure); the broken sandbox is replaced by the pool."""
    lim = dataclasses.replace(limits, timeout_s=20.0, cpu_s=10)
    async with SandboxPool(isolating_backend, lim, max_live=1) as pool:
        async with pool.acquire() as sb:
            if not sb._memory_cgroup():
                pytest.skip("no memory cgroup on this host: an allocation fails instead (see sandbox doctor)")
            r = await run(sb, ["python3", "-c", OOM_THE_AGENT])
            assert r.oom and r.exit_code == 128 + signal.SIGKILL and not r.ok, r
            if sb.alive:
                pytest.skip("the OOM killer took the command, not the agent, on this kernel: nothing to replace")
            assert "ran out of memory" in r.stderr and "[killed: out of memory]" in r.as_text()
            with pytest.raises(SandboxError):
                await sb.exec("echo more")  # gone for good
        assert pool.stats.destroyed == 1
        async with pool.acquire() as fresh:
            assert fresh is not sb
            await assert_sandbox_fine(fresh)
    assert_host_fine()


@pytest.mark.docker
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
async def test_an_agent_killed_from_outside_is_the_sandboxes_failure_not_an_oom(limits, sig):
    """The other side of the OOM rule: a container stopped by a signal, with no OOM kill, stays a
    sandbox error (the episode is not the command's failure).  A SIGKILL from outside reads as an
    OOM only where the engine cannot tell (podman: exit 137, OOMKilled false, see _killed_by_sigkill)."""
    from agentrl.sandbox.docker import _is_podman, client

    if why_unavailable("docker"):
        pytest.skip("docker unavailable")
    async with make_sandbox("docker", limits) as sb:
        job = asyncio.ensure_future(sb.exec(["sleep", "2"]))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(client().api.kill, sb._cid, sig)
        if sig == "SIGKILL" and _is_podman():
            r = await job
            assert r.oom, r
        else:
            with pytest.raises(SandboxError, match="container agent gone"):
                await job
        assert not sb.alive


async def test_inode_bomb_stops_at_the_file_limit(isolating_backend, limits):
    lim = dataclasses.replace(limits, files=2000)
    async with make_sandbox(isolating_backend, lim) as sb:
        fill = ("import os\nfor d in ('.', '/tmp', '/dev/shm'):\n  n = 0\n  try:\n"
                "    while n < 300000: open(f'{d}/f{n}', 'w').close(); n += 1\n"
                "  except OSError as e: print(d, n, e.errno)")  # fmt: skip
        r = await run(sb, ["python3", "-c", fill], timeout=30.0)
        counts = [int(line.split()[1]) for line in r.stdout.splitlines()]
        assert len(counts) == 3 and all(c < lim.files for c in counts), r  # ENOSPC long before 300k
        await sb.reset()
        await assert_sandbox_fine(sb)


# ----------------------------------------------------------------------------- kernel surface

_SYSCALLS = r"""
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": dict(unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, clone=56,
                     clone3=435, io_uring_setup=425, keyctl=250, add_key=248, request_key=249, bpf=321,
                     perf_event_open=298, userfaultfd=323, open_tree=428, fsopen=430, init_module=175,
                     kexec_load=246, socket=41),
      "aarch64": dict(unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, clone=220,
                      clone3=435, io_uring_setup=425, keyctl=219, add_key=217, request_key=218, bpf=280,
                      perf_event_open=241, userfaultfd=282, open_tree=428, fsopen=430, init_module=105,
                      kexec_load=104, socket=198)}[platform.machine()]
def call(name, *args):
    r = libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])
    return errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ALLOWED"
buf = ctypes.create_string_buffer(256)
print("unshare_user", call("unshare", 0x10000000))
print("unshare_mnt", call("unshare", 0x00020000))
print("unshare_net", call("unshare", 0x40000000))
print("setns", call("setns", os.open("/proc/self/ns/user", os.O_RDONLY), 0))
print("mount", call("mount", 0, ctypes.addressof(buf), 0, 0, 0))
print("umount2", call("umount2", ctypes.addressof(buf), 0))
print("pivot_root", call("pivot_root", 0, 0))
print("chroot", call("chroot", ctypes.addressof(buf)))
print("clone_newuser", call("clone", 0x10000000 | 17, 0, 0, 0, 0))
print("clone_newns", call("clone", 0x00020000 | 17, 0, 0, 0, 0))
print("clone3", call("clone3", ctypes.addressof(buf), 88))
print("io_uring_setup", call("io_uring_setup", 8, ctypes.addressof(buf)))
print("keyctl", call("keyctl", 0, 0, 0, 0, 0))
print("add_key", call("add_key", 0, 0, 0, 0, 0))
print("request_key", call("request_key", 0, 0, 0, 0))
print("bpf", call("bpf", 0, ctypes.addressof(buf), 48))
print("perf_event_open", call("perf_event_open", ctypes.addressof(buf), 0, -1, -1, 0))
print("userfaultfd", call("userfaultfd", 0))
print("open_tree", call("open_tree", -100, ctypes.addressof(buf), 0))
print("fsopen", call("fsopen", ctypes.addressof(buf), 0))
print("init_module", call("init_module", 0, 0, 0))
print("kexec_load", call("kexec_load", 0, 0, 0, 0))
print("netlink_netfilter", call("socket", 16, 3, 12))
print("packet", call("socket", 17, 3, 0))
print("vsock", call("socket", 40, 1, 0))
print("family_high_bits", call("socket", (1 << 32) | 17, 3, 0))
print("netlink_route", call("socket", 16, 3, 0))
print("inet", call("socket", 2, 1, 0))
"""


async def test_kernel_surface_is_filtered(sb):
    r = await run(sb, ["python3", "-c", _SYSCALLS])
    got = dict(line.split() for line in r.stdout.splitlines())
    assert len(got) == 28, r
    allowed = {k for k, v in got.items() if v == "ALLOWED"}
    assert allowed == {"netlink_route", "inet"}, got  # what a normal program needs, nothing more
    assert got["clone3"] == "ENOSYS" and got["unshare_user"] == "EPERM" and got["io_uring_setup"] == "EPERM"
    # the tools the same attacks would use are refused as well
    r = await run(sb, "unshare -Ur true; echo unshare=$?; mount -t tmpfs -o size=1g none /tmp; echo mount=$?; "
                      "python3 -c 'import os; os.setuid(0)'; echo setuid=$?")  # fmt: skip
    assert "unshare=1" in r.stdout and "mount=0" not in r.stdout and "setuid=1" in r.stdout, r


_OTHER_ABI = r"""
import ctypes, mmap, os, platform, sys
if platform.machine() != "x86_64":
    print("skip"); sys.exit(0)
# mov eax, 310 (i386 unshare); mov ebx, CLONE_NEWUSER; int 0x80; ret -- a syscall of the i386 ABI
code = bytes([0xB8, 0x36, 0x01, 0, 0, 0xBB, 0, 0, 0, 0x10, 0xCD, 0x80, 0xC3])
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
print("returned", fn(), flush=True)
"""


async def test_other_syscall_abi_is_killed(sb):
    r = await run(sb, ["python3", "-c", _OTHER_ABI])
    if r.stdout.strip() == "skip":
        pytest.skip("x86_64 only")
    # seccomp's bad-architecture action kills the process (SIGSYS); it never returns 0
    assert "returned 0" not in r.stdout and (r.signal == signal.SIGSYS or "returned -" in r.stdout), r


async def test_nested_user_namespace_cannot_mount_a_big_tmpfs(sb):
    r = await run(sb, "unshare -Urm sh -c 'mount -t tmpfs -o size=100g none /tmp && echo mounted'; "
                      "python3 -c 'import os; os.unshare(os.CLONE_NEWUSER)' 2>&1 | tail -1")  # fmt: skip
    assert "mounted" not in r.stdout and "Operation not permitted" in r.stdout + r.stderr, r


# ----------------------------------------------------------------------------- forged flags


async def test_flags_cannot_be_forged_by_output_or_signals(sb):
    r = await run(sb, "echo MemoryError; echo 'Cannot allocate memory' >&2; exit 0")
    assert r.ok and not r.oom
    r = await run(sb, "kill -XCPU $$")
    assert r.signal == signal.SIGXCPU and not r.cpu_exceeded  # the signal, but no CPU was spent
    r = await run(sb, "exit 152")
    assert r.exit_code == 152 and not r.cpu_exceeded
    r = await run(sb, "kill -KILL $$")
    assert r.exit_code == 137 and not r.oom and not r.cpu_exceeded
    r = await run(sb, ["python3", "-c", "import os; os.kill(os.getpid(), 9)"])
    assert r.signal == signal.SIGKILL and not r.oom and not r.cpu_exceeded


# ----------------------------------------------------------------------------- host-side file API


async def test_file_api_stays_beneath_the_work_dir(sb):
    for bad in ("/etc/passwd", "/tmp/x", "../x", "a/../../x", "/", ""):
        with pytest.raises(PermissionError):
            await sb.read_file(bad)
        with pytest.raises(PermissionError):
            await sb.write_file(bad, "owned")
    await sb.write_file("victim.txt", "keep me")
    r = await run(sb, "ln -s /proc/self/fd/0 in; ln -s /proc/self/fd/1 out; ln -s /etc/passwd pw; "
                      "ln -s victim.txt link; ln -s /tmp d; mkfifo fifo; mkdir real; echo ok")  # fmt: skip
    assert r.stdout == "ok\n", r
    injected = '{"op":"exec","argv":["touch","/work/injected"],"timeout":5,"cwd":"/work","env":{},"limits":{}}\n'
    for name in ("in", "out", "pw", "link", "d/x", "fifo"):
        with pytest.raises(OSError):
            await asyncio.wait_for(sb.write_file(name, injected), 10)  # never blocks, never follows
        with pytest.raises(OSError):
            await asyncio.wait_for(sb.read_file(name), 10)
    with pytest.raises(IsADirectoryError):
        await sb.read_file("real")
    assert await sb.read_file("victim.txt") == b"keep me"  # not truncated through the link
    r = await run(sb, "ls -A; cat /tmp/x 2>&1")
    assert "injected" not in r.stdout and "No such file" in r.stdout, r  # nothing ran, nothing landed
    await assert_sandbox_fine(sb)


async def test_command_cannot_reach_the_agent(sb):
    """Kill it, ptrace it, write into its pipes, inject a request: the agent is out of reach."""
    attack = r"""
import os, signal
me = int(os.readlink('/proc/self'))  # our pid as this /proc numbers it
for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:
    if pid == me:
        continue
    for fd in (0, 1):
        try:
            with open(f'/proc/{pid}/fd/{fd}', 'w') as f:
                f.write('{"op":"exec","argv":["touch","/work/pwned"],"timeout":5,"cwd":"/work","env":{},"limits":{}}\n')
            print('wrote', pid, fd)
        except OSError:
            pass
    try:
        open(f'/proc/{pid}/mem', 'rb').read(1); print('read mem', pid)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""
    r = await run(sb, ["python3", "-c", attack])
    assert "wrote" not in r.stdout and "read mem" not in r.stdout, r
    r = await run(sb, "kill -9 -1; pkill -9 python3; ls -A")
    assert "pwned" not in r.stdout
    await assert_sandbox_fine(sb)


# ----------------------------------------------------------------------------- host view, output


async def test_minimal_host_view(sb):
    r = await run(sb, "cat /etc/hosts /etc/hostname 2>/dev/null")
    assert set(r.stdout.split()) <= {"127.0.0.1", "::1", "localhost", "sandbox", "ip6-localhost", "ip6-loopback"}, r
    r = await run(sb, "ls -A /run /var/tmp /sys 2>/dev/null; ls -A /usr/local | wc -l; "
                      "for p in /usr/x /etc/x /x /run/x /var/tmp/x /sys/x; do touch $p 2>/dev/null && echo wrote $p; done; true")  # fmt: skip
    lines = r.stdout.split()
    assert "wrote" not in lines, r  # nothing writable but the three tmpfs
    if sb.backend == "bwrap":  # the host's /usr/local (site config, pip installs) is not shown
        assert lines == ["0"], r
    r = await run(sb, "ls -A /proc | grep -c '^[0-9]'")
    assert int(r.stdout) < 12, r  # a handful of sandbox processes, none of the host's


async def test_control_sequences_are_escaped_in_text(sb):
    r = await run(sb, ["python3", "-c", r"print('a\x00b\x1b]0;owned\x07c\x1b[2Jd\re\u202ef\x9bg')"])
    text = r.as_text()
    assert not any(ch in text for ch in "\x00\x1b\x07\r\u202e\x9b"), repr(text)
    assert "\\x1b]0;owned\\x07" in text and "\\u202e" in text
    assert r.stdout.startswith("a\x00b\x1b")  # the raw bytes stay available to code that wants them


# ----------------------------------------------------------------------------- network


def _abstract_server(name: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(b"\0" + name)
    s.listen(4)
    return s


_NET_PROBE = r"""
import socket, sys
port, name = int(sys.argv[1]), sys.argv[2]
for host in ("127.0.0.1", "10.0.2.2", "localhost"):
    try:
        socket.create_connection((host, port), timeout=2).close(); print("connected", host)
    except OSError as e:
        print("blocked", host, e.errno)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(b"\0" + name.encode()); print("connected abstract")
except OSError as e:
    print("blocked abstract", e.errno)
print("ifaces", " ".join(n for _, n in socket.if_nameindex()))
"""


async def test_network_opt_in_is_its_own_namespace(isolating_backend, limits):
    """network=True: an interface of its own; the host's loopback and abstract sockets stay out of reach."""
    server, name = _Server(), f"agentrl-test-{os.getpid()}".encode()
    abstract = _abstract_server(name)
    try:
        try:
            box = make_sandbox(isolating_backend, dataclasses.replace(limits, network=True))
            await box.start()
        except SandboxError as e:
            pytest.skip(f"network=True unavailable here: {e}")
        try:
            r = await run(box, ["python3", "-c", _NET_PROBE, str(server.port), name.decode()], timeout=20.0)
        finally:
            await box.close()
        assert "connected" not in r.stdout and r.stdout.count("blocked") == 4, r
        ifaces = r.stdout.split("ifaces")[1].split()
        assert "lo" in ifaces and len(ifaces) == 2  # its own NAT'd interface
        assert server.accepted == 0
    finally:
        server.close()
        abstract.close()


_OUTBOUND = r"""
import asyncio, os, socket, subprocess, sys, threading
from agentrl.sandbox import SandboxLimits, make_sandbox
# a world of our own: a fresh network namespace whose only address (TEST-NET-1, on lo) plays
# "the internet"; the sandbox's user-mode NAT runs in it, so nothing here touches a real network
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "192.0.2.1/32", "dev", "lo"], check=True)
srv = socket.socket(); srv.bind(("0.0.0.0", 0)); srv.listen(8); port = srv.getsockname()[1]
threading.Thread(target=lambda: [srv.accept()[0].sendall(b"hello\n") for _ in range(8)], daemon=True).start()
probe = ("import socket, sys\nfor h in ('192.0.2.1', '127.0.0.1', '10.0.2.2'):\n"
         "  try: print(h, socket.create_connection((h, int(sys.argv[1])), timeout=2).recv(10))\n"
         "  except OSError as e: print(h, 'blocked')")
async def main():
    async with make_sandbox("bwrap", SandboxLimits(network=True, timeout_s=20)) as sb:
        print((await sb.exec(["python3", "-c", probe, str(port)])).stdout)
asyncio.run(main())
"""


async def test_network_opt_in_reaches_outward_but_not_the_host(limits):
    """Outbound works (to a server in a network namespace this test makes), the host loopback does not."""
    import shutil
    import sys

    if why_unavailable("bwrap") or not shutil.which("unshare") or not shutil.which("ip") or os.geteuid() != 0:
        pytest.skip("needs bwrap, root, unshare and ip to build a private network namespace")
    from agentrl.sandbox.bwrap import slirp_path

    if not slirp_path():
        pytest.skip("slirp4netns not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    p = await asyncio.create_subprocess_exec("unshare", "--net", sys.executable, "-c", _OUTBOUND, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(p.communicate(), 60)
    text = out.decode()
    assert "192.0.2.1 b'hello\\n'" in text, (text, err.decode()[-2000:])
    assert "127.0.0.1 blocked" in text and "10.0.2.2 blocked" in text, text


# ----------------------------------------------------------------------------- fail closed


async def test_no_isolation_means_no_sandbox(limits, monkeypatch):
    """If commands cannot be put in namespaces (here: user namespaces switched off inside the
    sandbox) the sandbox refuses to start instead of running commands unwrapped."""
    if why_unavailable("bwrap"):
        pytest.skip("bwrap unavailable")
    from agentrl.sandbox.bwrap import BwrapSandbox

    original = BwrapSandbox._argv

    def no_userns(self, fds):
        a = original(self, fds)
        return a[:1] + ["--disable-userns"] + a[1:]

    monkeypatch.setattr(BwrapSandbox, "_argv", no_userns)
    box = make_sandbox("bwrap", limits)
    with pytest.raises(SandboxError, match="unshare"):
        await box.start()
    assert not box.alive


async def test_no_seccomp_filter_means_no_sandbox(isolating_backend, limits, monkeypatch):
    from agentrl.sandbox import seccomp

    def missing():
        raise seccomp.SeccompUnavailable("libseccomp not found (test)")

    monkeypatch.setattr(seccomp, "filter_bpf", missing)
    box = make_sandbox(isolating_backend, limits)
    with pytest.raises(SandboxError, match="seccomp"):
        await box.start()
    assert not box.alive


def test_local_backend_warns_when_created(limits):
    from agentrl.sandbox.local import UnsafeSandboxWarning

    with pytest.warns(UnsafeSandboxWarning, match="NOT a security boundary"):
        box = make_sandbox("local", limits)
    asyncio.run(box.close())


# ----------------------------------------------------------------------------- one episode, the next

_ATTACKER = r"""
set -u
site=$(python3 -c 'import site; print(site.getusersitepackages())')
mkdir -p "$site" && echo 'print("PWNED by usercustomize")' > "$site/usercustomize.py"
echo 'echo PWNED by bashrc' > ~/.bashrc; cp ~/.bashrc ~/.profile
mkdir -p locked/deep/deeper && touch locked/deep/deeper/f locked/f && chmod 000 locked/deep/deeper locked/deep && chmod 555 locked
mkdir -p /tmp/ro && touch /tmp/ro/f && chmod 000 /tmp/ro /tmp
touch "$(printf 'new\nline')" "$(printf '\033[2Jesc')" /dev/shm/shm-file
mkfifo fifo; ln -s /proc/self/fd/1 out; ln -s /etc/passwd passwd
python3 -c "
import os
for _ in range(3000):  # deeper than any recursion limit
    os.mkdir('d'); os.chdir('d')
open('bottom', 'w').write('x')
"
ipcmk -M 65536 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 2 >/dev/null
python3 -c "
import ctypes
rt = ctypes.CDLL('librt.so.1', use_errno=True)
print('mq', rt.mq_open(b'/agentrl-evil', 0o102, 0o600, None))
"
echo ipc: $(ipcs -m -q -s | grep -c 0x)
(setsid sh -c 'exec sleep 4242' &)
chmod 000 .
echo planted
"""

_VICTIM = r"""
cd /work
echo "work: $(ls -A /work | wc -l) tmp: $(ls -A /tmp | wc -l) shm: $(ls -A /dev/shm | wc -l)"
echo "modes: $(stat -c %a /work /tmp /dev/shm | tr '\n' ' ')"
python3 -c 'print("python ok")'
bash -ic 'echo bash ok' 2>/dev/null
echo "ipc: $(ipcs -m -q -s | grep -c 0x)"
python3 -c "
import ctypes
rt = ctypes.CDLL('librt.so.1', use_errno=True)
print('mq', rt.mq_open(b'/agentrl-evil', 0o2, 0o600, None), ctypes.get_errno())
"
touch /work/mine /tmp/mine && echo writable
"""


async def test_pool_attacker_then_victim_sees_a_clean_sandbox(isolating_backend, limits):
    lim = dataclasses.replace(limits, timeout_s=20.0, cpu_s=10)
    async with SandboxPool(isolating_backend, lim, max_live=1) as pool:
        async with pool.acquire() as attacker:
            r = await run(attacker, ["bash", "-c", _ATTACKER])
            assert r.stdout.rstrip().endswith("planted") and "ipc: 3" in r.stdout and "mq 3" in r.stdout, r
            r = await run(attacker, "chmod 755 /work; echo ipc: $(ipcs -m -q -s | grep -c 0x)")
            assert "ipc: 0" in r.stdout, r  # IPC objects died with the exec that made them
            await run(attacker, "chmod 000 /work")
        async with pool.acquire() as victim:
            assert victim is attacker and pool.stats.reused == 1  # the same sandbox, reset
            r = await run(victim, ["bash", "-c", _VICTIM])
    lines = r.stdout.splitlines()
    assert lines[0] == "work: 0 tmp: 0 shm: 0", r
    assert lines[1] == "modes: 755 1777 1777 ", r
    assert "PWNED" not in r.stdout + r.stderr and "python ok" in lines and "bash ok" in lines, r
    assert "ipc: 0" in lines and "mq -1 2" in lines and lines[-1] == "writable", r  # ENOENT: the queue is gone
    assert processes_matching(f"sleep {MARK}") == []


async def test_reset_that_cannot_prove_clean_destroys_the_sandbox(isolating_backend, limits, monkeypatch):
    """Anything the reset cannot remove (here: the agent's own read-only dir, added to the
    list) fails the verification; the pool destroys that sandbox and makes a new one."""
    async with SandboxPool(isolating_backend, limits, max_live=1) as pool:
        async with pool.acquire() as first:
            monkeypatch.setattr(first, "_reset_dirs", lambda: ["/work", "/tmp", "/dev/shm", "/.agentrl"])
        assert not first.alive and pool.stats.destroyed == 1
        async with pool.acquire() as second:
            assert second is not first and (await run(second, "echo fresh")).stdout == "fresh\n"
        with pytest.raises(SandboxError):
            await first.reset()  # destroyed for good


# ----------------------------------------------------------------------------- socket pairs, the agent's pipes

_SOCKETPAIR = r"""
import socket
# family, type, protocol: vsock, packet, XDP, key, alg, bluetooth, netlink (netfilter and route), inet
for fam, typ, proto in ((40, 1, 0), (17, 3, 0), (44, 3, 0), (15, 3, 2), (38, 5, 0), (31, 1, 0),
                        (16, 3, 12), (16, 3, 0), (2, 1, 0), (10, 1, 0)):
    try:
        socket.socket(fam, typ, proto).close(); single = 0
    except OSError as e:
        single = e.errno
    try:
        a, b = socket.socketpair(fam, typ, proto); a.close(); b.close(); pair = 0
    except OSError as e:
        pair = e.errno
    print(fam, proto, single, pair)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM); a.sendall(b"hi"); print("unix", b.recv(2).decode())
"""


async def test_socketpair_is_filtered_like_socket(sb):
    """socketpair() runs the family's own socket code before finding it has no pairs: it gets
    the same family filter as socket() (and the same errno), and only AF_UNIX gets through."""
    import errno

    r = await run(sb, ["python3", "-c", _SOCKETPAIR])
    lines = r.stdout.splitlines()
    assert lines[-1] == "unix hi", r
    rows = [tuple(map(int, line.split())) for line in lines[:-1]]
    assert len(rows) == 10, r
    for fam, proto, single, pair in rows:
        if single:  # socket() refused by the filter: the pair gets the same answer
            assert single in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT) and pair == single, (fam, proto, r.stdout)
        else:  # inet, inet6, netlink route: no pairs in the kernel, refused before their code runs
            assert (fam, proto) in ((2, 0), (10, 0), (16, 0)) and pair == errno.EOPNOTSUPP, (fam, proto, r.stdout)


_PROC_ONE = r"""
import os
for pid in sorted({"1", *(p for p in os.listdir("/proc") if p.isdigit())}, key=int):
    if pid == os.readlink("/proc/self"):
        continue
    for fd in (0, 1, 2):
        for mode in (os.O_RDONLY, os.O_WRONLY | os.O_NONBLOCK):
            try:
                os.close(os.open(f"/proc/{pid}/fd/{fd}", mode)); print("opened", pid, fd, mode)
            except OSError:
                pass
print("done")
"""


async def test_proc_1_fds_cannot_be_opened(sb):
    """/proc/1/fd/0 is the host's request pipe under bwrap (pid 1 is bwrap's init) and the
    attach stream under docker (pid 1 is the agent): not openable, read or write, nor any
    other process's standard fds but the command's own."""
    r = await run(sb, ["python3", "-c", _PROC_ONE])
    assert r.stdout == "done\n", r


# ----------------------------------------------------------------------------- the writable roots themselves

_MARK_ROOTS = r"""
import os, struct, sys
roots = ("/work", "/tmp", "/dev/shm")
print("before", *(os.stat(d).st_mtime_ns for d in roots))
uid = os.getuid()  # an ACL naming ourselves: a system.posix_acl_access xattr that chmod keeps
acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, i) for tag, perm, i in
                                      ((1, 7, 0xFFFFFFFF), (2, 7, uid), (4, 5, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)))
for d in roots[int(sys.argv[1]):]:
    for i in range(8):  # a message for the next episode, in the directory's own metadata
        os.setxattr(d, f"user.note{i}", b"x" * 4000)
    try:
        os.setxattr(d, "system.posix_acl_access", acl)
    except OSError:
        pass  # no ACLs on this tmpfs
    os.utime(d, ns=(10**18, 10**18))
print("marked", *(len(os.listxattr(d)) for d in roots))
"""

_READ_ROOTS = r"""
import os
roots = ("/work", "/tmp", "/dev/shm")
print("after", *(os.stat(d).st_mtime_ns for d in roots))
print("xattrs", *(len(os.listxattr(d)) for d in roots))
"""


async def test_reset_clears_xattrs_and_times_of_the_writable_roots(isolating_backend, limits):
    """Extended attributes and times of /work, /tmp and /dev/shm themselves (which no file
    removal touches) do not reach the next episode of a pooled sandbox."""
    async with SandboxPool(isolating_backend, limits, max_live=1) as pool:
        async with pool.acquire() as attacker:
            r = await run(attacker, ["python3", "-c", _MARK_ROOTS, "0"])
            before = r.stdout.splitlines()[0].split()[1:]
            marked = [int(n) for n in r.stdout.splitlines()[1].split()[1:]]
            assert len(before) == 3 and all(n >= 8 for n in marked), r
        async with pool.acquire() as victim:
            assert victim is attacker and pool.stats.reused == 1
            r = await run(victim, ["python3", "-c", _READ_ROOTS])
    after, xattrs = (line.split()[1:] for line in r.stdout.splitlines())
    assert xattrs == ["0", "0", "0"], r
    assert after == before, r  # the modification times as mounted, not the planted ones


@pytest.mark.parametrize("kind", ["xattr", "mtime"])
async def test_reset_fails_when_a_root_keeps_its_marks(isolating_backend, limits, monkeypatch, kind):
    """The check covers every writable root, not only those the reset cleaned: a root left
    out of the cleaning (here /dev/shm) with an xattr or a planted time fails it, and the
    pool destroys the sandbox instead of reusing it."""
    mark = "os.setxattr('/dev/shm', 'user.x', b'1')" if kind == "xattr" else "os.utime('/dev/shm', (1e9, 1e9))"
    async with SandboxPool(isolating_backend, limits, max_live=1) as pool:
        async with pool.acquire() as first:
            monkeypatch.setattr(first, "_reset_dirs", lambda: ["/work", "/tmp"])
            r = await run(first, ["python3", "-c", f"import os; {mark}; print('marked')"])
            assert r.stdout == "marked\n", r
        assert not first.alive and pool.stats.destroyed == 1 and pool.stats.reused == 0
        assert "reset could not clean" in first._broken and "/dev/shm" in first._broken, first._broken


# ----------------------------------------------------------------------------- per-user kernel counters

_EXHAUST = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
libc.sigqueue.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
def until_error(make, most):
    for n in range(most):
        if make(n) < 0:
            return n, ctypes.get_errno()
    return most, 0
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})  # queued, never delivered
print("inotify", *until_error(lambda i: libc.inotify_init(), 200))
print("mqueue", *until_error(lambda i: rt.mq_open(f"/q{i}".encode(), 0o102, 0o600, None), 200))
print("sigqueue", *until_error(lambda i: libc.sigqueue(os.getpid(), signal.SIGRTMIN, None), 10**6), flush=True)
os.execvp("sleep", ["sleep", sys.argv[1]])  # holds them all (fds, queues, pending signals) until killed
"""

_CREATE_ONE = r"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
libc.sigqueue.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
def err(r):
    return 0 if r >= 0 else ctypes.get_errno()
print("inotify", err(libc.inotify_init()))
name = f"/agentrl-probe-{os.getpid()}".encode()
print("mqueue", err(rt.mq_open(name, 0o102, 0o600, None)))
rt.mq_unlink(name)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
print("sigqueue", err(libc.sigqueue(os.getpid(), signal.SIGRTMIN, None)))
"""


def _formerly_shared_uid(backend: str) -> int:
    """The host uid every sandbox of this backend used to run as."""
    if backend == "docker":
        return 65532
    return 65534 if os.geteuid() == 0 else os.getuid()


async def test_one_sandbox_cannot_exhaust_per_user_kernel_counters(isolating_backend, limits):
    """inotify instances, message-queue bytes and queued signals are counted per host user:
    one sandbox using up all it can leaves another sandbox, and host processes of the uid
    sandboxes used to share, able to create each."""
    import shutil

    lim = dataclasses.replace(limits, timeout_s=60.0)
    mark = str(int(MARK) + 1)
    async with make_sandbox(isolating_backend, lim) as hog, make_sandbox(isolating_backend, lim) as other:
        hogging = asyncio.ensure_future(run(hog, ["python3", "-c", _EXHAUST, mark]))
        try:
            for _ in range(300):  # until the hog holds everything (it sleeps then)
                if processes_matching(f"sleep {mark}") or hogging.done():
                    break
                await asyncio.sleep(0.1)
            assert processes_matching(f"sleep {mark}"), "the hog never got to hold its counters"
            r = await run(other, ["python3", "-c", _CREATE_ONE])
            assert r.stdout.split() == ["inotify", "0", "mqueue", "0", "sigqueue", "0"], r
            uid = _formerly_shared_uid(isolating_backend)
            if uid == os.getuid() or os.geteuid() == 0:
                python = shutil.which("python3", path="/usr/bin:/bin")
                host = subprocess.run([python, "-I", "-c", _CREATE_ONE], capture_output=True, text=True, timeout=30,
                                      user=uid, group=uid, extra_groups=[], cwd="/")  # fmt: skip
                assert host.stdout.split() == ["inotify", "0", "mqueue", "0", "sigqueue", "0"], (uid, host)
        finally:
            for pid in processes_matching(f"sleep {mark}"):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            r = await hogging
    counts = dict((line.split()[0], line.split()[1:]) for line in r.stdout.splitlines())
    assert set(counts) == {"inotify", "mqueue", "sigqueue"}, r
    assert all(errno_ != "0" for _, errno_ in counts.values()), r  # it used up every one it could
    # ... which is the sandbox's own share, not the host's per-user maximum
    assert lim.pending_signals // 2 <= int(counts["sigqueue"][0]) <= lim.pending_signals, r
    assert int(counts["mqueue"][0]) <= lim.mqueue_bytes // (10 * 8192), r  # default queue: 10 x 8 KiB
    if isolating_backend == "bwrap":  # the exec's own user namespace limit (/proc/sys is read-only in docker)
        assert 0 < int(counts["inotify"][0]) <= lim.inotify_instances, r


_TIME_WAIT = r"""
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)
for _ in range(50):  # the side that closes first keeps its end in TIME_WAIT for a minute
    c = socket.create_connection(srv.getsockname()); s, _ = srv.accept(); c.close(); s.close()
"""
_SOCKETS_SEEN = "cat /proc/net/tcp /proc/net/tcp6 /proc/net/udp 2>/dev/null | grep -vc local_address"


async def test_no_socket_state_reaches_the_next_episode(isolating_backend, limits):
    """Without a network, every episode has a network namespace of its own: TIME_WAIT sockets
    (and the ports they hold) of one episode are not seen by the next."""
    async with SandboxPool(isolating_backend, limits, max_live=1) as pool:
        async with pool.acquire() as first:
            await run(first, ["python3", "-c", _TIME_WAIT])
            r = await run(first, _SOCKETS_SEEN)
            assert int(r.stdout) >= 50, r  # within the episode they stay, as on any machine
        async with pool.acquire() as second:
            assert second is first
            r = await run(second, _SOCKETS_SEEN)
            assert r.stdout == "0\n", r


_PIDS = "import os; print(os.readlink('/proc/self'), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
_FORKS = "import os\nfor _ in range(300):\n    p = os.fork()\n    if p == 0: os._exit(0)\n    os.waitpid(p, 0)"


async def test_pid_numbers_do_not_count_across_episodes(isolating_backend, limits):
    """300 forks in one episode (a number for the next to read) leave the pid numbers the
    next episode sees through /proc as they were: each exec has its own /proc."""
    if isolating_backend == "docker":
        pytest.skip("docker: /proc is the container's, whose masked paths forbid mounting another (README: what still reaches the next episode)")
    async with SandboxPool(isolating_backend, limits, max_live=1) as pool:
        async with pool.acquire() as first:
            seen = await run(first, ["python3", "-c", _PIDS])
            r = await run(first, ["python3", "-c", _FORKS])
            assert r.ok, r
        async with pool.acquire() as second:
            assert second is first
            again = await run(second, ["python3", "-c", _PIDS])
    assert seen.ok and again.stdout == seen.stdout, (seen, again)
