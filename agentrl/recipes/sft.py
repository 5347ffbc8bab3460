"""`agentrl sft` (and phase 2 of `agentrl run`): the warm start, in numbered phases.

    1. base model   ``model.path``, written when missing: built (``model.init = "tiny"``) or
                    imported from a packaged GGUF (``"smollm2-135m"``, :mod:`agentrl.models`)
    2. data         ``env.demonstrations(n, seed)`` rendered with the model's chat template
                    (the same template and tool schemas the rollouts use); the loss covers
                    *assistant tokens only* (the template's ``{% generation %}`` blocks)
    3. cache        ``<model dir>-sft-<key>``: the key hashes everything that shapes the
                    weights (:func:`cache_inputs`: agentrl, torch and transformers versions
                    and this module's source, the base model's files, a hash of the rendered
                    data, ``[sft]``, the seed, the device type, the environment; with
                    ``sft.target_reward`` also what the early stop reads: the env's source
                    and its held-out tasks).  An entry is reused only when its manifest
                    (``sft_manifest.json``: those inputs and the sha256 of each weights file)
                    still matches; otherwise it is rebuilt, with a one-line note saying why
    4. train        AdamW on cross-entropy; with ``sft.target_reward`` a greedy held-out
                    evaluation every ``sft.eval_every`` steps stops it early, leaving the RL
                    stage headroom.  A run resumed from a checkpoint trains none: the
                    checkpoint holds the weights (:func:`start_from_checkpoint`)
    5. save         weights, tokenizer, manifest, then the marker, written beside the cache
                    entry and renamed into place
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.config import Config, ModelConfig, SFTConfig

MARKER = "SFT_COMPLETE"
MANIFEST = "sft_manifest.json"


def ensure_base_model(model_cfg: ModelConfig) -> Path:
    """The base model dir, written when missing: a tiny model (``model.init == "tiny"``) or a
    packaged one (``"smollm2-135m"``).  Only into a new or empty directory: a folder of other files
    is the user's (a hub cache, a folder beside the model), never replaced."""
    from agentrl.errors import AgentrlError
    from agentrl.recipes.rl import file_in_the_way

    path = Path(model_cfg.path)
    if (path / "config.json").is_file():
        if (note := ignored_model_settings(model_cfg, path)) is not None:
            from agentrl.recipes.rl import say

            say(note)
        return path
    if model_cfg.init == "none":
        raise AgentrlError(f"no model at {str(path)!r} and model.init = 'none'; point model.path at a HF model dir")
    build_here = f"or at a new or empty directory for model.init = {model_cfg.init!r} to build a model in"
    if (blocker := file_in_the_way(path)) is not None:
        raise AgentrlError(f"model.path {str(path)!r}: {blocker} is a file, not a directory; point model.path at a "
                           f"model's directory (where its config.json is), {build_here}")
    if path.is_dir() and any(path.iterdir()):
        raise AgentrlError(f"model.path {str(path)!r} holds files but no model (no config.json there); point "
                           f"model.path at the model's own directory (where its config.json is), {build_here}")
    given, path = path, Path(os.path.abspath(path))  # "." has no name to put ".building" beside
    from agentrl.metrics import busy

    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    if model_cfg.init == "tiny":
        from agentrl.tiny_model import build_tiny_model

        with busy(f"building the tiny model at {path} ..."):
            build_tiny_model(
                tmp, layers=model_cfg.tiny_layers, hidden=model_cfg.tiny_hidden, heads=model_cfg.tiny_heads,
                seed=model_cfg.seed,
            )
    else:
        from agentrl.models import init_known

        with busy(f"importing {model_cfg.init} into {path} (about a minute) ..."):
            init_known(model_cfg.init, tmp)
    if not (path / "config.json").is_file():  # another process may have won the race
        with contextlib.suppress(FileNotFoundError):
            path.rmdir()  # empty (checked above): anything else in it now is someone else's, and stops the rename
        tmp.rename(path)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return given


# what a model.path set explicitly describes, and the config.json keys that show it
TINY_SIZES = {"tiny_layers": "num_hidden_layers", "tiny_hidden": "hidden_size", "tiny_heads": "num_attention_heads"}


