"""`agentrl export RUN_DIR [--step N] --out DIR`: a kept checkpoint as a Hugging Face model dir.

1. checkpoint   ``RUN_DIR/checkpoints/step_N`` (default: the latest complete one); which
                steps are kept is ``trainer.keep_checkpoints``
2. model dir    the architecture (``config.json``) and tokenizer: ``--model``, else the
                run's ``model.path`` from ``RUN_DIR/config.toml`` (as a path, or relative to
                the directory holding ``runs/``), else ``RUN_DIR/final``.  The SFT warm
                start keeps the base model's architecture and tokenizer, so the base serves.
3. weights      the checkpoint's model state (a sharded one's shards put together), loaded
                strictly into that architecture;
                a LoRA checkpoint (its keys hold ``lora_A``/``lora_B``) is rebuilt with the
                same adapters (rank from the tensors, alpha from ``trainer.lora_alpha``) and
                merged, so the output is a plain model
4. write        safetensors + config + tokenizer + ``agentrl_export.json`` (provenance) into
                a temporary directory beside ``--out``, renamed into place

The result loads with ``AutoModelForCausalLM.from_pretrained(out)`` and serves with
``agentrl serve out`` (or vLLM).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.config import load_config
from agentrl.errors import AgentrlError
from agentrl.trainer.checkpoint import (
    checkpoint_name,
    checkpoint_step,
    complete_checkpoints,
    load_checkpoint,
    load_sharded_weights,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_A\.default\.weight$")


@dataclass
class Exported:
    """What :func:`export_checkpoint` wrote."""

    out: Path
    step: int
    checkpoint: Path
    model_dir: Path  # where config.json and the tokenizer came from
    lora_merged: bool


def export_checkpoint(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, model_dir: str | Path | None = None,
    dtype: str = "auto",
) -> Exported:
    """Write checkpoint ``step`` (default: the latest) of ``run_dir`` as an HF model dir at ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype != "auto" and dtype not in DTYPES:
        raise AgentrlError(f"unknown --dtype {dtype!r}; choose auto (as trained), {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AgentrlError(f"--out {out} already exists and is not empty; remove it or choose another directory")
    cfg = _run_config(run_dir)
    # 1) checkpoint
    ckpt = pick_checkpoint(run_dir, step)
    # 2) model dir
    source = resolve_model_dir(run_dir, cfg, model_dir)
    # 3) weights
    trainer_state, _ = load_checkpoint(ckpt)
    weights = load_sharded_weights(trainer_state["sharded"]) if "sharded" in trainer_state else trainer_state["model"]
    model, lora = _build_model(source, weights, cfg, ckpt)
    if dtype != "auto":
        model = model.to(DTYPES[dtype])
    # 4) write
    from transformers import AutoTokenizer

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
        meta = {"run_dir": str(run_dir.resolve()), "step": checkpoint_step(ckpt), "checkpoint": str(ckpt.resolve()),
                "model_dir": str(source.resolve()), "lora_merged": lora}
        (tmp / "agentrl_export.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            out.rmdir()  # checked empty above
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AgentrlError(f"cannot write the export to {out}: {e.strerror or e}") from e
    return Exported(out, checkpoint_step(ckpt), ckpt, source, lora)


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of ``step`` (None: the latest); a one-line error lists the kept steps."""
    kept = complete_checkpoints(run_dir)
    if not kept:
        raise AgentrlError(
            f"no complete checkpoint in {run_dir / 'checkpoints'}; a run saves one every trainer.checkpoint_every "
            "steps and at the end"
        )
    if step is None:
        return kept[-1]
    for ckpt in kept:
        if ckpt.name == checkpoint_name(step):
            return ckpt
    steps = ", ".join(str(checkpoint_step(c)) for c in kept)
    raise AgentrlError(
        f"no complete checkpoint of step {step} in {run_dir / 'checkpoints'}; kept: {steps} "
        "(trainer.keep_checkpoints sets how many are kept; 0 keeps all)"
    )


def resolve_model_dir(run_dir: Path, cfg: Any, explicit: str | Path | None) -> Path:
    """Where the architecture and the tokenizer come from (module docstring, phase 2)."""
    if explicit is not None:
        if not _is_model_dir(Path(explicit)):
            raise AgentrlError(f"--model {explicit} is not a HF model dir (needs config.json and a tokenizer)")
        return Path(explicit)
    path = Path(cfg.model.path)
    tried = [path] if path.is_absolute() else [Path.cwd() / path, run_dir.resolve().parent.parent / path, run_dir / path]
    tried.append(run_dir / "final")
    for candidate in tried:
        if _is_model_dir(candidate):
            return candidate
    raise AgentrlError(
        f"cannot find the run's model (config.json + tokenizer) for {run_dir}; looked in "
        f"{', '.join(str(p) for p in dict.fromkeys(tried))}; pass --model DIR (the run's model.path)"
    )


# ----------------------------------------------------------------------------- internals


def _run_config(run_dir: Path) -> Any:
    if not (run_dir / "config.toml").is_file():
        raise AgentrlError(f"{run_dir} is not a run directory (no config.toml); pass the RUN_DIR of `agentrl run`")
    return load_config([run_dir / "config.toml"])


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


def _build_model(source: Path, weights: dict[str, torch.Tensor], cfg: Any, ckpt: Path) -> tuple[Any, bool]:
    """The checkpoint's weights in ``source``'s architecture; LoRA merged.  Returns (model, was LoRA)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    adapters = {m.group(1): w for k, w in weights.items() if (m := _LORA_KEY.match(k))}
    if adapters:
        model = _with_adapters(model, adapters, cfg.trainer.lora_alpha)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise AgentrlError(
            f"the weights in {ckpt} do not fit the model in {source} ({first}); pass --model with the run's model dir"
        ) from e
    if adapters:
        model = model.merge_and_unload()
    model.eval()
    return model, bool(adapters)


def _with_adapters(model: Any, adapters: dict[str, torch.Tensor], alpha: float) -> Any:
    """The same PEFT wrapper the trainer trained (rank and target modules read off the tensors)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise AgentrlError("this checkpoint holds LoRA adapters; merging them needs peft: pip install 'agentrl[lora]'") from e
    ranks = {w.shape[0] for w in adapters.values()}
    if len(ranks) != 1:
        raise AgentrlError(f"LoRA adapters of several ranks {sorted(ranks)} in one checkpoint; cannot export it")
    targets = sorted({name.rsplit(".", 1)[-1] for name in adapters})
    lora = LoraConfig(r=ranks.pop(), lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, lora)
