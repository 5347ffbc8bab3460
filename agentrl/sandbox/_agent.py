"""The in-sandbox agent: runs commands and file operations for the host.

This file is executed *inside* the sandbox by the system ``python3`` (``python3 -I -S -c
<this source> MODE``), so it uses only the standard library and must not import agentrl.
It speaks one JSON object per line: a request ``{"id", "op", ...}`` in, a response
``{"id", "ok", ...}`` out.

Modes:
  ``serve``        bwrap: a long-lived agent (pid 2 of the sandbox's pid namespace) reading
                   requests on stdin.  Every process but itself and pid 1 is the user's, so
                   ``kill(-1, SIGKILL)`` is an exact "kill everything the user started".
  ``serve-local``  local backend: same loop, but the host is shared, so only processes in
                   the command's own session are killed (children calling setsid escape:
                   the local backend is not a security boundary).
  ``once``         docker: one request from $AGENTRL_REQ (or the file $AGENTRL_REQ_FILE),
                   one response on stdout, then exit.  Runs beside ``init`` (pid 1).
  ``init``         docker: pid 1 of the container; reaps orphans so they do not pile up as
                   zombies against the pids limit.

Each command runs in a pid namespace of its own (nested ``bwrap``, else ``unshare``, when
the sandbox has one), so ``kill -9 -1`` or ``pkill python`` in user code cannot reach the
agent; the agent, one namespace up, still sees and kills every user process.

Invariant in every mode: no process started by a command outlives that command's exec
(it is killed when the main process exits or the deadline passes), so between execs
nothing of the user's runs, and a request is never read while user code could be watching.
"""

import base64
import errno
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import time

CHUNK = 1 << 16
TAIL = 4096  # last bytes of stderr kept for out-of-memory detection even when truncated
OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory", b"memory exhausted")


