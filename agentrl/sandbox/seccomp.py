"""The seccomp filter every sandboxed command runs under, generated with libseccomp.

A deny list on top of whatever the backend already has (bwrap: nothing; Docker/podman:
the engine's own profile — filters stack, so a command gets both).  It closes the kernel
surface a sandboxed command has no business touching and that has a record of privilege
escalation bugs:

- namespaces: ``unshare``, ``setns``, ``clone``/``clone`` with any ``CLONE_NEW*`` flag, and
  ``clone3`` (its flags live in memory a filter cannot read, so it fails with ENOSYS and
  libc falls back to ``clone``) — no nested user namespace, no new mount table;
- mounts: ``mount``, ``umount2``, ``pivot_root``, ``chroot`` and the new mount API;
- ``io_uring_*``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``keyctl``/``add_key``/
  ``request_key``, ``kexec_*``, module loading, ``open_by_handle_at``, ``fanotify_init``,
  ``quotactl``, ``acct``, ``swapon``/``swapoff``, ``reboot``, ``syslog``, ``ptrace``-free
  memory/personality tricks stay allowed (they are confined by the namespaces);
- sockets: only ``AF_UNIX``, ``AF_INET``, ``AF_INET6`` and ``AF_NETLINK`` with protocol 0
  (``NETLINK_ROUTE``, which ``getifaddrs`` needs); no netfilter, packet, key, vsock...
  sockets.  ``socketpair`` runs the family's socket-creation code too, so it gets the same
  rules (the same errno as ``socket``), and only ``AF_UNIX`` gets past them: the kernel
  implements socket pairs for no other family (EOPNOTSUPP, as it would answer itself).

Syscalls of another ABI (i386 ``int 0x80``, x32) kill the process: the filter is built
for the native architecture only and libseccomp's bad-architecture action applies.

The filter is compiled to classic BPF by libseccomp (through the ``pyseccomp`` ctypes
binding) on the host, and the in-sandbox agent installs those bytes with
``prctl(PR_SET_SECCOMP)`` right before ``execve`` of each command.  Nothing here packs BPF
by hand.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile

# Syscalls a sandboxed command may never make (EPERM).  Names libseccomp does not know on
# this architecture are skipped (they do not exist there).
DENIED = (
    # namespaces and mount tables
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel attack surface
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "quotactl", "quotactl_fd",
    "acct", "swapon", "swapoff", "reboot", "syslog", "lookup_dcookie", "vhangup",
    "iopl", "ioperm", "uselib", "nfsservctl", "_sysctl",
)  # fmt: skip

CLONE_NEW_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
MAX_FAMILY = 64  # AF_MAX is 46 today; everything from here up is denied by one rule


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its Python binding) is missing: no filter can be generated."""


def _lib():  # noqa: ANN202 - the pyseccomp module
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: libseccomp.so not found
        raise SeccompUnavailable(
            f"cannot generate a seccomp filter: {e} (install libseccomp2 and the pyseccomp package)"
        ) from e
    return pyseccomp


def _syscall_nr(sc, name: str) -> int | None:
    nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
    return nr if nr >= 0 else None


def build_filter():  # noqa: ANN201 - a pyseccomp.SyscallFilter
    """The filter as a libseccomp object (default: allow; the rules above: EPERM)."""
    sc = _lib()
    eperm = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    with contextlib.suppress(OSError):  # libseccomp >= 2.5: a binary tree, not a linear chain
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    for name in DENIED:
        nr = _syscall_nr(sc, name)
        if nr is not None:
            f.add_rule(eperm, nr)
    # clone3 passes its flags in a struct: refuse it as "not implemented" so libc uses clone
    nr = _syscall_nr(sc, "clone3")
    if nr is not None:
        f.add_rule(sc.ERRNO(errno.ENOSYS), nr)
    # clone: flags are argument 0 on every architecture but s390 (which we do not build for)
    nr = _syscall_nr(sc, "clone")
    if nr is not None:
        for flag in CLONE_NEW_FLAGS.values():
            f.add_rule(eperm, nr, sc.Arg(0, sc.MASKED_EQ, flag, flag))
    nr = _syscall_nr(sc, "socket")
    if nr is not None:
        _family_rules(sc, f, nr, pair=False)
    nr = _syscall_nr(sc, "socketpair")
    if nr is not None:
        _family_rules(sc, f, nr, pair=True)
    return f


def _family_rules(sc, f, nr: int, *, pair: bool) -> None:  # noqa: ANN001 - pyseccomp objects
    """socket()/socketpair() family rules; the rules of one syscall never overlap."""
    for family in range(MAX_FAMILY):
        if family not in ALLOWED_FAMILIES:
            f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), nr, sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), nr, sc.Arg(0, sc.GE, MAX_FAMILY))
    f.add_rule(sc.ERRNO(errno.EPROTONOSUPPORT), nr, sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.NE, 0))
    if pair:  # families socket() allows but that have no socket pairs: refused before their code runs
        f.add_rule(sc.ERRNO(errno.EOPNOTSUPP), nr, sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.EQ, 0))
        for family in (AF_INET, AF_INET6):
            f.add_rule(sc.ERRNO(errno.EOPNOTSUPP), nr, sc.Arg(0, sc.EQ, family))


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The compiled filter: an array of ``struct sock_filter`` (8 bytes each), native arch.

    Raises :class:`SeccompUnavailable` when libseccomp is missing (callers fail closed).
    """
    f = build_filter()
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        data = out.read()
    if not data or len(data) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed filter ({len(data)} bytes)")
    return data


def filter_text() -> str:
    """The filter in libseccomp's human-readable form (pseudo filter code), for review."""
    f = build_filter()
    with tempfile.TemporaryFile() as out:
        f.export_pfc(out)
        out.seek(0)
        return out.read().decode()


def why_unavailable() -> str | None:
    try:
        filter_bpf()
    except SeccompUnavailable as e:
        return str(e)
    except OSError as e:
        return f"libseccomp failed to build the filter: {os.strerror(e.errno or 0)}"
    return None
