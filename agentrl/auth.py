"""API keys: one secret per run or server, sent as ``Authorization: Bearer KEY``.

The rules every agentrl server and client follows (README: "Keys and ports"):

- A server takes its key from ``--api-key`` or ``AGENTRL_API_KEY`` (vLLM's convention).
  Given that way the key is *explicit* and guards every route but ``/health``.
- A server started without one makes one (:func:`server_key`) and writes it 0600 where its
  own clients find it (the run dir, or a path it prints).  A made key guards the control
  and weight routes only: a server nobody gave a key to stays an open OpenAI endpoint on
  loopback, but nobody who merely reaches its port can pause it or replace its weights.
- Clients read ``AGENTRL_API_KEY`` (:func:`client_key`); a run hands its key to its own
  engines and clients through that variable.
- Comparisons are constant-time (:func:`matches`); weight pushes are signed with an HMAC
  of the key (:func:`sign` / :func:`verify`), so a transfer proves its sender chunk by chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KEY_ENV = "AGENTRL_API_KEY"
KEY_FILE = "api_key"  # the name of the key file inside a run dir
_written: set[Path] = set()  # key files this process wrote (what a child program must not read)


@dataclass(frozen=True)
class ServerKey:
    """A server's key and where it came from."""

    value: str
    explicit: bool  # given by the user: guards every route; made here: control routes only
    path: Path | None = None  # where a made key was written (0600), for the server's clients

    def guards(self, control: bool) -> bool:
        """Whether a route (a control/weight route when ``control``) needs the key."""
        return control or self.explicit


def new_key() -> str:
    """A fresh key: 256 bits, URL-safe."""
    return "arl-" + secrets.token_urlsafe(32)


def server_key(explicit: str | None = None, write_to: str | Path | None = None) -> ServerKey:
    """The key a server uses: ``explicit`` (a flag), else ``AGENTRL_API_KEY``, else a new one.

    A new key is written to ``write_to`` with mode 0600 (created that way, never widened
    later) so that the server's own clients can read it.
    """
    given = explicit or os.environ.get(KEY_ENV) or ""
    if given.strip():
        return ServerKey(given.strip(), explicit=True)
    key = new_key()
    path = Path(write_to) if write_to is not None else None
    if path is not None:
        write_key(path, key)
    return ServerKey(key, explicit=False, path=path)


def write_key(path: str | Path, key: str) -> Path:
    """Write ``key`` to ``path``, readable by its owner only (0600 from the first byte)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a fresh random name, created here (O_EXCL, no symlink): a file someone planted in a shared
    # directory under a predictable name would have received the key and kept its own mode
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _written.add(path.resolve())
    return path


def hide_key_files(paths: Iterable[str | Path]) -> None:
    """Count ``paths`` among :func:`key_files` in this process: key files another process wrote
    (the run's ``RUN_DIR/api_key``, for a rollout worker that runs harness programs)."""
    _written.update(Path(p).resolve() for p in paths)


def key_dir() -> Path:
    """The user's own key directory: where a server that made its own key writes it."""
    return Path.home() / ".cache" / "agentrl" / "keys"


def key_files() -> tuple[list[Path], list[Path]]:
    """(files, directories) holding keys that a program this process starts must not read: the
    key files it wrote (a run's ``RUN_DIR/api_key``) and :func:`key_dir`, those that exist."""
    files = sorted(p for p in _written if p.is_file())
    return files, [d for d in (key_dir(),) if d.is_dir()]


def check_private_path(path: Path) -> None:
    """Refuse ``path`` (PermissionError, naming why) unless no other user can put a file into it or
    any directory above it: each is owned by this user or root, and not writable by others unless
    sticky (``/tmp``) with the entry below it ours.  Code loaded or run from a place another user
    can write to runs their code, with this process's keys."""
    uid, below_ours = os.getuid(), True
    for d in [path, *path.parents]:
        st = d.stat()
        if st.st_uid not in (uid, 0):
            raise PermissionError(f"{d} belongs to another user (uid {st.st_uid})")
        others_write = st.st_mode & 0o002 or (st.st_mode & 0o020 and not _own_group(st.st_gid))
        if others_write and not (st.st_mode & stat.S_ISVTX and below_ours):
            raise PermissionError(f"{d} is writable by others (mode {oct(st.st_mode & 0o7777)})")
        below_ours = st.st_uid == uid


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (umask 002 makes files group-writable there):
    no member listed but us, and no other account's primary group."""
    import grp
    import pwd

    try:
        me = pwd.getpwuid(os.getuid()).pw_name
        if set(grp.getgrgid(gid).gr_mem) - {me}:
            return False
        return all(p.pw_uid == os.getuid() for p in pwd.getpwall() if p.pw_gid == gid)
    except KeyError:  # a uid or gid with no entry: nothing says the group is ours alone
        return False


def read_key(path: str | Path) -> str:
    """The key stored at ``path`` by :func:`write_key`."""
    return Path(path).read_text().strip()


def run_key(run_dir: str | Path) -> str:
    """The key of one ``agentrl run``: ``AGENTRL_API_KEY`` when set, else a new one; written 0600
    to ``RUN_DIR/api_key`` so the user's own tools (``agentrl eval --base-url``, curl) can reach
    the run's engines.  The run hands it to its engines, clients and actors as an argument."""
    key = client_key() or new_key()
    write_key(Path(run_dir) / KEY_FILE, key)
    return key


def client_key(default: str | None = None) -> str | None:
    """The key a client sends: ``AGENTRL_API_KEY`` when set, else ``default``."""
    return os.environ.get(KEY_ENV, "").strip() or default


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None when absent or another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def matches(key: str, presented: str | None) -> bool:
    """Constant-time comparison of a presented token with the key (None never matches)."""
    if presented is None:
        return False
    # surrogatepass: a header's undecodable bytes or a JSON "\ud800" are a wrong key, not a 500
    return hmac.compare_digest(key.encode(), presented.encode("utf-8", "surrogatepass"))


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a client sends with ``key`` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def sign(key: str, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``parts`` under ``key``; each part's length is bound in, so
    ``(b"ab", b"c")`` and ``(b"a", b"bc")`` sign differently."""
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.hexdigest()


def verify(key: str, signature: str | None, *parts: bytes) -> bool:
    """Whether ``signature`` is :func:`sign` of ``parts`` under ``key`` (constant-time)."""
    if not signature or not signature.isascii():  # compare_digest raises on non-ASCII str: a 500, not a no
        return False
    return hmac.compare_digest(sign(key, *parts), signature)
