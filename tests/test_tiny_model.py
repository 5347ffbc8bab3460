"""The tiny model builder: real HF files, deterministic, a tool-aware prefix-stable template."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.tiny_model import IM_END, build_tiny_model
from agentrl.tool_format import format_assistant_text, parse_tool_calls
from agentrl.types import Message, ToolCall

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


def _conversation() -> list[dict]:
    call = ToolCall(name="calculator", arguments=json.dumps({"expression": "12+30"}), id="c1")
    return [
        Message("system", "You solve arithmetic.").to_dict(),
        Message("user", "What is 12+30?").to_dict(),
        Message("assistant", "Let me compute.", tool_calls=[call]).to_dict(),
        Message("tool", "42", tool_call_id="c1").to_dict(),
        Message("assistant", "42").to_dict(),
    ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", layers=2, hidden=64, heads=2)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_loads_with_auto_classes_and_is_small(tiny_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama"
    assert model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id
    assert tok.pad_token == "<|endoftext|>"
    assert model.config.vocab_size == len(tok)
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, len(tok))
    assert (tiny_dir / "model.safetensors").exists() and (tiny_dir / "tokenizer.json").exists()


def test_default_size_is_in_range(tmp_path):
    path = build_tiny_model(tmp_path / "d")
    n = sum(t.numel() for t in load_file(path / "model.safetensors").values())
    assert 1_000_000 <= n <= 10_000_000


def test_deterministic_for_a_seed(tmp_path, tiny_dir):
    again = build_tiny_model(tmp_path / "again", layers=2, hidden=64, heads=2)
    other = build_tiny_model(tmp_path / "other", layers=2, hidden=64, heads=2, seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (tiny_dir, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tiny_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_markers_are_single_tokens_and_text_round_trips(tok):
    for marker in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<|endoftext|>"]:
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    assert tok.encode("1234", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "1234"]
    text = 'héllo wörld 🙂 {"a": [1, 2]}\n\tdef f(x): return x*2'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_template_renders_tools_compactly_and_calls_in_tool_format(tok):
    msgs = _conversation()
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert '<tools>\n{"name":"calculator","description"' in text
    # the assistant turn is exactly what the shared tool format writes and parses
    call = ToolCall.from_dict(msgs[2]["tool_calls"][0])
    turn = format_assistant_text("Let me compute.", [call])
    assert f"<|im_start|>assistant\n{turn}<|im_end|>\n" in text
    parsed = parse_tool_calls(turn)
    assert parsed.content == "Let me compute." and not parsed.errors
    assert parsed.tool_calls[0].name == "calculator"
    assert json.loads(parsed.tool_calls[0].arguments) == {"expression": "12+30"}
    assert "<|im_start|>tool\n42<|im_end|>\n" in text
    # dict arguments (HF convention) render like JSON-string arguments
    hf = [dict(m) for m in msgs]
    hf[2] = {**hf[2], "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "12+30"}}}]}
    assert tok.apply_chat_template(hf, tools=TOOLS, tokenize=False) == text


def test_the_template_text_is_the_one_tiny_models_were_built_with():
    """The tiny template is built by the same builder as imported models' (chatml_template); its
    text must stay what every tiny model dir (and SFT cache) already holds: a change is deliberate."""
    from agentrl.tiny_model import CHAT_TEMPLATE

    digest = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert digest == "0220c841f7d6ceac8fc53e973d4e982f3a713dd474c77236969486b30f49735c"


def test_template_is_prefix_stable_in_text_and_tokens(tok):
    msgs = _conversation()
    for k in range(1, len(msgs)):
        gen = msgs[k]["role"] == "assistant"
        head = tok.apply_chat_template(msgs[:k], tools=TOOLS, tokenize=False, add_generation_prompt=gen)
        full = tok.apply_chat_template(msgs[: k + 1], tools=TOOLS, tokenize=False)
        assert full.startswith(head), k
        head_ids = tok.encode(head, add_special_tokens=False)
        full_ids = tok.encode(full, add_special_tokens=False)
        assert full_ids[: len(head_ids)] == head_ids, k


def test_assistant_mask_covers_assistant_text_and_eos(tok):
    out = tok.apply_chat_template(
        _conversation(), tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked.startswith("Let me compute.\n<tool_call>")
    assert masked.endswith("</tool_call><|im_end|>42<|im_end|>")
    assert "tool\n42" not in masked and "What is" not in masked


@pytest.mark.slow
def test_cli_model_init(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "agentrl.cli", "model", "init", "tiny", str(out), "--layers", "1", "--hidden", "32"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    bad = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "model", "init", "huge", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "unknown model kind" in bad.stderr and "Traceback" not in bad.stderr
