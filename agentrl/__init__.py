"""agentrl: agentic, multi-turn, asynchronous RL for language models."""

__version__ = "0.1.0"
