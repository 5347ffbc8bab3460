"""Inference: the PolicyClient every part of agentrl samples through, and the embedded engine.

``PolicyClient`` speaks the OpenAI API (plus vLLM's token-exact fields) to any endpoint and
owns retries and load balancing; ``open_policy`` starts agentrl's own torch engine
(``agentrl.inference.server``) in a child process or connects to running servers.
Importing this package imports nothing heavy; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Completion": "agentrl.types",
    "ContextLengthExceeded": "agentrl.errors",
    "EndpointError": "agentrl.errors",
    "EngineStartError": "agentrl.errors",
    "EngineArgs": "agentrl.inference.engine_args",
    "PinnedClient": "agentrl.inference.client",
    "PolicyClient": "agentrl.inference.client",
    "EngineHandle": "agentrl.inference.launcher",
    "Policy": "agentrl.inference.launcher",
    "engine_devices": "agentrl.inference.launcher",
    "open_policy": "agentrl.inference.launcher",
    "start_embedded_engine": "agentrl.inference.launcher",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'agentrl.inference' has no attribute {name!r}")
