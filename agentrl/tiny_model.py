"""Build a tiny, real Hugging Face causal LM locally (no model hub needed).

``build_tiny_model(out_dir)`` writes a Llama-architecture model (tied embeddings, ~1M
parameters at the defaults) with ``save_pretrained`` (safetensors) and a fast byte-level BPE
tokenizer trained at build time on a small built-in synthetic corpus (chat turns, JSON tool
calls, arithmetic, short Python).  Digits are split one per token so arithmetic stays
learnable; chat markers are single special tokens; any text still tokenizes (byte fallback
through the byte-level alphabet).

The chat template is Qwen/Hermes style::

    <|im_start|>system\\n{system}\\n<tools>\\n{compact tool JSON, one per line}\\n</tools><|im_end|>\\n
    <|im_start|>user\\n{text}<|im_end|>\\n
    <|im_start|>assistant\\n{text}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>tool\\n{result}<|im_end|>\\n

Assistant text (including the closing ``<|im_end|>``, which is the eos the model must learn
to emit) sits inside ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works for
SFT.  The template is prefix-stable: rendering ``messages[:k]`` with
``add_generation_prompt=True`` is a prefix of rendering ``messages[:k+1]``.

The tokenizer depends only on ``vocab_size`` (not on ``seed``), so tiny models built with
different seeds share one vocabulary; ``seed`` drives the weight initialisation.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

from agentrl.models import chatml_template

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]  # ids 0, 1, 2
MARKER_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]  # single tokens, decoded as normal text

# the system turn: the system message, then tool schemas as compact JSON, one per line, in <tools>
CHAT_TEMPLATE = chatml_template(
    "{%- if has_system or tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0].content) -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if has_system -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tools>\\n' -}}"
    "{%- for tool in tools -%}"
    "{{- (tool.function if tool.function is defined else tool) | tojson(separators=(',', ':')) -}}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tools>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)


# ----------------------------------------------------------------------------- corpus


def _corpus(n_docs: int = 3000, seed: int = 0) -> list[str]:
    """Synthetic text the BPE merges are learned from (specials are added separately)."""
    rng = random.Random(seed)
    ops = ["+", "-", "*", "/"]
    words = (
        "the a is of to and what answer result compute calculator tool call function value "
        "number sum product difference please use return name arguments expression question "
        "hello thanks you can help me with this task solve find python code list string true "
        "false error input output file run test check step first then final"
    ).split()
    tools = ["calculator", "python", "search", "read_file", "write_file", "run_tests", "submit"]
    docs: list[str] = []
    for _ in range(n_docs):
        kind = rng.randrange(6)
        a, b = rng.randrange(1000), rng.randrange(1000)
        op = rng.choice(ops)
        if kind == 0:
            docs.append(f"What is {a}{op}{b}? The answer is {a}{op}{b} = {rng.randrange(10**6)}.")
        elif kind == 1:
            name = rng.choice(tools)
            args = {"expression": f"{a}{op}{b}"} if name == "calculator" else {"code": f"print({a}{op}{b})"}
            docs.append(json.dumps({"name": name, "arguments": args}))
        elif kind == 2:
            schema = {
                "name": rng.choice(tools),
                "description": " ".join(rng.choices(words, k=6)),
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            }
            docs.append(json.dumps(schema, separators=(",", ":")))
        elif kind == 3:
            docs.append(f"def f(x):\n    return x {op} {a}\n\nprint(f({b}))\n")
        elif kind == 4:
            role = rng.choice(["system", "user", "assistant", "tool"])
            docs.append(f"{role}\n" + " ".join(rng.choices(words, k=rng.randrange(3, 12))) + ".")
        else:
            docs.append(f"user\nWhat is {a} {op} {b}?\nassistant\n{TOOL_CALL_OPEN}\n{TOOL_CALL_CLOSE}\n<tools>\n</tools>")
    return docs


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int = 512):
    """A fast byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------- model


def build_tiny_model(
    out_dir: str | Path,
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    intermediate: int | None = None,
    vocab_size: int = 512,
    max_position: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a tiny Llama causal LM + tokenizer to ``out_dir`` and return the path.

    Deterministic for given arguments.  Loads with ``AutoModelForCausalLM`` /
    ``AutoTokenizer``; standard files (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json), so vLLM can serve it too.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if (hidden // heads) % 2:
        raise ValueError(f"head dim hidden/heads = {hidden // heads} must be even (rotary embeddings)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- other families

FAMILY_WINDOW = 16  # sliding windows are short, so prompts + completions cross them

# family -> (config class name in transformers, what makes it that family)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),  # q/k/v bias
    "qwen2-sliding": ("Qwen2Config", {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": FAMILY_WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32}),  # q/k norm, head_dim ≠ hidden/heads
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": FAMILY_WINDOW}),
    "gemma2": ("Gemma2Config", {  # eager attention, attention + final-logit softcapping, sliding/full layers
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": FAMILY_WINDOW,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    }),
    "phi3": ("Phi3Config", {  # fused qkv / gate_up, window, dropout in the config (the engine runs it off)
        "num_key_value_heads": 2, "sliding_window": FAMILY_WINDOW + 8, "resid_pdrop": 0.1, "attention_dropout": 0.1,
        "embd_pdrop": 0.1,
    }),
}


@cache
def _tokenizer512():
    return build_tokenizer(512)


def build_family_model(out_dir: str | Path, family: str, *, dtype: str = "float32", seed: int = 0,
                       **overrides: Any) -> Path:  # fmt: skip
    """Write a 2-layer, hidden-64 random model of ``family`` (a :data:`FAMILIES` key, or any
    ``transformers`` config class name) with agentrl's tokenizer; ``overrides`` go to the config.

    No hub: the family's own config class with tiny sizes; weights drawn at
    ``initializer_range`` 0.2 so next-token distributions are far from uniform (a wrong mask
    or a skipped logit transform then moves logprobs by whole nats).  The engine parity suite
    (``tests/inference/test_parity.py``) runs over these.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    config_name, family_kw = FAMILIES.get(family, (family, {}))
    tok = _tokenizer512()
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(PAD)
    kw = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 512, "initializer_range": 0.2,
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad,
        **family_kw, **overrides,
    }  # fmt: skip
    config = getattr(transformers, config_name)(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
