"""The key check agentrl loads into every ``vllm serve`` it starts (``--middleware``).

vLLM's own ``--api-key`` guards only ``/v1``-style routes: its dev-mode routes
(``/collective_rpc``, ``/pause``, ``/reset_prefix_cache``, the weight-transfer routes), which
agentrl needs to push weights, answer anyone who reaches the port, and ``/collective_rpc``
calls any worker method with caller-chosen arguments.  This ASGI middleware asks every
route but ``/health`` for ``Authorization: Bearer $AGENTRL_API_KEY`` (constant-time).

Standard library only: it runs inside vLLM's venv, where agentrl is not installed; the
launcher copies this file into a private directory on the server's ``PYTHONPATH``.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

OPEN_PATHS = frozenset({"/health"})  # polled before the key is known to the poller


class KeyGuard:
    """``app.add_middleware(KeyGuard)``: 401 for any request without the run's key."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get("AGENTRL_API_KEY", "").strip()
        if not key:  # refuse to serve the dev routes unguarded
            raise RuntimeError("agentrl_vllm_guard: AGENTRL_API_KEY is not set")
        self.key = key.encode()

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if scope.get("path") in OPEN_PATHS:
            return True
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": "missing or wrong API key", "type": "Unauthorized", "code": 401}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body.encode()})
