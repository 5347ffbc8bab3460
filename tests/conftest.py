"""Fixtures every test folder shares: tiny models built once per session.

Both are read-only: a test that writes into a model dir (or beside it, as the SFT cache
does) builds its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer, 64-wide tiny Llama (+ tokenizer and tool-aware chat template)."""
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny", layers=2, hidden=64, heads=4)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """The smallest useful one: 1 layer, 32 wide (engine plumbing, Ray placement, faults)."""
    from agentrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small_model") / "tiny", layers=1, hidden=32, heads=2)
