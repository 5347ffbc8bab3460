"""Shared fixtures: a tiny model taught one tool call, served by a real engine subprocess."""

from __future__ import annotations

import pytest
from testkit import SERVER_PROCESS
from tool_call_model import MAX_MODEL_LEN, TOOL_PROMPT, TOOLS, teach_tool_call  # noqa: F401 (re-exported)
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.inference import start_embedded_engine
from agentrl.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", layers=2, hidden=64, heads=2)
    teach_tool_call(path)
    return path


@pytest.fixture(scope="session")
def engine(model_dir):
    with start_embedded_engine(model_dir, max_batch_size=16, max_model_len=MAX_MODEL_LEN, device="cpu",
                               server_process=SERVER_PROCESS) as eng:
        yield eng


@pytest.fixture(scope="session")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def tools():
    return TOOLS


@pytest.fixture(scope="session")
def tool_prompt():
    return TOOL_PROMPT


@pytest.fixture(scope="session")
def max_model_len():
    return MAX_MODEL_LEN


ENGINE_KEY = "arl-test-key-0123456789"


@pytest.fixture(scope="session")
def keyed_engine(model_dir):
    """An engine given its key explicitly: every route but /health needs it."""
    with start_embedded_engine(model_dir, max_batch_size=4, max_model_len=MAX_MODEL_LEN, device="cpu",
                               api_key=ENGINE_KEY, server_process=SERVER_PROCESS) as eng:
        yield eng