def ignored_model_settings(model_cfg: ModelConfig, path: Path) -> str | None:
    """One line naming ``model.init`` / ``model.tiny_*`` values that were asked for but do not describe
    the model already at ``path`` (they only shape a model built where none is), else None.  Only
    values set and not the defaults: a run's config.toml writes every default out."""
    defaults = type(model_cfg)()
    asked = {n for n in ("init", *TINY_SIZES) if n in model_cfg.model_fields_set
             and getattr(model_cfg, n) != getattr(defaults, n)}
    try:
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config") or config  # a multimodal model's decoder
        imported = json.loads((path / "agentrl_import.json").read_text()).get("gguf") \
            if (path / "agentrl_import.json").is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: the load that follows says what is wrong
    from agentrl.models import KNOWN

    wrong = []
    if "init" in asked and model_cfg.init in KNOWN:
        known = KNOWN[model_cfg.init]
        shape = (config.get("hidden_size"), config.get("num_hidden_layers"))
        if imported != known.filename and shape != known.shape:
            wrong.append(f"model.init = {model_cfg.init!r}")
    if model_cfg.init == "tiny":  # other inits build no tiny model: its sizes mean nothing there
        wrong += [f"model.{n} = {getattr(model_cfg, n)}" for n, key in TINY_SIZES.items()
                  if n in asked and getattr(model_cfg, n) != config.get(key)]
    if not wrong:
        return None
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    return (f"warning: {path} already holds a model ({arch}, hidden {config.get('hidden_size')}, "
            f"{config.get('num_hidden_layers')} layers, {config.get('num_attention_heads')} heads): "
            f"{', '.join(wrong)} ignored (model.init and model.tiny_* only build a model where none is); point "
            "model.path at a new directory to build one there")


def _hash_dir(path: Path) -> str:
    """Every file of the model dir (weights in any format and shards, config, tokenizer, remote code),
    less hidden files and docs, which shape no weights."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.suffix.lower() not in (".md", ".lock", ".log") \
                and not f.name.upper().startswith(("LICENSE", "NOTICE", "README")):
            h.update(f.name.encode())
            h.update(_sha256_file(f).encode())
    return h.hexdigest()


# settings only a held-out evaluation reads: without sft.target_reward none runs, so they shape nothing
EVAL_ONLY_SFT = ("eval_every", "eval_tasks")
_NOT_SOURCE = frozenset({"__pycache__", "build", "dist", "node_modules", "site-packages", "tests"})  # and test files


def held_out_tasks(env: Any, cfg: Config) -> list[Any]:
    """The tasks SFT's early stop evaluates (:class:`GreedyEvaluator`)."""
    return list(env.eval_dataset() or env.dataset())[: cfg.sft.eval_tasks]


