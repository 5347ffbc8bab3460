"""`agentrl sft` (and phase 2 of `agentrl run`): the warm start, in numbered phases.

    1. base model   ``model.path``, built (tiny) when missing and ``model.init = "tiny"``
    2. cache        ``<model dir>-sft-<hash>``: the hash covers the base model's weights, the
                    environment (name, version, args) and ``[sft]``; a complete entry is reused
    3. data         ``env.demonstrations(n, seed)`` rendered with the model's chat template
                    (the same template and tool schemas the rollouts use); the loss covers
                    *assistant tokens only* (the template's ``{% generation %}`` blocks)
    4. train        AdamW on cross-entropy; with ``sft.target_reward`` a greedy held-out
                    evaluation every ``sft.eval_every`` steps stops it early, leaving the RL
                    stage headroom
    5. save         written beside the cache entry and renamed into place
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.config import Config, ModelConfig, SFTConfig

MARKER = "SFT_COMPLETE"


def ensure_base_model(model_cfg: ModelConfig) -> Path:
    """The base model dir, built (tiny) when missing and ``model.init == "tiny"``."""
    from agentrl.errors import AgentrlError

    path = Path(model_cfg.path)
    if (path / "config.json").is_file():
        return path
    if model_cfg.init != "tiny":
        raise AgentrlError(f"no model at {str(path)!r} and model.init = 'none'; point model.path at a HF model dir")
    from agentrl.metrics import busy
    from agentrl.tiny_model import build_tiny_model

    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    with busy(f"building the tiny model at {path} ..."):
        build_tiny_model(
            tmp, layers=model_cfg.tiny_layers, hidden=model_cfg.tiny_hidden, heads=model_cfg.tiny_heads,
            seed=model_cfg.seed,
        )
    if not (path / "config.json").is_file():  # another process may have won the race
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path


def _hash_dir(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*")):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".txt", ".model", ".jinja"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def sft_cache_key(cfg: Config, base: Path, env: Any) -> str:
    blob = {
        "model": _hash_dir(base),
        "env": [cfg.env.name, getattr(env, "version", ""), cfg.env.args],
        "sft": cfg.sft.model_dump(mode="json"),
        "seed": cfg.run.seed,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


def warm_start(cfg: Config, *, progress: bool = True) -> Path:
    """Warm-start model dir for ``cfg`` (the base model itself when SFT is disabled)."""
    from agentrl.plugins import load_environment

    # 1) base model
    base = ensure_base_model(cfg.model)
    if not cfg.sft.enabled or cfg.sft.steps == 0:
        return base
    # 2) cache
    env = load_environment(cfg.env.name, **cfg.env.args)
    out = base.parent / f"{base.name}-sft-{sft_cache_key(cfg, base, env)}"
    if (out / MARKER).is_file():
        _say(progress, f"sft: cached warm start {out}")
        return out
    if not hasattr(env, "demonstrations"):
        from agentrl.errors import AgentrlError

        raise AgentrlError(f"environment {cfg.env.name!r} has no demonstrations(); set sft.enabled = false")
    # 3-4) data and training
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    evaluator = _GreedyEvaluator(base, env, cfg) if cfg.sft.target_reward is not None else None
    try:
        train_sft(base, env, cfg.sft, seed=cfg.run.seed, out_dir=tmp, device=cfg.trainer.device,
                  progress=progress, evaluator=evaluator)
    finally:
        if evaluator is not None:
            evaluator.close()
    # 5) save
    (tmp / MARKER).write_text("ok")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def train_sft(base: Path, env: Any, sft: SFTConfig, *, seed: int, out_dir: Path, device: str = "auto",
              progress: bool = True, evaluator: Any = None, max_wall_s: float | None = None) -> Path:
    """SFT loop; with an ``evaluator`` it stops once greedy reward ≥ ``sft.target_reward``,
    with ``max_wall_s`` once that many seconds have passed (continued SFT on a time budget)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.metrics import StepProgress
    from agentrl.trainer.trainer import resolve_device

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(base)
    demos = env.demonstrations(sft.num_demos, seed=seed, **sft.demo_args)
    data = encode_demos(tok, demos, env.tool_schemas())
    if not data:
        from agentrl.errors import AgentrlError

        raise AgentrlError("no demonstration had assistant tokens to train on")
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, betas=(0.9, 0.99), weight_decay=0.0)
    pad = model.config.pad_token_id or 0
    warmup = max(1, sft.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    t0 = time.perf_counter()
    log = []
    with StepProgress("sft", sft.steps, enabled=progress) as bar:
        for step in range(sft.steps):
            batch = [data[rng.randrange(len(data))] for _ in range(sft.batch_size)]
            T = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [pad] * (T - len(i)) for i, _ in batch], device=dev)
            mask = torch.tensor([m + [0] * (T - len(m)) for _, m in batch], dtype=torch.float32, device=dev)
            attn = torch.tensor([[1] * len(i) + [0] * (T - len(i)) for i, _ in batch], device=dev)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
            m = mask[:, 1:].reshape(-1)
            loss = (nll * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            log.append({"step": step, "loss": float(loss.detach()), "wall_s": time.perf_counter() - t0})
            bar.step(f"loss {float(loss.detach()):.3f}")
            if not math.isfinite(float(loss.detach())):
                from agentrl.errors import AgentrlError

                raise AgentrlError(f"sft diverged at step {step} (loss {float(loss)}); lower sft.lr")
            if evaluator is not None and (step + 1) % sft.eval_every == 0:
                reward = evaluator.score(model, step + 1)
                log[-1]["eval_reward_mean"] = reward
                bar.note(f"sft step {step + 1}: greedy held-out reward {reward:.3f} (target {sft.target_reward})")
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


class _GreedyEvaluator:
    """Greedy held-out reward of the model being fine-tuned, on an embedded engine.

    The engine starts once on the base weights; each evaluation pushes the current SFT
    weights and runs the env's held-out tasks at temperature 0 (the evaluator RL uses).
    """

    def __init__(self, base: Path, env: Any, cfg: Config) -> None:
        from agentrl.inference import EngineArgs, open_policy
        from agentrl.recipes.rl import torch_threads

        self.env, self.cfg = env, cfg
        self.tasks = list(env.eval_dataset() or env.dataset())[: cfg.sft.eval_tasks]
        ic = cfg.inference
        args = EngineArgs(max_batch_size=ic.max_batch_size, max_model_len=ic.max_model_len, device=ic.device)
        self.policy = open_policy(base, args=args, env={"OMP_NUM_THREADS": str(torch_threads(cfg))})

    def score(self, model: Any, version: int) -> float:
        return asyncio.run(self._score(model, version))

    async def _score(self, model: Any, version: int) -> float:
        from agentrl.inference import PolicyClient
        from agentrl.rollout import evaluate_tasks, mean_reward
        from agentrl.types import SamplingParams
        from agentrl.weights import make_weight_sync

        ws = make_weight_sync(self.policy.base_urls, self.cfg.inference.weight_transport)
        try:
            await ws.push({k: v.detach().cpu() for k, v in model.state_dict().items()}, version)
        finally:
            await ws.close()
        client = PolicyClient(self.policy.base_urls, self.policy.model)
        try:
            ro = self.cfg.rollout
            trajs = await evaluate_tasks(
                self.env, client, self.tasks, SamplingParams(max_tokens=ro.max_tokens, temperature=0.0),
                timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns,
            )
        finally:
            await client.close()
        return mean_reward(trajs)

    def close(self) -> None:
        self.policy.stop()


def _say(enabled: bool, text: str) -> None:
    if enabled:
        from rich.console import Console

        Console(stderr=True).print(text, highlight=False)
