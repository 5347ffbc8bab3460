"""The optimizer step: groups → advantages → micro-batches → loss on π_θ/μ → AdamW.

One :meth:`Trainer.step` per weight version:

1. advantages: GRPO-style, reward − group mean (÷ group std if ``std_normalize``);
2. samples: every TokenSequence with sampled tokens becomes one row; its loss tokens are
   the sampled ones (mask 1), with μ and the sequence's advantage;
3. micro-batches: rows sorted by length and greedily filled up to
   ``micro_batch_tokens`` (rows padded to the longest in the micro-batch);
4. per micro-batch: forward, log-softmax of logits/T (T = sampling temperature, so π_θ
   is on the same basis as the engine's μ), the pure loss from ``losses.py``, backward
   (gradients accumulate; per-token weights make the sum the batch loss);
5. clip the global grad norm, AdamW step, LR schedule step.

Optional LoRA (peft): only adapters train; :meth:`named_tensors` returns just the merged
weights of the adapted modules (W + s·B·A), so a push moves only what changed, and
:meth:`adapter_tensors` returns only the factors (A, s·B) for an engine that merges them
itself (the embedded engine; see ``agentrl.inference.lora``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from agentrl.trainer.losses import (
    LossSpec,
    add_stats,
    group_advantages,
    policy_loss,
    summarize,
    token_weights,
)
from agentrl.types import Group, SamplingParams

if TYPE_CHECKING:
    from agentrl.config import TrainerConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class _Row:
    ids: list[int]
    mask: list[int]
    mu: list[float]
    adv: float
    weight: float = 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_lambda(schedule: str, warmup: int, total: int):
    """Multiplier on the base LR at optimizer step ``s`` (linear warm-up, then decay)."""

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        frac = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac

    return f


class Trainer:
    """Holds the policy, optimizer and LR schedule; :meth:`step` is one weight version."""

    def __init__(
        self, model_dir: str | Path, cfg: TrainerConfig, sampling: SamplingParams | None = None, *, seed: int = 0
    ) -> None:
        """``sampling``: how the rollouts sample (π_θ is computed on the same basis as μ)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        random.seed(seed)
        self.cfg = cfg
        self.spec = LossSpec.from_config(cfg.loss)
        self.sampling = sampling or SamplingParams()
        self.temperature = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
        self.device = resolve_device(cfg.device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.pad_id = model.config.pad_token_id or 0
        self.lora = cfg.lora_rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=LORA_TARGETS, lora_dropout=0.0),
            )
        self.model = model.to(self.device)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
        )

    # ------------------------------------------------------------------ the step

    def step(self, groups: list[Group]) -> dict[str, float]:
        rows = self._rows(groups)
        if not rows:
            return {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "lr": self.scheduler.get_last_lr()[0]}
        for row, w in zip(rows, token_weights([sum(r.mask) for r in rows], self.cfg.loss.aggregation), strict=True):
            row.weight = w
        totals: dict[str, float] = {}
        loss_sum = ent_sum = 0.0
        for mb in self._micro_batches(rows):
            loss, stats, ent = self._micro_step(mb)
            loss.backward()
            loss_sum += float(loss.detach())
            ent_sum += ent
            add_stats(totals, stats)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        n = max(totals.get("tokens", 0.0), 1.0)
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "entropy": ent_sum / n,
            "lr": lr,
            "train_tokens": totals.get("tokens", 0.0),
            **summarize(totals),
        }

    def _rows(self, groups: list[Group]) -> list[_Row]:
        rows = []
        for g in groups:
            rewards = torch.tensor([t.reward for t in g.trajectories], dtype=torch.float64)
            advs = group_advantages(rewards, std_normalize=self.cfg.loss.std_normalize)
            for t, a in zip(g.trajectories, advs.tolist(), strict=True):
                t.advantage = a
                for s in t.sequences:
                    if s.num_sampled:
                        rows.append(_Row(list(s.token_ids), list(s.loss_mask), list(s.logprobs), a))
        return rows

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        budget = self.cfg.micro_batch_tokens
        out: list[list[_Row]] = []
        cur: list[_Row] = []
        for row in sorted(rows, key=lambda r: len(r.ids)):
            if cur and len(row.ids) * (len(cur) + 1) > budget:  # padded to the (sorted) longest
                out.append(cur)
                cur = []
            cur.append(row)
        if cur:
            out.append(cur)
        return out

    def _micro_step(self, mb: list[_Row]) -> tuple[torch.Tensor, dict[str, float], float]:
        T = max(len(r.ids) for r in mb)
        dev = self.device

        def pad(vals, fill):
            return [list(v) + [fill] * (T - len(v)) for v in vals]

        ids = torch.tensor(pad([r.ids for r in mb], self.pad_id), device=dev)
        attn = torch.tensor(pad([[1] * len(r.ids) for r in mb], 0), device=dev)
        mask = torch.tensor(pad([r.mask for r in mb], 0), dtype=torch.float32, device=dev)
        mu = torch.tensor(pad([r.mu for r in mb], 0.0), dtype=torch.float32, device=dev)
        adv = torch.tensor([r.adv for r in mb], dtype=torch.float32, device=dev)[:, None].expand(-1, T - 1)
        weight = torch.tensor([r.weight for r in mb], dtype=torch.float32, device=dev)[:, None].expand(-1, T - 1)
        seq = torch.arange(len(mb), device=dev)[:, None].expand(-1, T - 1)

        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / self.temperature
        logsm = F.log_softmax(logits, dim=-1)  # [B, T-1, V]; predicts tokens 1..T-1
        logp = logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = mask[:, 1:]
        with torch.no_grad():
            ent = float((-(logsm.exp() * logsm).sum(-1) * m).sum())
        flat = lambda x: x.reshape(-1)  # noqa: E731
        loss, stats = policy_loss(
            self.spec, flat(logp), flat(mu[:, 1:]), flat(m), flat(adv), flat(weight),
            prox_logp=flat(logp).detach(), seq=flat(seq),
        )
        return loss, stats, ent

    # ------------------------------------------------------------------ weights out

    @torch.no_grad()
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Weights to push, named as in the plain HF model (CPU, contiguous)."""
        if not self.lora:
            return {k: v.detach().to("cpu").contiguous() for k, v in self.model.state_dict().items()}
        return {
            name + ".weight": (base + b @ a * scale).to("cpu").contiguous()
            for name, base, a, b, scale in self._adapted_modules()
        }

    @torch.no_grad()
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA factors to push, ``{module}.lora_A`` and ``{module}.lora_B`` (scaling folded into B)."""
        if not self.lora:
            raise ValueError("adapter_tensors() needs a LoRA trainer (trainer.lora_rank > 0)")
        out = {}
        for name, _, a, b, scale in self._adapted_modules():
            out[name + ".lora_A"] = a.detach().to("cpu").contiguous()
            out[name + ".lora_B"] = (b.detach() * scale).to("cpu").contiguous()
        return out

    def _adapted_modules(self):
        """(hf module name, base weight, A, B, scaling) for every LoRA-adapted linear."""
        for name, mod in self.model.named_modules():
            if hasattr(mod, "lora_A") and hasattr(mod, "base_layer") and "default" in mod.lora_A:
                yield (_hf_name(name), mod.base_layer.weight, mod.lora_A["default"].weight,
                       mod.lora_B["default"].weight, mod.scaling["default"])

    def merged_model(self):
        """A plain HF model with the current weights (LoRA merged into a copy)."""
        if not self.lora:
            return self.model
        import copy

        return copy.deepcopy(self.model).merge_and_unload()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])


def _hf_name(peft_module_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj`` → ``model.layers.0.self_attn.q_proj``."""
    prefix = "base_model.model."
    return peft_module_name[len(prefix):] if peft_module_name.startswith(prefix) else peft_module_name