def env_source(env: Any) -> str:
    """sha256 over the env's own code, which the early stop's reward runs: the modules of its class
    (and bases), of its load function and of its reward functions, and every .py file of its package
    dir (loaded from a path or an editable install).  agentrl's own code is keyed by its version."""
    import agentrl

    own = Path(agentrl.__file__).resolve().parent
    plugin = getattr(env, "plugin", None)
    modules = {c.__module__ for c in type(env).__mro__}
    if plugin is not None:
        modules.add(plugin.target.partition(":")[0])
    for f in getattr(getattr(env, "rubric", None), "funcs", []):
        fn = getattr(f, "fn", f)
        fn = getattr(fn, "func", fn)  # a functools.partial
        modules.add(getattr(fn, "__module__", None) or type(fn).__module__)
    files = {Path(file).resolve() for m in modules
             if (file := getattr(sys.modules.get(m or ""), "__file__", None)) and file.endswith(".py")}
    source_dir = getattr(plugin, "source_dir", None)
    if source_dir is not None:
        files |= {p.resolve() for p in Path(source_dir).rglob("*.py")
                  if not any(part.startswith(".") or part in _NOT_SOURCE or part.endswith(".egg-info")
                             for part in p.relative_to(source_dir).parts[:-1])
                  and not (p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py")}
    # content only, sorted: the same code moved elsewhere keeps its key
    digests = sorted(_sha256_file(f) for f in files if own not in f.parents and f.is_file())
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _tasks_sha(tasks: list[Any]) -> str:
    rows = [{k: v for k, v in t.to_dict().items() if k != "id"} for t in tasks]  # ids are random per load
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def cache_inputs(cfg: Config, base: Path, env: Any, data: list[tuple[list[int], list[int]]],
                 tasks: list[Any] | None = None) -> dict[str, Any]:
    """Everything that shapes the warm-start weights (the cache key hashes this).  ``tasks``: the
    held-out tasks (default :func:`held_out_tasks`), read only with ``sft.target_reward``."""
    import torch
    import transformers

    import agentrl
    from agentrl.trainer.trainer import resolve_device

    data_hash = hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()
    inputs: dict[str, Any] = {
        "code": {"agentrl": agentrl.__version__, "sft_source": _sha256_file(Path(__file__)),
                 "torch": torch.__version__, "transformers": transformers.__version__},
        "model": _hash_dir(base),
        "data": {"sha256": data_hash, "examples": len(data)},
        "env": [cfg.env.name, getattr(env, "version", ""), cfg.env.args],
        "sft": cfg.sft.model_dump(mode="json", exclude=set(EVAL_ONLY_SFT) if cfg.sft.target_reward is None else None),
        "seed": cfg.run.seed,
        "device": resolve_device(cfg.trainer.device).type,  # CPU and CUDA kernels round differently
    }
    if cfg.trainer.dtype != "float32":  # (float32 runs keep the keys they had before bf16 existed)
        from transformers import AutoConfig

        from agentrl.precision import use_bf16

        hidden = AutoConfig.from_pretrained(base).get_text_config().hidden_size
        if use_bf16(cfg.trainer.dtype, hidden, inputs["device"]):
            inputs["dtype"] = "bfloat16"
    if cfg.sft.target_reward is not None:  # early stopping reads greedy held-out rollouts, scored by the env's code
        tasks = held_out_tasks(env, cfg) if tasks is None else tasks
        inputs["eval"] = {"max_tokens": cfg.rollout.max_tokens, "max_turns": cfg.rollout.max_turns,
                          "tasks": _tasks_sha(tasks), "env_source": env_source(env)}
    return json.loads(json.dumps(inputs, sort_keys=True, default=str))  # as the manifest will read back


def sft_cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def verify_cached(entry: Path, inputs: dict[str, Any]) -> str | None:
    """Why a cached warm start cannot be reused (None: it can): its manifest must record these
    inputs and the weights files must still hash to what was saved."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    if manifest.get("inputs") != inputs:
        changed = sorted(k for k in set(inputs) | set(manifest.get("inputs", {}))
                         if inputs.get(k) != manifest.get("inputs", {}).get(k))
        return f"built from other inputs ({', '.join(changed)})"
    weights = manifest.get("weights") or {}
    if not weights:
        return "its manifest lists no weights"
    for name, digest in weights.items():
        if not (entry / name).is_file():
            return f"{name} is missing"
        if _sha256_file(entry / name) != digest:
            return f"{name} changed since it was saved"
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def encode_demos(tokenizer: Any, demos: list[list[Any]], tools: list[dict] | None) -> list[tuple[list[int], list[int]]]:
    """(token ids, assistant mask) per demonstration, rendered with the chat template."""
    from agentrl.render import render_chat_with_mask
    from agentrl.types import Message, messages_to_dicts

    out = []
    for convo in demos:
        ids, mask = render_chat_with_mask(tokenizer, messages_to_dicts([Message.from_dict(m) for m in convo]), tools)
        if sum(mask):
            out.append((ids, mask))
    return out


def warm_start(cfg: Config, *, progress: bool = True, resumed_from: Path | None = None) -> Path:
    """Warm-start model dir for ``cfg`` (the base model itself when SFT is disabled).  ``resumed_from``:
    the checkpoint a resumed run loads; its weights replace the warm start's, so none is trained
    (the cached entry still serves when it verifies; else :func:`start_from_checkpoint`)."""
    from agentrl.errors import AgentrlError
    from agentrl.plugins import load_environment

    # 1) base model
    base = ensure_base_model(cfg.model)
    if not cfg.sft.enabled or cfg.sft.steps == 0:
        return base
    # 2) data: rendered before the cache lookup, since the key covers it (and, with a target, the held-out tasks)
    env = load_environment(cfg.env.name, **cfg.env.args)
    data = demonstration_data(env, base, cfg.sft, cfg.run.seed)
    tasks = held_out_tasks(env, cfg) if cfg.sft.target_reward is not None else None
    # 3) cache
    inputs = cache_inputs(cfg, base, env, data, tasks)
    out = base.parent / f"{base.name}-sft-{sft_cache_key(inputs)}"
    if (out / MARKER).is_file():
        problem = verify_cached(out, inputs)
        if problem is None:
            _say(progress, f"sft: cached warm start {out}")
            return out
        _say(progress, f"sft: not reusing the cached warm start {out}: {problem}"
                       + ("" if resumed_from is not None else "; rebuilding it"))
    if resumed_from is not None:
        return start_from_checkpoint(cfg, base, resumed_from, progress=progress)
    # 4) train
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    evaluator = GreedyEvaluator(base, env, cfg, tasks=tasks) if cfg.sft.target_reward is not None else None
    try:
        train_sft(base, env, cfg.sft, seed=cfg.run.seed, out_dir=tmp, device=cfg.trainer.device,
                  dtype=cfg.trainer.dtype, progress=progress, evaluator=evaluator, data=data,
                  cpu_linear=cfg.trainer.cpu_linear)
    finally:
        if evaluator is not None:
            evaluator.close()
    # 5) save: the manifest records what the weights were built from and what they hash to
    weights = {f.name: _sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}
    if not weights:
        raise AgentrlError(f"sft wrote no .safetensors weights into {tmp}")
    (tmp / MANIFEST).write_text(json.dumps({"key": sft_cache_key(inputs), "inputs": inputs, "weights": weights},
                                           indent=1, sort_keys=True))
    (tmp / MARKER).write_text("ok")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def start_from_checkpoint(cfg: Config, base: Path, ckpt: Path, *, progress: bool = True) -> Path:
    """The start model of a run resumed from ``ckpt`` whose warm start is not cached: none is trained.

    The trainer loads every weight from the checkpoint and the engines are pushed them before the
    first rollout, so the base model serves (the warm start has its architecture and tokenizer).
    LoRA is the exception: an engine that is pushed only the adapters adds them to the weights it
    started on, which must be the warm start's; those are the checkpoint's frozen base weights,
    written to ``RUN_DIR/warm_start``."""
    if cfg.trainer.lora_rank == 0:
        _say(progress, f"sft: the warm start is not cached; not training it again (the weights come from {ckpt})")
        return base
    # written anew from this checkpoint each time: a copy left by an earlier run in this dir cannot serve
    out = ckpt.parent.parent / "warm_start"
    _say(progress, f"sft: the warm start is not cached; not training it again: writing its weights from {ckpt} "
                   f"(under LoRA's adapters) to {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_frozen_base(base, ckpt, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _write_frozen_base(base: Path, ckpt: Path, out: Path) -> None:
    """The weights a LoRA checkpoint's adapters sit on, as an HF model dir (``base``'s architecture and
    tokenizer): its state less the ``lora_`` factors, named as the plain model names them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agentrl.errors import CheckpointError
    from agentrl.trainer.checkpoint import load_checkpoint, load_sharded_weights

    state, _ = load_checkpoint(ckpt)
    weights = load_sharded_weights(state["sharded"]) if "sharded" in state else state["model"]
    frozen = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
              for k, v in weights.items() if ".lora_" not in k}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base), dtype=torch.float32)
    try:
        model.load_state_dict(frozen, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"--resume: the weights in {ckpt} do not fit the model in {base} "
                              f"({' '.join(str(e).split())[:200]}); resume with the run's own config") from e
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def sft_command(cfg: Config) -> Path:
    """``agentrl sft``: :func:`warm_start` with its own threads; on Ctrl-C one line says what was
    kept and what to run next (``agentrl run`` says its own, so this is not in warm_start)."""
    import torch

    from agentrl.recipes.rl import say, torch_threads

    torch.set_num_threads(torch_threads(cfg))  # as `agentrl run` does: its engine gets as many
    try:
        return warm_start(cfg)
    except KeyboardInterrupt:
        say(sft_interrupted_note(cfg))
        raise


