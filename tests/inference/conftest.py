"""Shared fixtures: a tiny model taught one tool call, served by a real engine subprocess."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.inference import start_embedded_engine
from agentrl.tiny_model import build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
TOOL_PROMPT = [{"role": "user", "content": "What is 12+30?"}]
TOOL_REPLY = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": "12+30"})}}],
}
MAX_MODEL_LEN = 256


def teach_tool_call(model_dir, steps: int = 150) -> None:
    """Fine-tune the model (assistant tokens only) until it emits TOOL_REPLY for TOOL_PROMPT."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    enc = tok.apply_chat_template(
        TOOL_PROMPT + [TOOL_REPLY], tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = torch.tensor([enc["input_ids"]])
    labels = ids.clone()
    labels[0, torch.tensor(enc["assistant_masks"]) == 0] = -100
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", layers=2, hidden=64, heads=2)
    teach_tool_call(path)
    return path


@pytest.fixture(scope="session")
def engine(model_dir):
    with start_embedded_engine(model_dir, max_batch_size=16, max_model_len=MAX_MODEL_LEN, device="cpu") as eng:
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
