"""The sandboxes this process holds, and the exit and signal hooks that destroy them."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.sandbox.base import AgentSandbox

_LIVE: dict[str, AgentSandbox] = {}
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def register(sb: AgentSandbox) -> None:
    with _LIVE_LOCK:
        _LIVE[sb.id] = sb


def unregister(sb: AgentSandbox) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(sb.id, None)


def live_sandboxes() -> list[AgentSandbox]:
    with _LIVE_LOCK:
        return list(_LIVE.values())


def kill_all_sync() -> None:
    """Synchronously destroy every sandbox this process still holds (atexit / signals)."""
    for sb in live_sandboxes():
        try:
            sb.kill_sync()
        except Exception:
            pass
        unregister(sb)


def install_cleanup_hooks() -> None:
    """atexit + SIGTERM/SIGHUP handlers that destroy live sandboxes, then die as before.

    SIGINT needs nothing extra: it raises KeyboardInterrupt, the async context managers
    unwind, and atexit catches the rest.  Handlers are chained, never replaced silently,
    and only installed from the main thread.
    """
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    _HOOKS_INSTALLED = True
    atexit.register(kill_all_sync)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            kill_all_sync()
            if callable(previous):
                previous(signum, frame)
            else:  # SIG_DFL: die by the same signal, as if we had never been here
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