def sft_interrupted_note(cfg: Config) -> str:
    """What an interrupted `agentrl sft` kept: the warm start is written only once it finishes."""
    base = Path(cfg.model.path)
    if not (base / "config.json").is_file():
        return (f"interrupted before the base model {base} was written: nothing was saved; run the same "
                "command again to write it and then run SFT")
    return (f"interrupted during SFT: nothing of it was saved (the warm start is written only when it finishes; "
            f"the base model {base} is kept); run the same command again to start SFT over")


def demonstration_data(env: Any, base: Path, sft: SFTConfig, seed: int) -> list[tuple[list[int], list[int]]]:
    """``env.demonstrations`` rendered with ``base``'s chat template: (token ids, assistant mask) each."""
    from agentrl.errors import AgentrlError, UserCodeError
    from agentrl.inference.client import load_tokenizer

    # the check eval and the rollouts make: a model without a chat template is one line, not transformers' ValueError
    tokenizer = load_tokenizer(base)
    try:
        demos = env.demonstrations(sft.num_demos, seed=seed, **sft.demo_args)
    except NotImplementedError:
        raise AgentrlError(f"environment {env.name!r} has no demonstrations(); set sft.enabled = false") from None
    except Exception as e:
        message = " ".join(str(e).split())[:300]
        raise UserCodeError(f"environment {env.name!r}: demonstrations() raised {type(e).__name__}: {message} "
                            "(fix the environment, or rerun with --traceback to see where)") from e
    data = encode_demos(tokenizer, demos, env.tool_schemas())
    if not data:
        raise AgentrlError("no demonstration had assistant tokens to train on")
    return data


