# ruff: noqa: F821 (run_command lives in part 2, _agent_exec.py; OPS in part 3, _agent_cleanup.py)
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

Three files, one script (``agentrl.sandbox.base.AGENT_SOURCE`` joins them): this one (the
protocol, ``init``, serving), ``_agent_exec.py`` (running a command) and ``_agent_cleanup.py``
(processes, the file API, reset).
"""

import base64
import ctypes
import json
import os
import signal
import sys

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


def handle(line, mode):
    req = {}
    try:
        req = json.loads(line)
        if not isinstance(req, dict):
            raise AgentError("request is not an object")
        if req.get("op") not in ("init", "ping") and (State.token is None or req.get("token") != State.token):
            raise AgentError("request without the session token: refused")
        resp = OPS[req["op"]](req, mode)  # noqa: F821 (defined in part 3, _agent_cleanup.py)
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
