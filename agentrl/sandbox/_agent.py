# ruff: noqa: F821 (kill_user_processes, _reap and OPS live in part 2: _agent_cleanup.py)
"""The in-sandbox agent: runs commands and file operations for the host.

This file is executed *inside* the sandbox by the system ``python3`` (``python3 -I -S``), so
it uses only the standard library and must not import agentrl.  It speaks one JSON object
per line: a request ``{"id", "op", "token", ...}`` in, a response ``{"id", "ok", ...}`` out.
The first request is ``init``; it fixes the token every later request must carry.

Modes:
  ``serve``        bwrap and docker: a long-lived agent reading requests on stdin (bwrap:
                   pid 2 of the sandbox, under bwrap's init; docker: pid 1 of the container).
  ``serve-local``  local backend: same protocol, plain subprocesses, no isolation at all.

``init`` (serve mode) makes the agent's own world, then gives up every privilege:
  1. a user + mount namespace of its own (the only way to mount without privileges on the
     host or in the container), where it mounts the writable tmpfs (size- *and* inode-capped),
     covers host paths that must not show (``hide``) with empty read-only tmpfs, and binds
     synthetic files (``/etc/hosts``);
  2. drops every capability (bounding set, ambient, permitted) and sets no_new_privs;
  3. proves that a command really runs isolated (a probe exec) — or fails: fail closed.

Every command then runs as pid 2 of fresh user + pid + IPC namespaces (pid 1 is a tiny
init forked from this agent; under bwrap it mounts a /proc of that pid namespace), inside
the episode's own network namespace when the sandbox has no network (a new one at each
reset), under rlimits and the host-generated seccomp filter, so:
  - ``kill -9 -1``/``pkill`` cannot reach the agent, and SysV shm, message queues and POSIX
    message queues vanish with the exec;
  - no nested user namespace (seccomp denies it; where ``/proc/sys`` is writable the
    namespace's ``user.max_user_namespaces`` is 0 as well);
  - the exit status, the signal and the CPU time are reported by the init over a pipe the
    command never holds, so result flags come from kernel facts only (never from output).

Invariant: no process started by a command outlives that command's exec, so between execs
nothing of the user's runs, and a request is never read while user code could be watching.
"""

import base64
import ctypes
import fcntl
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time

CHUNK = 1 << 16
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x00020000, 0x08000000, 0x10000000, 0x20000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 4, 24, 38, 22, 47
SECCOMP_MODE_FILTER, PR_CAP_AMBIENT_CLEAR_ALL = 2, 4
# mounts whose contents are the kernel's, not files a command could have left behind
_VIRTUAL_FS = {"proc", "sysfs", "devtmpfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
               "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "hugetlbfs", "autofs", "nsfs"}  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


class AgentError(Exception):
    """The sandbox cannot do what was asked safely: the host treats the sandbox as broken."""


class _Prog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class State:
    token = None
    isolate = False  # serve mode after init: commands get namespaces + seccomp
    seccomp = None  # (buffer, _Prog) kept alive for the forked children
    oom_fd = None  # the container's memory cgroup events file (docker), read before/after exec
    tmpfs_modes = {}  # path -> mode to restore on reset
    tmpfs_times = {}  # path -> (atime_ns, mtime_ns) as mounted, restored on reset
    sysctls = {}  # per-exec-namespace sysctls (best effort, where /proc/sys is writable)
    fresh_net = False  # each episode gets a network namespace of its own (no network asked for)
    episode_net = None  # (user ns fd, net ns fd) of the current episode's network namespace
    own_proc = False  # each exec mounts a /proc of its own pid namespace (bwrap)


def _check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise AgentError(f"{what}: {os.strerror(e)}")


def _non_dumpable():
    # A user process (same uid) must not open /proc/<agent>/fd/* or ptrace the agent.
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _write_id_maps(uid, gid):
    # /proc/self of a non-dumpable process belongs to root, so we are dumpable for the few
    # microseconds this takes; no user process exists yet that could use the window.
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    finally:
        _non_dumpable()


def _mount(src, target, fstype, flags, data=None):
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                       data and data.encode()), f"mount {target}")  # fmt: skip


# ----------------------------------------------------------------------------- init


