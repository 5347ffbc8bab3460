"""Inference: the PolicyClient every part of agentrl samples through, and the embedded engine.

``PolicyClient`` speaks the OpenAI API (plus vLLM's token-exact fields) to any endpoint;
``start_embedded_engine`` runs agentrl's own torch engine (``agentrl.inference.server``)
in a child process.  Importing this package does not import torch.
"""

from agentrl.inference.client import Completion, ContextLengthExceeded, EndpointError, PolicyClient
from agentrl.inference.launcher import EngineHandle, EngineStartError, start_embedded_engine

__all__ = [
    "Completion",
    "ContextLengthExceeded",
    "EndpointError",
    "EngineHandle",
    "EngineStartError",
    "PolicyClient",
    "start_embedded_engine",
]