def train_sft(base: Path, env: Any, sft: SFTConfig, *, seed: int, out_dir: Path, device: str = "auto",
              dtype: str = "float32", progress: bool = True, evaluator: Any = None,
              data: list[tuple[list[int], list[int]]] | None = None, max_wall_s: float | None = None,
              cpu_linear: str = "onednn") -> Path:
    """SFT loop over ``data`` (default: :func:`demonstration_data`); with an ``evaluator`` it
    stops once greedy reward ≥ ``sft.target_reward``, with ``max_wall_s`` once that many
    seconds have passed (continued SFT on a time budget). ``dtype``: trainer.dtype (bf16 is
    autocast over float32 weights); ``cpu_linear``: trainer.cpu_linear."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.cpu_attention import float32_attention
    from agentrl.cpu_gemm import route_linears
    from agentrl.heap import HeapBudget
    from agentrl.metrics import StepProgress
    from agentrl.precision import use_bf16
    from agentrl.trainer.trainer import adamw, default_sft_lr, resolve_device

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(base)
    if data is None:
        data = demonstration_data(env, base, sft, seed)
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(dev)
    if dev.type == "cpu" and cpu_linear == "onednn":
        route_linears(model)  # float32 products through oneDNN (agentrl.cpu_gemm)
    model.train()
    bf16 = use_bf16(dtype, model.config.get_text_config().hidden_size, dev.type)
    if bf16 and dev.type == "cpu":
        float32_attention(model)  # CPU flash attention is faster in float32 (agentrl.cpu_attention)
    lr = sft.lr
    if lr is None:
        n = sum(p.numel() for p in model.parameters())
        lr = default_sft_lr(n)
        _say(progress, f"sft.lr unset: {lr:g} for a {n / 1e6:.3g}M-parameter model; set --sft.lr to choose")
    opt = adamw(list(model.parameters()), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)  # fused where it can
    pad = model.config.pad_token_id or 0
    warmup = max(1, sft.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    budget = HeapBudget() if dev.type == "cpu" else None  # freed buffers reused, within a bound (agentrl.heap)
    t0 = time.perf_counter()
    log = []
    with StepProgress("sft", sft.steps, enabled=progress) as bar:
        for step in range(sft.steps):
            batch = [data[rng.randrange(len(data))] for _ in range(sft.batch_size)]
            T = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [pad] * (T - len(i)) for i, _ in batch], device=dev)
            mask = torch.tensor([m + [0] * (T - len(m)) for _, m in batch], dtype=torch.float32, device=dev)
            attn = torch.tensor([[1] * len(i) + [0] * (T - len(i)) for i, _ in batch], device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
            m = mask[:, 1:].reshape(-1)
            loss = (nll * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            del logits, nll  # not alive through the optimizer step and the heap's measurement
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            step_lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            if budget is not None:
                budget.after_step()
            log.append({"step": step, "loss": float(loss.detach()), "lr": step_lr, "wall_s": time.perf_counter() - t0})
            bar.step(f"loss {float(loss.detach()):.3f}")
            if not math.isfinite(float(loss.detach())):
                from agentrl.errors import AgentrlError

                raise AgentrlError(f"sft diverged at step {step} (loss {float(loss)}); lower sft.lr")
            if evaluator is not None and (step + 1) % sft.eval_every == 0:
                reward = evaluator.score(model, step + 1)  # raises when every episode errored by no fault of the model
                log[-1]["eval_reward_mean"] = reward
                errored = getattr(evaluator, "errored", None)  # a reward of 0 that errors made is named
                bar.note(f"sft step {step + 1}: greedy held-out reward {reward:.3f} (target {sft.target_reward})"
                         + (f"; {errored}" if errored else ""))
                if reward >= sft.target_reward:
                    break
            if max_wall_s is not None and time.perf_counter() - t0 >= max_wall_s:
                break
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    with open(out_dir / "sft_metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    return out_dir


class GreedyEvaluator:
    """Greedy held-out reward of the model being fine-tuned, on an embedded engine.

    The engine starts once on the base weights (``policy``: one already serving them); each
    evaluation pushes the current SFT weights and runs the env's held-out tasks at temperature 0
    (the evaluator RL uses).  ``errored`` names the last evaluation's errored episodes (None: none).
    """

    def __init__(self, base: Path, env: Any, cfg: Config, policy: Any = None, tasks: list[Any] | None = None) -> None:
        from agentrl.inference import open_policy
        from agentrl.recipes.rl import torch_threads

        self.env, self.cfg = env, cfg
        self.tasks = held_out_tasks(env, cfg) if tasks is None else tasks  # the ones the cache key hashed
        self.errored: str | None = None
        ic = cfg.inference
        self.policy = policy if policy is not None else open_policy(
            base, args=ic.engine_args(), env={"OMP_NUM_THREADS": str(torch_threads(cfg))}, tool_parser=ic.tool_parser)

    def score(self, model: Any, version: int) -> float:
        return asyncio.run(self._score(model, version))

    async def _score(self, model: Any, version: int) -> float:
        from agentrl.inference import PolicyClient
        from agentrl.weights import make_weight_sync

        ws = make_weight_sync(self.policy.base_urls, self.cfg.inference.weight_transport, api_key=self.policy.api_key)
        try:
            await ws.push({k: v.detach().cpu() for k, v in model.state_dict().items()}, version)
        finally:
            await ws.close()
        client = PolicyClient(self.policy.base_urls, self.policy.model, tool_parser=self.policy.tool_parser,
                              api_key=self.policy.api_key)
        try:
            return await self.reward(client, version)
        finally:
            await self.env.close()  # its sandbox pools belong to this evaluation's event loop
            await client.close()

    async def reward(self, client: Any, version: int) -> float:
        """Greedy reward of what ``client`` serves on the held-out tasks (errored episodes count 0).
        Raises :class:`~agentrl.recipes.rl_steps.EvaluationErrored` when every one errored by no
        fault of the model (a rubric that raises): SFT would otherwise run all its steps towards a
        reward that cannot move."""
        from agentrl.recipes.rl_steps import check_evaluation
        from agentrl.rollout import evaluate_tasks, mean_reward
        from agentrl.types import SamplingParams

        ro = self.cfg.rollout
        trajs = await evaluate_tasks(
            self.env, client, self.tasks, SamplingParams(max_tokens=ro.max_tokens, temperature=0.0),
            timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns, concurrency=self.cfg.eval.concurrency,
        )
        self.errored = check_evaluation(trajs, f"sft evaluation at step {version}", self.cfg.buffer.failure_rewards)
        return mean_reward(trajs)

    def close(self) -> None:
        self.policy.stop()


def _say(enabled: bool, text: str) -> None:
    if enabled:
        from rich.console import Console

        Console(stderr=True).print(text, highlight=False)