def op_init(req, mode):
    if State.token is not None:
        raise AgentError("init twice")
    State.token = req["token"]
    if mode == "serve-local":
        return {"isolation": "none"}
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user, mount)")
    _write_id_maps(uid, gid)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    if req.get("oom_counter") == "self":
        State.oom_fd = _open_own_oom_counter()
    for t in req.get("tmpfs", []):
        opts = f"size={int(t['size'])},nr_inodes={int(t['inodes'])},mode={int(t['mode']):o}"
        _mount("tmpfs", t["path"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
        State.tmpfs_modes[t["path"]] = int(t["mode"])
        st = os.stat(t["path"])
        State.tmpfs_times[t["path"]] = (st.st_atime_ns, st.st_mtime_ns)
    files = req.get("files") or {}
    if files:
        stash = req["stash"]  # a directory of ours to hold synthetic files, read-only after
        _mount("tmpfs", stash, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,nr_inodes=64,mode=755")
        for i, (target, text) in enumerate(sorted(files.items())):
            if not os.path.exists(target):
                continue
            src = os.path.join(stash, f"file{i}")
            with open(src, "w") as f:
                f.write(text)
            _mount(src, target, None, MS_BIND)
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        _mount(None, stash, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,nr_inodes=64,mode=755")
    for path in req.get("hide", []):
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=4,mode=555")
    State.sysctls = dict(req.get("sysctls") or {})
    State.fresh_net = bool(req.get("fresh_net"))
    State.own_proc = bool(req.get("own_proc"))
    _drop_privileges()
    new_episode_net()
    bpf = base64.b64decode(req.get("seccomp") or "")
    if not bpf or len(bpf) % 8:
        raise AgentError("no seccomp filter: refusing to run commands unfiltered")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    State.seccomp = (buf, _Prog(len(bpf) // 8, ctypes.addressof(buf)))
    State.isolate = True
    return {"isolation": "namespaces+seccomp", "probe": _probe(req), "oom_counter": State.oom_fd is not None}


def _open_own_oom_counter():
    """fd of this container's memory cgroup event counters (read with pread), or None."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
    return None


def _oom_kills():
    if State.oom_fd is None:
        return None
    for line in os.pread(State.oom_fd, 4096, 0).decode().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def _status_caps():
    caps = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            caps[key] = value.strip()
    return caps


def _drop_privileges():
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: fine
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    st = _status_caps()
    if any(int(st.get(k, "1"), 16) for k in ("CapEff", "CapPrm", "CapAmb")) or st.get("NoNewPrivs") != "1":
        raise AgentError(f"could not drop privileges: {st}")


def _probe(req):
    """Run commands the normal way and check they are filtered and namespaced (fail closed)."""
    limits = {"RLIMIT_CPU": 5, "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}
    env = {"PATH": "/usr/bin:/bin"}
    r = run_command(["cat", "/proc/self/status"], b"", 10.0, "/", env, limits, 1 << 16, "serve")
    text = base64.b64decode(r["stdout"]).decode(errors="replace")
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    nspid = fields.get("NSpid", "").split()
    seccomp_on = fields.get("Seccomp", "").strip() == "2"
    ns = run_command(["readlink", "/proc/self/ns/pid"], b"", 10.0, "/", env, limits, 1 << 16, "serve")
    pid_ns = base64.b64decode(ns["stdout"]).decode(errors="replace").strip()
    own_pid_ns = pid_ns.startswith("pid:") and pid_ns != os.readlink("/proc/self/ns/pid")
    if r["exit_code"] != 0 or not seccomp_on or not nspid or nspid[-1] != "2" or not own_pid_ns:
        err = base64.b64decode(r["stderr"] + ns["stderr"]).decode(errors="replace")
        raise AgentError(f"command isolation probe failed (exit {r['exit_code']}, seccomp={seccomp_on}, "
                         f"NSpid={nspid}, pid namespace {pid_ns or '?'}): {err.strip()[:300]}")  # fmt: skip
    return {"nspid": nspid}


_AT_MOST_GIVEN = ("RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING")  # capped at what the sandbox got, never raised


def _set_limits(limits):
    for name, value in limits.items():
        if value is None:
            continue
        if name in _AT_MOST_GIVEN:
            given = resource.getrlimit(getattr(resource, name))[1]
            value = value if given == resource.RLIM_INFINITY else min(value, given)
        hard = value + 1 if name == "RLIMIT_CPU" else value  # soft: SIGXCPU, hard: SIGKILL
        resource.setrlimit(getattr(resource, name), (value, hard))


def _exec_command(argv, env, cwd, limits, fds):
    """In the forked command process: plumbing, limits, filter, execve.  Never returns."""
    stdin_r, stdout_w, stderr_w = fds
    try:
        os.dup2(stdin_r, 0)
        os.dup2(stdout_w, 1)
        os.dup2(stderr_w, 2)
        os.closerange(3, 1 << 16)
        os.setsid()
        os.chdir(cwd)
        # the first user process: nothing of the user's exists yet that could use our memory
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        try:  # the OOM killer prefers user code to the agent (raising is always allowed)
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        _set_limits(limits)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "no_new_privs")
        _, prog = State.seccomp
        if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp")
    except BaseException as e:
        os.write(2, f"agentrl: cannot start the command safely: {e}\n".encode())
        os._exit(125)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"{argv[0]}: {'command not found' if isinstance(e, FileNotFoundError) else e.strerror}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


def _ns_child(argv, env, cwd, limits, fds, status_w):
    """The forked child: new user + pid + IPC namespaces, then init (pid 1) and the command."""
    uid, gid = os.getuid(), os.getgid()
    if State.episode_net is not None:  # the episode's network: enter its owner, then it
        user_fd, net_fd = State.episode_net
        for fd, kind, name in ((user_fd, CLONE_NEWUSER, "user"), (net_fd, CLONE_NEWNET, "net")):
            if _libc.setns(fd, kind) != 0:
                raise AgentError(f"setns({name}) into the episode's network: {os.strerror(ctypes.get_errno())}")
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWIPC) != 0:
        raise AgentError(f"unshare(user, pid, ipc): {os.strerror(ctypes.get_errno())}")
    _write_id_maps(uid, gid)
    for key, value in State.sysctls.items():  # best effort: /proc/sys is read-only in containers
        try:
            with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                f.write(str(value))
        except OSError:
            pass
    init = os.fork()
    if init == 0:  # pid 1 of the new pid namespace
        if State.own_proc:
            _own_proc()
        command = os.fork()
        if command == 0:
            os.close(status_w)
            _exec_command(argv, env, cwd, limits, fds)
        for fd in fds:
            os.close(fd)
        while True:  # reap orphans until the command itself is done
            pid, status, ru = os.wait4(-1, 0)
            if pid == command:
                break
        report = json.dumps({"status": status, "cpu_s": ru.ru_utime + ru.ru_stime})
        os.write(status_w, report.encode())
        os._exit(0)  # the kernel now kills whatever is left in the namespace
    os._exit(0)


def new_episode_net():
    """Without a network, each episode gets a network namespace of its own: no TIME_WAIT
    socket, held port or loopback state of one episode reaches the next.

    A short-lived child makes it (user + net namespace, ``lo`` up) and the agent keeps it
    alive by fds; every exec of the episode enters it (the agent owns that user namespace,
    so it may, without any capability of its own).  The previous episode's namespace goes
    with its last fd.  Called only while no user process exists.
    """
    if State.episode_net is not None:
        for fd in State.episode_net:
            os.close(fd)
        State.episode_net = None
    if not State.fresh_net:
        return
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(hold_w)
            uid, gid = os.getuid(), os.getgid()
            if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(user, net)")
            _write_id_maps(uid, gid)
            _loopback_up()
            _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # so that the agent may open our namespaces
            os.write(ready_w, b"ok")
            os.read(hold_r, 1)  # until the agent holds them
        except BaseException as e:
            os.write(ready_w, f"{type(e).__name__}: {e}".encode()[:500])
        os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        msg = os.read(ready_r, 4096)
        if msg != b"ok":
            raise AgentError(f"could not make the episode's network namespace: {msg.decode(errors='replace')}")
        fds = []
        for name in ("user", "net"):
            fds.append(os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        State.episode_net = tuple(fds)
    finally:
        os.close(hold_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def _own_proc():
    """In the exec's init: a mount namespace whose /proc shows this exec's pid namespace only,
    so pid numbers (``/proc/self``, ``ls /proc``) start afresh with every exec and nothing of
    the agent or of bwrap shows.  The kernel allows it because bwrap's /proc is fully
    visible (nothing mounted over parts of it)."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise AgentError(f"unshare(mount) for the exec's /proc: {os.strerror(ctypes.get_errno())}")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _loopback_up():
    """``lo`` of a new network namespace starts down: bring it up (we hold CAP_NET_ADMIN there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh14x", b"lo", 0))
        flags = struct.unpack("16sh14x", ifreq)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))


def _spawn_isolated(argv, env, cwd, limits):
    """Fork the namespaced command; returns (pid of the forked child, stdin_w, stdout_r, stderr_r, status_r)."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    st_r, st_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (in_w, out_r, err_r, st_r):
                os.close(fd)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            _ns_child(argv, env, cwd, limits, (in_r, out_w, err_w), st_w)
        except BaseException as e:
            try:
                os.write(st_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            finally:
                os._exit(125)
        os._exit(0)
    for fd in (in_r, out_w, err_w, st_w):
        os.close(fd)
    return pid, in_w, out_r, err_r, st_r


class _Capture:
    def __init__(self, cap):
        self.cap, self.head, self.total = cap, bytearray(), 0

    def add(self, chunk):
        self.total += len(chunk)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]


class _Pipes:
    """A running command's stdin, stdout, stderr and status fd, moved by one selector."""

    def __init__(self, mode, fds, stdin_data, out, err):
        stdin_fd, out_fd, err_fd, self.status_fd = fds
        self.mode, self.stdin_fd, self.out_fds = mode, stdin_fd, (out_fd, err_fd)
        self.sel = selectors.DefaultSelector()
        self.sinks = {out_fd: out, err_fd: err}
        for fd in self.sinks:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.sel.register(self.status_fd, selectors.EVENT_READ)
        self.status_buf = bytearray()
        self.pending = memoryview(stdin_data)
        self.stdin_open = True
        if self.pending:
            os.set_blocking(stdin_fd, False)
            self.sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            os.close(stdin_fd)
            self.stdin_open = False

    def pump(self, deadline, until_eof):
        """Move bytes until the main process exits (or, with until_eof, every pipe closes)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if until_eof and not self.sinks:
                return True
            for key, _ in self.sel.select(left):
                fd = key.fd
                if fd == self.status_fd:
                    if self._status(fd) and not until_eof:
                        return True
                elif fd == self.stdin_fd:
                    self._feed(fd)
                else:
                    self._drain(fd)

    def _status(self, fd):
        """Read the status pipe; True once it closed (the command's init is done)."""
        if self.mode != "serve-local":
            chunk = os.read(fd, 4096)
            if chunk:
                self.status_buf.extend(chunk)
                return False
        self.sel.unregister(fd)
        return True

    def _feed(self, fd):
        try:
            n = os.write(fd, self.pending[:CHUNK])
            self.pending = self.pending[n:]
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin: the rest is dropped
            self.pending = self.pending[:0]
        if not self.pending:
            self.sel.unregister(fd)
            os.close(fd)
            self.stdin_open = False

    def _drain(self, fd):
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if chunk:
            self.sinks[fd].add(chunk)
        else:
            self.sel.unregister(fd)
            del self.sinks[fd]

    def close(self):
        for fd in list(self.sinks):
            os.close(fd)
        for fd in self.out_fds:
            if fd not in self.sinks:
                os.close(fd)
        if self.stdin_open:
            os.close(self.stdin_fd)
        self.sel.close()
        os.close(self.status_fd)


def _start_local(argv, cwd, env, limits):
    """serve-local: a plain child process (no isolation); returns (proc, fds) or an error result."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, preexec_fn=lambda: _set_limits(limits),
                                start_new_session=True, close_fds=True)  # fmt: skip
    except OSError as e:
        code = 127 if isinstance(e, FileNotFoundError) else 126
        msg = f"{argv[0]}: {'command not found' if code == 127 else e.strerror}\n".encode()
        return None, _result(code, None, b"", msg, False, False, 0.0, False, 0.0, None)
    return proc, (proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno(), os.pidfd_open(proc.pid))


def run_command(argv, stdin_data, timeout, cwd, env, limits, output_bytes, mode):
    """Run one command to completion (or deadline); every process it started is dead after."""
    out, err = _Capture(output_bytes), _Capture(output_bytes)
    oom0 = _oom_kills()
    start = time.monotonic()
    proc = None
    if mode == "serve-local":
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc, fds = _start_local(argv, cwd, env, limits)
        if proc is None:
            return fds  # the error result
        child = proc.pid
    else:
        if not State.isolate:
            raise AgentError("sandbox not initialised: refusing to run a command unisolated")
        child, *fds = _spawn_isolated(argv, env, cwd, limits)
    pipes = _Pipes(mode, fds, stdin_data, out, err)
    timed_out = not pipes.pump(start + timeout, until_eof=False)
    # Whatever is still running (the main process on timeout, background children either
    # way) dies now; then every pipe reaches EOF and the rest of the output is drained.
    kill_user_processes(mode, child)
    pipes.pump(time.monotonic() + 5.0, until_eof=True)
    wall = time.monotonic() - start
    pipes.close()
    truncated = (out.total > out.cap, err.total > err.cap)
    if mode == "serve-local":
        rc = proc.wait()
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
        sig = -rc if rc < 0 else None
        return _result(128 + sig if sig else rc, sig, out.head, err.head, *truncated, wall, timed_out, cpu, None)
    return _isolated_result(child, pipes.status_buf, out, err, truncated, wall, timed_out, oom0)


def _isolated_result(child, status_buf, out, err, truncated, wall, timed_out, oom0):
    """The result of an isolated command, from its init's status report and kernel counters."""
    try:
        os.waitpid(child, 0)
    except ChildProcessError:
        pass  # already collected by kill_user_processes
    _reap()
    report = {}
    if status_buf:
        try:
            report = json.loads(bytes(status_buf))
        except ValueError:
            report = {"error": "unreadable status report"}
    if "error" in report:
        raise AgentError(f"could not start the command isolated: {report['error']}")
    # No report: the exec's init was killed — by our deadline, or by the OOM killer (the
    # command cannot signal its own namespace's init).  Either way the command is dead.
    st = report.get("status")
    sig = os.WTERMSIG(st) if st is not None and os.WIFSIGNALED(st) else None
    code = (128 + sig if sig else os.WEXITSTATUS(st)) if st is not None else 128 + signal.SIGKILL
    oom1 = _oom_kills()
    oom_kills = oom1 - oom0 if oom0 is not None and oom1 is not None else None
    return _result(code, sig, out.head, err.head, *truncated, wall, timed_out,
                   float(report.get("cpu_s", 0.0)), oom_kills)  # fmt: skip


def _result(code, sig, out, err, out_trunc, err_trunc, wall, timed_out, cpu_s, oom_kills):
    return {
        "exit_code": code,
        "signal": sig,
        "stdout": base64.b64encode(bytes(out)).decode(),
        "stderr": base64.b64encode(bytes(err)).decode(),
        "stdout_truncated": out_trunc,
        "stderr_truncated": err_trunc,
        "wall_s": wall,
        "timed_out": timed_out,
        "cpu_s": cpu_s,
        "oom_kills": oom_kills,
    }


def op_exec(req, mode):
    argv = [str(a) for a in req["argv"]]
    if not argv:
        raise AgentError("empty argv")
    limits = req["limits"]  # required: a request without limits is not ours
    if not isinstance(limits, dict) or "RLIMIT_CPU" not in limits:
        raise AgentError("exec without limits")
    return run_command(argv, base64.b64decode(req.get("stdin") or ""), float(req["timeout"]), req["cwd"],
                       req["env"], limits, int(req["output_bytes"]), mode)  # fmt: skip


def handle(line, mode):
    req = {}
    try:
        req = json.loads(line)
        if not isinstance(req, dict):
            raise AgentError("request is not an object")
        if req.get("op") not in ("init", "ping") and (State.token is None or req.get("token") != State.token):
            raise AgentError("request without the session token: refused")
        resp = OPS[req["op"]](req, mode)  # noqa: F821 (defined in part 2, _agent_cleanup.py)
        resp["ok"] = True
    except OSError as e:
        resp = {"ok": False, "error": e.strerror or str(e), "errno": e.errno or 0, "kind": type(e).__name__}
    except Exception as e:
        resp = {"ok": False, "error": f"{type(e).__name__}: {e}", "errno": 0, "kind": "AgentError"}
    resp["id"] = req.get("id") if isinstance(req, dict) else None
    return (json.dumps(resp) + "\n").encode()


def serve(mode):
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        stdout.write(handle(line, mode))
        stdout.flush()


def main():
    mode = sys.argv[1]
    _non_dumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if os.getpid() == 1:  # docker: we are the container's init; terminate on SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve(mode)


if __name__ == "__main__":
    main()
