# ruff: noqa: F821
"""The sandbox agent, part 2: running one command — rlimits, the seccomp filter, fresh user +
pid + IPC namespaces (and the episode's network namespace), the output pipes and the result
read from kernel facts.  See ``_agent.py`` for part 1 (the protocol and ``init``).

This is not an importable module: ``agentrl.sandbox.base.AGENT_SOURCE`` joins the parts and
the sandbox runs them as one script, so names such as ``State``, ``AgentError``, ``_libc``
and the ``CLONE_*``/``PR_*`` constants come from part 1, ``kill_user_processes`` and
``_reap`` from part 3 (``_agent_cleanup.py``).
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
import time

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
