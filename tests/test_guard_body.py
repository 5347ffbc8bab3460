"""The Guard's body cap on chunked bodies (no declared length), at the ASGI level: the app gets
the whole body or nothing, never a partial one."""

from __future__ import annotations

from door import RecordingApp

from agentrl.guard import Guard, Limits


async def _send_chunked(parts: list[bytes], *, leave: bool = False, cap: int = 100) -> tuple[RecordingApp, list[dict]]:
    app = RecordingApp()
    guard = Guard(app, None, limits=Limits(max_body_bytes=cap))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1"), (b"transfer-encoding", b"chunked")]}
    messages = [{"type": "http.request", "body": p, "more_body": i + 1 < len(parts) or leave} for i, p in enumerate(parts)]
    if leave:
        messages.append({"type": "http.disconnect"})
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope, receive, send)
    return app, sent


async def test_a_chunked_body_under_the_cap_reaches_the_app_whole():
    app, sent = await _send_chunked([b'{"prompt": ', b"[1, 2]}"])
    assert app.calls == [("/v1/completions", b'{"prompt": [1, 2]}')] and sent[0]["status"] == 200


async def test_a_chunked_body_over_the_cap_is_a_413_before_the_app():
    app, sent = await _send_chunked([b"x" * 60, b"x" * 60])
    assert app.calls == [] and sent[0]["status"] == 413


async def test_a_client_that_leaves_mid_body_is_not_passed_on():
    # the part that did arrive is a complete JSON request: it must not run as if it were the body
    app, sent = await _send_chunked([b'{"prompt": [1, 2]}'], leave=True)
    assert app.calls == [] and sent == []


def test_a_connection_cap_gets_room_under_the_open_file_limit():
    """The gateway shares the run's process: with a soft limit of 1,024 open files, its cap of
    1,024 connections would never be reached before every open() failed.  Listening raises the
    soft limit (up to the hard one) to the cap plus headroom; in a child, to leave ours alone."""
    import subprocess
    import sys

    code = """
import resource
from agentrl.guard import room_for_connections
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
room_for_connections(1024)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""
    soft, hard = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         check=True).stdout.split())  # fmt: skip
    assert soft == (2048 if hard == -1 or hard >= 2048 else hard), (soft, hard)
