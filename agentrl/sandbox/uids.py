"""A host uid of its own for each sandbox.

The kernel counts some resources per user, across every namespace: inotify instances and
watches, POSIX message-queue bytes, queued signals, processes.  Sandboxes that share one
host uid share those counters: one could use up the host's per-user maximum and every other
sandbox of that uid (and every host process running as it) would be refused.  So each
sandbox runs as a uid nobody else uses, leased here for its lifetime:

- the range (default 1800000000-1800065535, inside the range systemd leaves to containers;
  ``AGENTRL_SANDBOX_UIDS=FIRST-LAST`` to change it) skips every uid with an account;
- a lease is a ``flock`` on one empty file per uid (mode 0600: another user cannot open it, so
  cannot flock it and hold every uid) in a lock directory shared by every
  agentrl process on the host, so two runs never hand out the same uid, and a killed run's
  leases end with it.  The lowest free uid is taken: the directory holds at most as many
  files as sandboxes ever ran at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import tempfile
import threading

from agentrl.sandbox.base import SandboxError

DEFAULT_RANGE = (1_800_000_000, 1_800_065_535)
_lock = threading.Lock()  # one scan at a time in this process (leases themselves are flocks)


def uid_range() -> tuple[int, int]:
    """(first, last) uid a sandbox may get; ``AGENTRL_SANDBOX_UIDS=FIRST-LAST`` overrides."""
    spec = os.environ.get("AGENTRL_SANDBOX_UIDS", "").strip()
    if not spec:
        return DEFAULT_RANGE
    try:
        first, last = (int(x) for x in spec.split("-"))
    except ValueError:
        raise SandboxError(f"AGENTRL_SANDBOX_UIDS={spec!r} is not FIRST-LAST (e.g. 1800000000-1800065535)") from None
    if not 1000 <= first <= last < 2**31 - 1:
        raise SandboxError(f"AGENTRL_SANDBOX_UIDS={spec!r}: need 1000 <= FIRST <= LAST < 2147483647")
    return first, last


def lock_dir() -> str:
    """Where the leases live: /run for root, else the temp dir (shared by every user)."""
    base = "/run" if os.geteuid() == 0 and os.path.isdir("/run") else tempfile.gettempdir()
    path = os.path.join(base, "agentrl-sandbox-uids")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755 if os.geteuid() == 0 else 0o1777)
        if os.geteuid() != 0:
            os.chmod(path, 0o1777)  # other users' runs lease from the same range
    return path


class UidLease:
    """One uid held until :meth:`release` (or this process's death)."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # the flock goes with the last reference to the open file


def lease_uid() -> UidLease:
    """The lowest free uid of the range, held until released; SandboxError when none is free."""
    first, last = uid_range()
    directory = lock_dir()
    unusable: list[str] = []
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SandboxError(f"cannot lease a sandbox uid: {directory} is not writable by this user (another user made "
                           "it without the sticky, world-writable mode); set AGENTRL_SANDBOX_UIDS and TMPDIR to your own")
    with _lock:
        for uid in range(first, last + 1):
            try:
                pwd.getpwuid(uid)
                continue  # an account: not ours to use
            except KeyError:
                pass
            try:  # 0600: another user who could open the file could flock it and hold the uid (every uid: no lease)
                fd = os.open(os.path.join(directory, str(uid)), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM):
                    raise SandboxError(f"cannot lease a sandbox uid in {directory}: {e.strerror}") from e
                # another user's entry (a symlink, an unreadable file: the directory is shared and
                # sticky, so it cannot be removed): that uid is not ours, the next one may be
                unusable.append(str(uid))
                continue
            if os.fstat(fd).st_uid not in (os.geteuid(), 0):
                # another user's file: they can unlink it (the directory is sticky, the file theirs) and
                # a new one at the name gets a second lease of this uid while ours holds the old inode
                os.close(fd)
                unusable.append(str(uid))
                continue
            if os.fstat(fd).st_mode & 0o077:  # made 0644 by an older agentrl: others' opens end here
                with contextlib.suppress(OSError):  # (root's file, opened by an ordinary user: not ours to change)
                    os.fchmod(fd, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return UidLease(uid, fd)
    if unusable:
        raise SandboxError(f"no sandbox uid in {first}-{last} is free: {len(unusable)} entries in {directory} "
                           f"(e.g. {unusable[0]}) are links or files this user cannot open or does not own, the rest are in use; "
                           "set AGENTRL_SANDBOX_UIDS to a range of your own")
    raise SandboxError(f"every sandbox uid in {first}-{last} is in use (set AGENTRL_SANDBOX_UIDS to a larger range)")