def _non_dumpable():
    # Without this, a user process (same uid) could open /proc/<agent>/fd/1 and forge
    # responses, or ptrace the agent.  PR_SET_DUMPABLE = 4.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def _stat(pid):
    """(state, session id) of a pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[0], int(fields[3])


def _other_pids(mode, sid):
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (1, me):
            continue
        st = _stat(pid)
        if st is None or st[0] in (b"Z", b"X"):
            continue
        if mode == "serve-local" and st[1] != sid:
            continue
        out.append(pid)
    return out


def kill_user_processes(mode, sid=None):
    """SIGKILL every user process; loop because a fork can race a single kill(-1)."""
    if mode == "serve-local" and sid is None:
        return
    for _ in range(200):
        if mode != "serve-local":
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        pids = _other_pids(mode, sid)
        if not pids:
            return
        if mode == "serve-local":
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.005)


_WRAP = []
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000


def _command_wrapper(mode):
    """argv prefix that puts a command in its own user+pid namespace (probed once).

    Nested bwrap (with its own /proc) where it works; inside containers a new /proc may not
    be mounted, so this file's own ``ns`` mode does the unshare + mini-init instead.
    """
    if mode == "serve-local":
        return []
    if _WRAP:
        return _WRAP[0]
    me = os.path.abspath(sys.argv[0])
    candidates = []
    bwrap = shutil.which("bwrap", path="/usr/bin:/bin")
    if bwrap:
        candidates.append(
            [bwrap, "--unshare-user", "--unshare-pid", "--die-with-parent", "--dev-bind", "/", "/", "--proc", "/proc", "--"]
        )
    if os.path.isfile(me):
        candidates.append([sys.executable, "-I", "-S", me, "ns"])
    chosen = []
    for wrap in candidates:
        try:
            ok = subprocess.run(wrap + ["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                timeout=10).returncode == 0  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            chosen = wrap
            break
    _WRAP.append(chosen)
    return chosen


def _wrap(argv, cwd, mode):
    wrap = _command_wrapper(mode)
    if wrap and wrap[0].endswith("bwrap"):
        return wrap[:-1] + ["--chdir", cwd, "--"] + argv
    return wrap + argv


def _status(st):
    return 128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)


def ns_exec(argv):
    """Run argv as pid 2 of a new user+pid namespace; exit with its status.

    Pid 1 is a mini-init (the kernel drops default-action signals such as SIGXCPU sent to a
    namespace's init, so the command itself must not be pid 1); when it exits, the kernel
    kills everything left in the namespace.
    """
    import ctypes

    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        sys.stderr.write(f"agentrl: cannot create a pid namespace: errno {ctypes.get_errno()}\n")
        os._exit(125)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
    init = os.fork()
    if init == 0:
        child = os.fork()
        if child == 0:
            try:
                os.execvp(argv[0], argv)
            except OSError as e:
                sys.stderr.write(f"{argv[0]}: {e.strerror}\n")
                os._exit(127 if isinstance(e, FileNotFoundError) else 126)
        while True:  # reap orphans until the command itself is done
            pid, st = os.wait()
            if pid == child:
                os._exit(_status(st))
    _, st = os.waitpid(init, 0)
    os._exit(_status(st))


def _set_limits(limits):
    def apply():
        for name, value in limits.items():
            if value is None:
                continue
            res = getattr(resource, name)
            hard = value + 1 if name == "RLIMIT_CPU" else value  # soft: SIGXCPU, hard: SIGKILL
            resource.setrlimit(res, (value, hard))

    return apply


class _Capture:
    def __init__(self, cap):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), b"", 0

    def add(self, chunk):
        self.total += len(chunk)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
        self.tail = (self.tail + chunk)[-TAIL:]


def op_exec(req, mode):
    timeout = float(req["timeout"])
    argv = req["argv"]
    stdin_data = base64.b64decode(req.get("stdin") or "")
    out, err = _Capture(int(req["output_bytes"])), _Capture(int(req["output_bytes"]))
    cpu_limit = req["limits"].get("RLIMIT_CPU")
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    try:
        if argv and "/" not in argv[0] and not shutil.which(argv[0], path=req["env"].get("PATH", "")):
            raise FileNotFoundError(errno.ENOENT, "command not found")
        proc = subprocess.Popen(
            _wrap(argv, req["cwd"], mode),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=req["cwd"],
            env=req["env"],
            preexec_fn=_set_limits(req["limits"]),
            start_new_session=True,
            close_fds=True,
        )
    except OSError as e:
        code = 127 if isinstance(e, FileNotFoundError) else 126
        msg = f"{argv[0] if argv else ''}: {e.strerror or e}\n".encode()
        return {"exit_code": code, "stdout": "", "stderr": base64.b64encode(msg).decode(),
                "stdout_truncated": False, "stderr_truncated": False,
                "wall_s": time.monotonic() - start, "timed_out": False, "oom": False, "cpu_exceeded": False}

    sel = selectors.DefaultSelector()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    if stdin_data:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    pending = memoryview(stdin_data)

    def pump(deadline, until_eof):
        """Move bytes until the main process exits (or, with until_eof, every pipe closes)."""
        nonlocal pending
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if until_eof and not sinks:
                return True
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    if not until_eof:
                        return True
                elif fd == stdin_fd:
                    try:
                        n = os.write(fd, pending[:CHUNK])
                        pending = pending[n:]
                    except BlockingIOError:
                        continue
                    except OSError:  # the command closed its stdin: the rest is dropped
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                else:
                    try:
                        chunk = os.read(fd, CHUNK)
                    except BlockingIOError:
                        continue
                    if chunk:
                        sinks[fd].add(chunk)
                    else:
                        sel.unregister(fd)
                        del sinks[fd]

    exited = pump(start + timeout, until_eof=False)
    timed_out = not exited
    # Whatever is still running (the main process on timeout, background children either
    # way) dies now; then every pipe reaches EOF and the rest of the output is drained.
    kill_user_processes(mode, proc.pid)
    pump(time.monotonic() + 5.0, until_eof=True)
    rc = proc.wait()
    wall = time.monotonic() - start
    for f in (proc.stdout, proc.stderr):
        f.close()
    if not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    sel.close()
    os.close(pidfd)

    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_used = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    sig = -rc if rc < 0 else None
    exit_code = 128 + sig if sig else rc
    cpu_exceeded = not timed_out and cpu_limit is not None and (
        sig == signal.SIGXCPU
        or rc == 128 + signal.SIGXCPU  # a shell reporting its child's SIGXCPU
        or (sig == signal.SIGKILL and cpu_used >= cpu_limit * 0.95)
    )
    text = bytes(err.head) + err.tail
    oom = not timed_out and not cpu_exceeded and (
        any(m in text for m in OOM_MARKERS)
        # under a cgroup memory limit (docker) the kernel's OOM killer sends SIGKILL
        or (mode == "once" and (sig == signal.SIGKILL or rc == 137))
    )
    return {
        "exit_code": exit_code,
        "stdout": base64.b64encode(bytes(out.head)).decode(),
        "stderr": base64.b64encode(bytes(err.head)).decode(),
        "stdout_truncated": out.total > out.cap,
        "stderr_truncated": err.total > err.cap,
        "wall_s": wall,
        "timed_out": timed_out,
        "oom": bool(oom),
        "cpu_exceeded": bool(cpu_exceeded),
    }


def op_write(req, mode):
    path = req["path"]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    data = base64.b64decode(req["data"])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req.get("mode", 0o644))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return {}


def op_read(req, mode):
    limit = int(req["max_bytes"])
    with open(req["path"], "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"file larger than {limit} bytes")
    return {"data": base64.b64encode(data).decode()}


def op_reset(req, mode):
    kill_user_processes(mode)
    for d in req["dirs"]:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for name in names:
            p = os.path.join(d, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
    return {}


OPS = {"exec": op_exec, "write": op_write, "read": op_read, "reset": op_reset, "ping": lambda r, m: {}}


def handle(line, mode):
    req = {}
    try:
        req = json.loads(line)
        resp = OPS[req["op"]](req, mode)
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


def init():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(1.0)


def main():
    mode = sys.argv[1]
    if mode == "init":
        return init()
    if mode == "ns":
        return ns_exec(sys.argv[2:])
    _non_dumpable()
    if mode == "once":
        path = os.environ.pop("AGENTRL_REQ_FILE", None)
        if path:
            with open(path, "rb") as f:
                line = f.read()
            os.unlink(path)
        else:
            line = os.environ.pop("AGENTRL_REQ").encode()
        sys.stdout.buffer.write(handle(line, mode))
        sys.stdout.buffer.flush()
        return
    serve(mode)


if __name__ == "__main__":
    main()
