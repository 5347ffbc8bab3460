"""Host-side pieces on their own: the generated seccomp filter, path confinement, escaping."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest

from agentrl.sandbox import SandboxLimits
from agentrl.sandbox.base import AgentSandbox, ExecResult, escape_controls
from agentrl.sandbox.live import unregister

seccomp = pytest.importorskip("agentrl.sandbox.seccomp")

_APPLY = r"""
import base64, ctypes, errno, os, socket, sys
bpf = base64.b64decode(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
buf = ctypes.create_string_buffer(bpf, len(bpf))
prog = Prog(len(bpf) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.addressof(prog), 0, 0) == 0, ctypes.get_errno()
def err(r):
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
print("unshare", err(libc.unshare(0x10000000)))
print("clone3", err(libc.syscall(435, 0, 0)))
try:
    socket.socket(17, socket.SOCK_RAW); print("packet ok")
except OSError as e:
    print("packet", errno.errorcode[e.errno])
try:
    socket.socketpair(40, socket.SOCK_STREAM); print("vsock pair ok")
except OSError as e:
    print("vsock pair", errno.errorcode[e.errno])
a, b = socket.socketpair(); a.close(); b.close(); print("unix pair ok")
socket.socket().close(); print("tcp ok")
print("pid", os.getpid() > 0)
"""


def test_filter_is_generated_by_libseccomp_and_denies_what_it_says():
    why = seccomp.why_unavailable()
    if why:
        pytest.skip(why)
    bpf = seccomp.filter_bpf()
    assert len(bpf) % 8 == 0 and len(bpf) // 8 > 20
    text = seccomp.filter_text()
    for name in ("unshare", "io_uring_setup", "keyctl", "bpf", "perf_event_open", "userfaultfd", "mount"):
        assert f'"{name}"' in text, name
    assert "KILL_PROCESS" in text  # syscalls of another ABI
    # the same bytes the agent installs, applied to a plain process on the host
    out = subprocess.run([sys.executable, "-c", _APPLY, base64.b64encode(bpf).decode()], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert "unshare EPERM" in lines and "clone3 ENOSYS" in lines and "packet EAFNOSUPPORT" in lines, out.stdout
    assert "vsock pair EAFNOSUPPORT" in lines and "unix pair ok" in lines, out.stdout
    assert "tcp ok" in lines and "pid True" in lines


class _Box(AgentSandbox):
    workdir = "/work"


def _relpath(path: str) -> str:
    box = _Box(SandboxLimits())
    unregister(box)  # never started: nothing to clean up
    return box._relpath(path)


@pytest.mark.parametrize("path,expected", [("a.txt", "a.txt"), ("./d/e.txt", "d/e.txt"), ("/work/x/y", "x/y"),
                                           ("d//e", "d/e")])  # fmt: skip
def test_paths_resolve_beneath_the_work_dir(path, expected):
    assert _relpath(path) == expected


@pytest.mark.parametrize("path", ["/etc/passwd", "/workx/a", "../a", "a/../../b", "/work", "", ".", "a\0b"])
def test_paths_outside_the_work_dir_are_refused(path):
    with pytest.raises(PermissionError):
        _relpath(path)


def test_control_characters_are_escaped():
    assert escape_controls("a\x1b[31mb\x00\x07\r\n\t\u202e\x9b") == "a\\x1b[31mb\\x00\\x07\n\t\\u202e\\x9b"
    r = ExecResult(exit_code=0, stdout="\x1b]0;title\x07ok\n", stderr="")
    assert r.as_text() == "\\x1b]0;title\\x07ok\n"


def test_uid_leases_are_distinct_across_processes_and_end_with_them(tmp_path, monkeypatch):
    """Two holders (here: this process and a child) never get the same uid; a holder's
    death frees its uid; accounts in the range are skipped."""
    import pwd

    from agentrl.sandbox import uids

    first = next(u for u in range(5000, 6000) if _no_account(pwd, u) and _no_account(pwd, u + 1))
    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", f"{first}-{first + 2}")
    monkeypatch.setattr(uids, "lock_dir", lambda: str(tmp_path))
    a = uids.lease_uid()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from agentrl.sandbox import uids; "
         f"uids.lock_dir = lambda: {str(tmp_path)!r}; l = uids.lease_uid(); print(l.uid, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        b = int(child.stdout.readline())
        assert (a.uid, b) == (first, first + 1)
        c = uids.lease_uid()  # the last one
        assert c.uid == first + 2
        with pytest.raises(uids.SandboxError, match="in use"):
            uids.lease_uid()
    finally:
        child.stdin.close()
        child.wait(10)
    d = uids.lease_uid()  # the child died: its uid is free again
    assert d.uid == first + 1
    for lease in (a, c, d):
        lease.release()
    assert uids.lease_uid().uid == first


def test_an_entry_another_user_planted_in_the_shared_lock_dir_skips_that_uid(tmp_path, monkeypatch):
    """The lock dir is shared and sticky: a symlink planted at a uid's name (which its victim
    cannot remove) costs that uid, not every lease on the host; all planted: the error says so."""
    import pwd

    from agentrl.sandbox import uids

    first = next(u for u in range(6000, 7000) if _no_account(pwd, u) and _no_account(pwd, u + 1))
    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", f"{first}-{first + 1}")
    monkeypatch.setattr(uids, "lock_dir", lambda: str(tmp_path))
    (tmp_path / str(first)).symlink_to(tmp_path / "elsewhere")
    lease = uids.lease_uid()
    assert lease.uid == first + 1
    assert not (tmp_path / "elsewhere").exists()  # the link was not followed
    lease.release()
    (tmp_path / str(first + 1)).unlink()
    (tmp_path / str(first + 1)).symlink_to("/etc/passwd")
    with pytest.raises(uids.SandboxError, match=r"2 entries .* links or files this user cannot open"):
        uids.lease_uid()


def test_a_readable_file_another_user_planted_is_not_leased(tmp_path, monkeypatch):
    """A 0644 file another user planted at a uid's name opens fine, but its owner can unlink it
    (sticky dir, their file) and plant a new one: the next lease locks the new inode, and two
    sandboxes share the uid.  Only a file of our own (or root's) is leased."""
    import pwd

    from agentrl.sandbox import uids

    if os.geteuid() != 0:
        pytest.skip("planting a file as another user needs root here")
    first = next(u for u in range(7000, 8000) if _no_account(pwd, u) and _no_account(pwd, u + 1))
    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", f"{first}-{first + 1}")
    monkeypatch.setattr(uids, "lock_dir", lambda: str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # act as an ordinary user whose files are 4242's
    planted = tmp_path / str(first)
    planted.touch(mode=0o644)
    os.chown(planted, 31337, 31337)
    mine = tmp_path / str(first + 1)
    mine.touch(mode=0o644)
    os.chown(mine, 4242, 4242)
    lease = uids.lease_uid()
    assert lease.uid == first + 1
    lease.release()


def test_a_lease_file_is_ours_alone(tmp_path, monkeypatch):
    """Lease files are 0600: one that another user could open (0644, in the shared dir) they
    could flock, holding that uid, and every uid of the range in turn, so no sandbox would start.
    A 0644 file an older agentrl made is made 0600 when it is next leased."""
    import pwd
    import stat

    from agentrl.sandbox import uids

    first = next(u for u in range(8000, 9000) if _no_account(pwd, u) and _no_account(pwd, u + 1))
    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", f"{first}-{first + 1}")
    monkeypatch.setattr(uids, "lock_dir", lambda: str(tmp_path))
    old = os.umask(0)  # the mode is the file's own, not the umask's doing
    try:
        a = uids.lease_uid()
        (tmp_path / str(first + 1)).touch(mode=0o644)
        b = uids.lease_uid()
    finally:
        os.umask(old)
    assert (a.uid, b.uid) == (first, first + 1)
    for uid in (first, first + 1):
        assert stat.S_IMODE(os.stat(tmp_path / str(uid)).st_mode) == 0o600
    a.release()
    b.release()


def _no_account(pwd, uid: int) -> bool:  # noqa: ANN001
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def test_uid_range_setting_is_checked(monkeypatch):
    from agentrl.sandbox import uids

    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", "5-10")
    with pytest.raises(uids.SandboxError, match="1000 <= FIRST"):
        uids.uid_range()
    monkeypatch.setenv("AGENTRL_SANDBOX_UIDS", "many")
    with pytest.raises(uids.SandboxError, match="FIRST-LAST"):
        uids.uid_range()


class _CountingBuffer(bytearray):
    """A bytearray that counts the bytes its searches for a newline look at."""

    scanned = 0

    def __contains__(self, item: object) -> bool:
        type(self).scanned += len(self)
        return super().__contains__(item)  # type: ignore[operator]

    def find(self, sub, start=0, *args):  # noqa: ANN001, ANN002
        type(self).scanned += len(self) - (start or 0)
        return super().find(sub, start, *args)


async def test_docker_transport_reads_a_large_multi_frame_response_once():
    """The attach stream cuts a response into frames (stderr frames between them); the host finds
    the response's end in each new frame only, so a big response costs its length, not
    frames x length (8 MiB in 16 KiB frames: 512 frames; rescanning the buffer per frame was
    2 GiB of memchr).  Counted in bytes looked at, not in seconds."""
    import asyncio
    import json
    import struct

    from agentrl.sandbox import SandboxError
    from agentrl.sandbox.docker import DockerSandbox

    class Writer:
        def write(self, data: bytes) -> None:
            pass

        async def drain(self) -> None:
            pass

    big = {"id": "a", "ok": True, "data": "x" * (8 << 20)}
    small = {"id": "b", "ok": True, "data": "\u00e9"}
    stream = (json.dumps(big) + "\n" + json.dumps(small) + "\n").encode()
    frames = bytearray()
    for i in range(0, len(stream), 16 << 10):  # the second response starts inside the first's last frame
        chunk = stream[i : i + (16 << 10)]
        frames += struct.pack(">BxxxL", 1, len(chunk)) + chunk
        if i % (1 << 20) == 0:
            frames += struct.pack(">BxxxL", 2, 5) + b"warn\n"
    reader = asyncio.StreamReader(limit=1 << 20)
    reader.feed_data(bytes(frames))
    reader.feed_eof()
    box = DockerSandbox(SandboxLimits())
    try:
        box._reader, box._writer, box._outbuf = reader, Writer(), _CountingBuffer()  # type: ignore[assignment]
        assert await box._request({"op": "read"}, 10.0) == big
        assert await box._request({"op": "read"}, 10.0) == small  # already buffered: no frame read
        assert _CountingBuffer.scanned <= 2 * len(stream), _CountingBuffer.scanned
        with pytest.raises(SandboxError, match="agent gone"):
            await box._request({"op": "ping"}, 10.0)
        assert b"".join(box._stderr_tail) == b"warn\n" * 9
    finally:
        unregister(box)
