# ruff: noqa: F821
"""The sandbox agent, part 3: processes, the file API and reset — what keeps one exec (and
one episode) from reaching the next.  See ``_agent.py`` for part 1, ``_agent_exec.py`` for part 2.

This is not an importable module: ``agentrl.sandbox.base.AGENT_SOURCE`` joins the three parts
and the sandbox runs them as one script, so names such as ``State`` and ``AgentError`` come
from part 1, ``run_command`` from part 2.
"""

import errno
import os
import stat

# ----------------------------------------------------------------------------- processes


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


def _reap():
    """Collect every exited child (as pid 1 of a container, orphans are ours too)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_user_processes(mode, sid=None):
    """SIGKILL every user process; loop because a fork can race a single kill(-1)."""
    if mode == "serve-local" and sid is None:
        return
    pause = 0.0002
    for _ in range(400):
        if mode != "serve-local":
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        pids = _other_pids(mode, sid)
        if mode != "serve-local":  # local: Popen collects its own child
            _reap()
        if not pids:
            return
        if mode == "serve-local":
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(pause)  # the dying need a moment; start short, most execs leave nothing
        pause = min(pause * 2, 0.005)


# ----------------------------------------------------------------------------- files

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _components(rel):
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in rel:
        raise OSError(errno.EPERM, "path must be relative to the work dir, without '.', '..' or '//'")
    return parts


def _open_parent(base, rel, create):
    """fd of the directory holding ``rel`` beneath ``base``; no symlink is ever followed."""
    parts = _components(rel)
    fd = os.open(base, _O_DIR)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, _O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, _O_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(errno.ELOOP, f"{name!r} is not a directory (symbolic links are not followed)") from None
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _regular(fd, name):
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"{name!r} is not a regular file")
    return st


def _open_beneath(base, rel, flags, create=False):
    dfd, name = _open_parent(base, rel, create)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o644, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "symbolic links are not followed") from None
        if e.errno == errno.ENXIO:
            raise OSError(errno.EINVAL, f"{name!r} is not a regular file") from None
        raise
    finally:
        os.close(dfd)
    return fd, name


def op_write(req, mode):
    data = base64.b64decode(req["data"])
    fd, name = _open_beneath(req["base"], req["path"], os.O_WRONLY | os.O_CREAT, create=True)
    try:
        _regular(fd, name)  # checks first ...
        os.ftruncate(fd, 0)  # ... truncate after
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return {}


def op_read(req, mode):
    limit = int(req["max_bytes"])
    fd, name = _open_beneath(req["base"], req["path"], os.O_RDONLY)
    try:
        st = _regular(fd, name)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"file larger than {limit} bytes")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(CHUNK * 16, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise OSError(errno.EFBIG, f"file larger than {limit} bytes")
    finally:
        os.close(fd)
    return {"data": base64.b64encode(b"".join(chunks)).decode()}


# ----------------------------------------------------------------------------- reset


def _clear_level(fd):
    """Unlink every non-directory in the directory ``fd``; return its subdirectories (made rwx)."""
    subdirs = []
    with os.scandir(fd) as it:
        entries = list(it)
    for e in entries:
        try:
            is_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            try:
                os.chmod(e.name, 0o700, dir_fd=fd)
            except OSError:
                pass
            subdirs.append(e.name)
        else:
            try:
                os.unlink(e.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # verification reports it
    return subdirs


def empty_tree(top):
    """Remove everything below ``top`` whatever its permissions or depth (one fd, no recursion).

    Safe only while nothing else runs in the sandbox (the caller killed every user process):
    it climbs back up with ``..``.
    """
    try:
        os.chmod(top, 0o700)
        cur = os.open(top, _O_DIR)
    except OSError:
        return
    stack = []  # (pending subdirectories of the level above, the name we descended into)
    pending = _clear_level(cur)
    while True:
        if pending:
            name = pending.pop()
            try:
                os.rmdir(name, dir_fd=cur)
                continue
            except OSError:
                pass
            try:
                nxt = os.open(name, _O_DIR, dir_fd=cur)
            except OSError:
                continue  # verification reports it
            os.close(cur)
            cur = nxt
            stack.append((pending, name))
            pending = _clear_level(cur)
            continue
        if not stack:
            break
        parent = os.open("..", _O_DIR, dir_fd=cur)
        os.close(cur)
        cur = parent
        pending, name = stack.pop()
        try:
            os.rmdir(name, dir_fd=cur)
        except OSError:
            pass
    os.close(cur)


def _writable_mounts():
    """Mount points whose top mount is read-write and holds files (not kernel views)."""
    top = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:  # a later line on the same point is mounted over the earlier one
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            point = fields[4].encode().decode("unicode_escape")
            top[point] = "rw" in fields[5].split(",") and bool(rfields) and rfields[0] not in _VIRTUAL_FS
    return [p for p, writable in top.items() if writable]


def _leftovers(uid, roots):
    """What a command left behind: entries it owns on writable mounts, IPC, processes."""
    left = []
    seen_dev = set()
    for root in sorted(set(roots)):
        try:
            top = os.lstat(root)
        except OSError:
            continue
        if not stat.S_ISDIR(top.st_mode):
            continue  # a file bind-mounted on its own (e.g. /dev/null)
        if (top.st_dev, top.st_ino) in seen_dev:
            continue  # the same mount reached twice
        seen_dev.add((top.st_dev, top.st_ino))
        todo = [root]
        while todo and len(left) < 20:
            d = todo.pop()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except OSError as e:
                left.append(f"{d}: unreadable ({e.strerror})")
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev:
                    continue  # another mount: listed on its own
                if st.st_uid == uid:
                    left.append(e.path)
                elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o002:
                    left.append(f"{e.path}: world-writable file")
                elif stat.S_ISDIR(st.st_mode):
                    todo.append(e.path)
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                n = len(f.read().splitlines()) - 1
        except OSError:
            continue
        if n > 0:
            left.append(f"{n} SysV {kind} object(s)")
    try:
        mq = os.listdir("/dev/mqueue")
    except OSError:
        mq = []
    if mq:
        left.append(f"{len(mq)} POSIX message queue(s)")
    return left


def _restore_root(path):
    """A writable root as mounted: no extended attribute (user.*, ACLs), its times back.

    Its ctime cannot be set: it shows when the last reset ran, nothing a command chose."""
    try:
        for name in os.listxattr(path, follow_symlinks=False):
            try:
                os.removexattr(path, name, follow_symlinks=False)
            except OSError:
                pass  # verification reports it
    except OSError:
        pass
    if path in State.tmpfs_times:
        try:
            os.utime(path, ns=State.tmpfs_times[path], follow_symlinks=False)
        except OSError:
            pass


def _root_leftovers():
    """What a command can leave on the writable roots themselves, which survive every reset:
    extended attributes (megabytes of them), a mode, times."""
    left = []
    for path, mode in sorted(State.tmpfs_modes.items()):
        try:
            st = os.lstat(path)  # never updates atime
            names = os.listxattr(path, follow_symlinks=False)
        except OSError as e:
            left.append(f"{path}: unreadable ({e.strerror})")
            continue
        if names:
            left.append(f"{path}: extended attributes {', '.join(sorted(names))[:200]}")
        if stat.S_IMODE(st.st_mode) != mode:
            left.append(f"{path}: mode {stat.S_IMODE(st.st_mode):o}, not {mode:o}")
        if (st.st_atime_ns, st.st_mtime_ns) != State.tmpfs_times.get(path):
            left.append(f"{path}: access/modification times not restored")
    return left


def op_reset(req, mode):
    kill_user_processes(mode)
    if mode != "serve-local":
        new_episode_net()
    dirs = req["dirs"]
    for d in dirs:
        empty_tree(d)
    for d in dirs:
        try:
            os.chmod(d, State.tmpfs_modes.get(d, 0o755 if mode == "serve-local" else 0o1777))
        except OSError:
            pass
    if mode == "serve-local":
        left = [f"{d}/{n}" for d in dirs for n in os.listdir(d)]
    else:
        roots = list(dirs) + _writable_mounts()
        left = _leftovers(os.getuid(), roots)  # reads the roots: their atime moves
        procs = _other_pids(mode, None)
        if procs:
            left.append(f"{len(procs)} process(es) still alive")
        for d in dirs:  # now, after the last read of the roots
            _restore_root(d)
        left += _root_leftovers()  # every root, not only those asked for
    return {"clean": not left, "left": left[:20]}


OPS = {"init": op_init, "exec": op_exec, "write": op_write, "read": op_read, "reset": op_reset,
       "ping": lambda r, m: {}}  # fmt: skip
