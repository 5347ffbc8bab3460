"""The optimizer step: groups → trajectories → micro-batches → loss on π_θ/μ → AdamW.

One :meth:`Trainer.step` per weight version:

1. trajectories: every sequence with sampled tokens becomes one row (a template break makes
   several rows of one trajectory); its loss tokens are the sampled ones, with μ, their
   support K and the trajectory's advantage (set when the group was scored);
2. proximal pass (when the loss needs π_prox: decoupled PPO, sequence rejection): one
   no-grad forward over every row before any update;
3. ``trainer.epochs`` × ``trainer.minibatches`` updates, each over whole groups: micro-batches
   keep a trajectory's rows together (GSPO/TOPR need the whole trajectory) and fill up to
   ``micro_batch_tokens``; per micro-batch a forward in eval mode (dropout off: the policy
   trains on the distribution it sampled), π_θ on the sampler's support
   (:mod:`agentrl.trainer.logprobs`), the pure loss (:mod:`agentrl.trainer.losses`), backward;
4. per update: clip the global grad norm; a non-finite norm (or loss) skips that update (no
   optimizer step, its statistics not logged); the LR schedule steps once per weight version
   if any update applied.  A step whose every update was skipped reports ``skipped`` so the
   caller bumps no version and pushes nothing.

One rule for non-finite values: a trajectory with a non-finite μ or advantage is left out of
the step before any forward, and so is one whose every update was skipped; both come back in
``stats["skipped_ids"]`` with the reason (their fate is ``skipped``), the rest of the batch
trains, and every logged statistic stays finite.

Optional LoRA (peft): only adapters train; :meth:`named_tensors` returns just the merged
weights of the adapted modules (W + s·B·A), so a push moves only what changed, and
:meth:`adapter_tensors` returns only the factors (A, s·B) for an engine that merges them
itself (the embedded engine; see ``agentrl.weights.lora``).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl import devices
from agentrl.cpu_attention import float32_attention
from agentrl.cpu_gemm import route_linears
from agentrl.heap import HeapBudget
from agentrl.precision import use_bf16
from agentrl.trainer.checkpoint import rng_state, set_rng_state
from agentrl.trainer.logprobs import head_of, token_logprobs_from_hidden
from agentrl.trainer.losses import LossSpec, add_stats, policy_loss, summarize, token_weights
from agentrl.trainer.packing import attention_mask, choose, pack, packable
from agentrl.types import Group, SamplingParams

if TYPE_CHECKING:
    from agentrl.config import TrainerConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class _Row:
    """One sequence of one trajectory, as the loss sees it."""

    ids: list[int]
    mask: list[int]
    mu: list[float]
    support: list[int]
    adv: float
    traj: int  # index of its trajectory in the step
    weight: float = 0.0
    prox: list[float] | None = None  # π_prox per position (aligned with ids[1:], len(ids) - 1 values)
    prox_outside: list[bool] | None = None  # the token is outside π_prox's own top-K support


def adamw(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where every parameter is a plain float tensor on a CPU or GPU.

    The default path on a CPU updates each tensor in several passes (torch picks neither foreach
    nor fused there): SmolLM2-135M's step took 0.70 CPU s, the fused one 0.09 s (one thread).  The
    fused kernel does the same arithmetic in one pass (results agree to float rounding).  Sharded
    (DTensor) parameters keep torch's default.
    """
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)  # fmt: skip
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


# A model under this many parameters is of the tiny kind agentrl builds: trained from near scratch
# (an SFT warm start), it needs learning rates two orders above a pretrained model's.
TINY_PARAMS = 10_000_000


def param_count(model_dir: str | Path) -> int:
    """Parameters in a checkpoint: from its safetensors headers, else from its config on the meta device."""
    from agentrl.trainer.shard_load import weight_files

    stored = weight_files(model_dir)
    if stored:
        return sum(math.prod(s.shape) for s in stored.values())
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


def default_lr(n_params: int, *, lora: bool) -> float:
    """``trainer.lr`` when unset.  The tiny model: 1e-4 (the quickstart's; 2e-4 swung by ±0.1 and 3e-4
    collapsed: README, "The learning rate").  A pretrained model: 1e-6, the usual full fine-tuning RL
    rate (TRL's and verl's GRPO default); LoRA 1e-5, since only the adapters move and B starts at zero."""
    if n_params < TINY_PARAMS:
        return 1e-4
    return 1e-5 if lora else 1e-6


def default_sft_lr(n_params: int) -> float:
    """``sft.lr`` when unset: 1e-3 for the tiny model (its calibrated warm start), 2e-5 for a pretrained one."""
    return 1e-3 if n_params < TINY_PARAMS else 2e-5


def resolve_lr(cfg: TrainerConfig, model_dir: str | Path) -> float:
    """The learning rate a trainer of ``model_dir`` uses: ``cfg.lr`` if set, else :func:`default_lr`."""
    return cfg.lr if cfg.lr is not None else default_lr(param_count(model_dir), lora=cfg.lora_rank > 0)


def resolve_device(name: str) -> torch.device:
    """The torch device the trainer runs on (``auto``: GPU 0 if torch sees one, else the CPU); one
    :class:`~agentrl.errors.AgentrlError` line for a bad name or a GPU this host lacks."""
    return devices.resolve_device(name, setting="trainer.device")


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
        torch.manual_seed(seed)
        random.seed(seed)
        self.cfg = cfg
        self.seed = seed
        self.spec = LossSpec.from_config(cfg.loss)
        self.sampling = sampling or SamplingParams()
        self.temperature = self.sampling.temperature if self.sampling.temperature > 0 else 1.0
        self.device = resolve_device(cfg.device)
        # a CPU step reuses the last step's freed buffers instead of faulting fresh pages in (agentrl.heap)
        self._heap = HeapBudget() if self.device.type == "cpu" else None
        model = self._load(model_dir)
        self.pad_id = model.config.pad_token_id or 0
        self.vocab_size = model.config.vocab_size
        self.model_config = model.config
        # bf16 autocast over float32 weights where agentrl.precision measured it faster (wide models, bf16 CPUs)
        self.bf16 = use_bf16(cfg.dtype, model.config.get_text_config().hidden_size, self.device.type)
        if self.bf16 and self.device.type == "cpu":
            float32_attention(model)  # CPU flash attention is faster in float32 (agentrl.cpu_attention)
        # a group's prompt runs once per micro-batch (agentrl.trainer.packing) where the attention allows it
        self.share_prompt = cfg.share_prompt and packable(model.config, head_of(model)[0].forward)
        self.lora = cfg.lora_rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=LORA_TARGETS, lora_dropout=0.0),
            )
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if not p.is_meta and (value := adapter_start(name, p.shape, seed)) is not None:
                        p.copy_(value)  # on the meta device (a sharded rank) they are set per shard in _place
        self.model = self._place(model)
        if self.device.type == "cpu" and cfg.cpu_linear == "onednn":
            route_linears(self.model)  # float32 products through oneDNN (agentrl.cpu_gemm)
        self.model.eval()  # dropout off everywhere: RL trains on the distribution that was sampled
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.lr = resolve_lr(cfg, model_dir)
        self.optimizer = adamw(params, lr=self.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
        )

    # ------------------------------------------------------------------ the step

    def step(self, groups: list[Group]) -> dict[str, Any]:
        """One weight version from these groups (module docstring); returns summed-then-averaged stats.

        ``stats["skipped_ids"]`` maps the episodes this step did not train to the reason (a
        non-finite μ or advantage, or every update holding it had a non-finite gradient): the
        caller gives them the fate ``skipped``; the others trained.
        """
        lr = self.scheduler.get_last_lr()[0]
        skipped: dict[str, str] = {}
        episode_ids = [t.id for g in groups for t in g.trajectories]
        per_group = [self._rows(g, first, skipped) for g, first in zip(groups, _offsets(groups), strict=True)]
        per_group = [rs for rs in per_group if rs]
        rows = [r for rs in per_group for r in rs]
        if not rows:
            return {"loss": 0.0, "grad_norm": 0.0, "entropy": 0.0, "lr": lr, "updates": 0.0, "skipped_updates": 0.0,
                    "skipped": float(bool(skipped)), "skipped_episodes": float(len(skipped)), "skipped_ids": skipped,
                    **summarize({})}  # fmt: skip
        if self.spec.needs_prox:
            self._proximal(rows)
        totals: dict[str, float] = {}
        loss_sum = ent_sum = 0.0
        norms: list[float] = []
        applied: set[int] = set()
        failed: set[int] = set()
        n_updates = 0
        for _ in range(self.cfg.epochs):
            for part in _split(per_group, self.cfg.minibatches):
                part_totals: dict[str, float] = {}
                loss, ent, grad_norm = self._update(part, part_totals)
                trajs = {r.traj for rs in part for r in rs}
                n_updates += 1
                if math.isfinite(grad_norm) and math.isfinite(loss):
                    self.optimizer.step()
                    loss_sum, ent_sum = loss_sum + loss, ent_sum + ent
                    norms.append(grad_norm)
                    add_stats(totals, part_totals)
                    applied |= trajs
                else:  # this update only: its statistics are not logged, its episodes may train in another
                    failed |= trajs
                self.optimizer.zero_grad(set_to_none=True)
        if self._heap is not None:
            self._heap.after_step()  # freed buffers kept for the next step, within a bound (agentrl.heap)
        for k in sorted(failed - applied):
            skipped[episode_ids[k]] = "every optimizer update holding it had a non-finite gradient"
        updates = len(norms)
        if updates:
            self.scheduler.step()
        n = max(totals.get("tokens", 0.0), 1.0)
        return {
            "loss": loss_sum / max(1, updates),
            "grad_norm": max(norms, default=0.0),
            "entropy": ent_sum / n,
            "lr": lr,
            "train_tokens": totals.get("tokens", 0.0) / max(1, self.cfg.epochs),
            "updates": float(updates),
            "skipped_updates": float(n_updates - updates),
            "skipped": float(updates == 0),  # the whole step: no version, no push, episodes skipped
            "skipped_episodes": float(len(skipped)),
            "skipped_ids": skipped,
            **summarize(totals),
        }

    def _rows(self, group: Group, first_traj: int, skipped: dict[str, str] | None = None) -> list[_Row]:
        """The group's rows; a trajectory with a non-finite μ or advantage goes to ``skipped`` instead."""
        rows = []
        for k, t in enumerate(group.trajectories):
            reason = nonfinite_reason(t)
            if reason is not None:
                if skipped is not None:
                    skipped[t.id] = reason
                continue
            for s in t.sequences:
                if s.num_sampled:
                    support = s.support if len(s.support) == len(s.token_ids) else [0] * len(s.token_ids)
                    rows.append(_Row(list(s.token_ids), list(s.loss_mask), list(s.logprobs), list(support),
                                     t.advantage, first_traj + k))  # fmt: skip
        return rows

    def _update(self, part: list[list[_Row]], totals: dict[str, float]) -> tuple[float, float, float]:
        """Forward/backward over one minibatch of groups; returns (loss, entropy sum, grad norm)."""
        rows = [r for rs in part for r in rs]
        trajs = sorted({r.traj for r in rows})
        lens = {t: 0 for t in trajs}
        for r in rows:
            lens[r.traj] += sum(r.mask[1:])
        for t, w in zip(trajs, token_weights([lens[t] for t in trajs], self.spec.reduce), strict=True):
            for r in rows:
                if r.traj == t:
                    r.weight = w
        loss_sum = ent_sum = 0.0
        for mb in self._micro_batches(rows):
            loss, stats, ent = self._micro_step(mb)
            loss.backward()
            loss_sum += float(loss.detach())
            ent_sum += ent
            add_stats(totals, stats)
        return loss_sum, ent_sum, self._clip_grads()

    def _load(self, model_dir: str | Path) -> torch.nn.Module:
        """The model with its weights, float32 (a sharded rank builds it on the meta device instead)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on the trainer's device (the sharded trainer shards it here: agentrl.trainer.sharded)."""
        return model.to(self.device)

    def _clip_grads(self) -> float:
        """Clip the global grad norm to ``grad_clip``; returns the norm before clipping."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))

    def _decode(self, decoder: torch.nn.Module, **inputs: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states (the sharded trainer gathers the unsharded weights around it)."""
        return decoder(**inputs).last_hidden_state

    def _micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """Whole trajectories per micro-batch, sorted by length, filled up to the token budget."""
        by_traj: dict[int, list[_Row]] = {}
        for r in rows:
            by_traj.setdefault(r.traj, []).append(r)
        units = sorted(by_traj.values(), key=lambda u: max(len(r.ids) for r in u))
        budget = self.cfg.micro_batch_tokens
        out: list[list[_Row]] = []
        cur: list[_Row] = []
        for unit in units:
            longest = max(len(r.ids) for r in cur + unit)
            if cur and longest * (len(cur) + len(unit)) > budget:  # padded to the longest
                out.append(cur)
                cur = []
            cur.extend(unit)
        if cur:
            out.append(cur)
        return out

    def _tensors(self, mb: list[_Row]) -> dict[str, torch.Tensor]:
        T = max(len(r.ids) for r in mb)
        dev = self.device

        def pad(vals, fill, dtype=None):
            return torch.tensor([list(v) + [fill] * (T - len(v)) for v in vals], dtype=dtype, device=dev)

        return {
            "ids": pad([r.ids for r in mb], self.pad_id),
            "attn": pad([[1] * len(r.ids) for r in mb], 0),
            "mask": pad([r.mask for r in mb], 0, torch.float32)[:, 1:],
            "mu": pad([r.mu for r in mb], 0.0, torch.float32)[:, 1:],
            "support": pad([r.support for r in mb], 0, torch.long)[:, 1:],
        }

    def _policy_logprobs(self, mb: list[_Row], x: dict[str, torch.Tensor]):
        """(log π_θ, entropy, outside-support) at the loss positions, flattened in row order.

        Only the loss positions' hidden states reach the LM head, in chunks (no [B, T, V] tensor).
        """
        decoder, logits_fn = head_of(self.model)
        sel = x["mask"] > 0
        rows = [(r.ids, r.mask) for r in mb] if self.share_prompt else []
        packs = choose(rows, self.model_config.hidden_size, self.cfg.micro_batch_tokens) if rows else None
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if packs:  # some rows share a prompt, and one forward over the packs costs less
                pk = pack(rows, packs, self.pad_id, self.device)
                mask = attention_mask(pk, self.model_config, torch.bfloat16 if self.bf16 else torch.float32)
                hidden = self._decode(decoder, input_ids=pk.ids, position_ids=pk.positions, attention_mask=mask)
                hidden = hidden.reshape(-1, hidden.shape[-1])[pk.hidden_at]
            else:
                hidden = self._decode(decoder, input_ids=x["ids"], attention_mask=x["attn"])[:, :-1][sel]
        hidden = hidden.float()  # the softmax stays float32; a bf16 head recomputes its top logits in float32
        return token_logprobs_from_hidden(
            hidden, logits_fn, x["ids"][:, 1:][sel], x["support"][sel], self.sampling.temperature,
            vocab=self.vocab_size, head_dtype=torch.bfloat16 if self.bf16 else None,
        )

    @torch.no_grad()
    def _proximal(self, rows: list[_Row]) -> None:
        """π_prox: the current weights' logprobs of every loss token, before any update.

        Stored per row at the row's own length: an update's micro-batches pad to other lengths."""
        self.model.eval()
        for mb in self._micro_batches(rows):
            x = self._tensors(mb)
            sel = x["mask"] > 0
            logp, _, outside = self._policy_logprobs(mb, x)
            full = torch.zeros_like(x["mu"])
            full[sel] = logp.to(full.dtype)
            out = torch.zeros_like(sel)
            out[sel] = outside
            for r, vals, outs in zip(mb, full.tolist(), out.tolist(), strict=True):
                n = len(r.ids) - 1
                r.prox, r.prox_outside = vals[:n], outs[:n]

    def _micro_step(self, mb: list[_Row]) -> tuple[torch.Tensor, dict[str, float], float]:
        self.model.eval()  # dropout off: train on the distribution the engine sampled from
        x = self._tensors(mb)
        sel = x["mask"] > 0
        logp, ent, outside = self._policy_logprobs(mb, x)
        n_pos = x["mask"].shape[1]
        rows_of = torch.arange(len(mb), device=self.device)[:, None].expand(-1, n_pos)[sel]
        adv = torch.tensor([r.adv for r in mb], dtype=torch.float32, device=self.device)[rows_of]
        weight = torch.tensor([r.weight for r in mb], dtype=torch.float32, device=self.device)[rows_of]
        traj = torch.tensor([r.traj for r in mb], dtype=torch.long, device=self.device)[rows_of]
        _, traj = torch.unique(traj, return_inverse=True)  # dense trajectory index within the micro-batch
        prox = prox_outside = None
        if self.spec.needs_prox:
            prox = self._padded([r.prox or [] for r in mb], n_pos, 0.0, torch.float32)[sel]
            prox_outside = self._padded([r.prox_outside or [] for r in mb], n_pos, False, torch.bool)[sel]
        mu = x["mu"][sel]
        # a token outside the trainer's own top-K: π_θ = 0 under the replayed distribution (losses.py)
        loss, stats = policy_loss(
            self.spec, logp, mu, torch.ones_like(mu), adv, weight, prox_logp=prox, seq=traj, outside=outside,
            prox_outside=prox_outside,
        )
        return loss, stats, float(ent.sum())

    def _padded(self, vals: list[list[Any]], width: int, fill: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(v[:width]) + [fill] * (width - len(v[:width])) for v in vals], dtype=dtype,
                            device=self.device)

    # ------------------------------------------------------------------ weights out

    @torch.no_grad()
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Weights to push: every tensor of the plain HF model (CPU, contiguous), LoRA merged into
        the adapted matrices (engines refuse a push that names only some of their tensors)."""
        return self._collect(self._weights())

    @torch.no_grad()
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA factors to push, ``{module}.lora_A`` and ``{module}.lora_B`` (scaling folded into B)."""
        if not self.lora:
            raise ValueError("adapter_tensors() needs a LoRA trainer (trainer.lora_rank > 0)")
        return self._collect(self._adapters())

    @torch.no_grad()
    def weight_specs(self, adapters: bool = False) -> list[tuple[str, torch.Tensor]]:
        """What :meth:`named_tensors` (``adapters``: :meth:`adapter_tensors`) hands out, in its order, as ``meta``
        tensors: names, dtypes and whole shapes, no data, nothing gathered (a push's manifest before the gather)."""
        if adapters and not self.lora:
            raise ValueError("weight_specs(adapters=True) needs a LoRA trainer (trainer.lora_rank > 0)")
        return list(self._adapters(_meta) if adapters else self._weights(_meta))

    def _full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of a parameter (the sharded trainer gathers a shard's here)."""
        return t

    def _collect(self, items: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The weights out, on the CPU (the sharded trainer sends them in buckets instead)."""
        return {name: t.detach().to("cpu").contiguous() for name, t in items}

    def _weights(self, full: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the plain HF model, one tensor at a time, LoRA merged (W + s·B·A); ``full`` makes each
        parameter whole (default :meth:`_full_tensor`)."""
        full = full or self._full_tensor
        if not self.lora:
            for k, v in self.model.state_dict().items():
                yield k, full(v)
            return
        adapted = {name + ".weight": (base, a, b, scale) for name, base, a, b, scale in self._adapted_modules()}
        for k, v in self.model.state_dict().items():
            if ".lora_" in k:
                continue
            name = _hf_name(k.replace(".base_layer.", "."))
            if name in adapted:
                base, a, b, scale = adapted[name]
                yield name, full(base) + full(b) @ full(a) * scale
            else:
                yield name, full(v)

    def _adapters(self, full: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        full = full or self._full_tensor
        for name, _, a, b, scale in self._adapted_modules():
            yield name + ".lora_A", full(a)
            yield name + ".lora_B", full(b) * scale

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
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sharded" in state:  # agentrl.trainer.sharded wrote it, each rank its shards
            from agentrl.errors import CheckpointError

            raise CheckpointError(
                f"{state['sharded']} was written by {state['world_size']} trainer ranks (trainer.world_size = "
                f"{state['world_size']}), this trainer has one; resume with --trainer.world_size={state['world_size']}, "
                "or export it (`agentrl export`) and start a new run from the exported model"
            )
        self.model.load_state_dict(state["model"])
        kernels = [(g["fused"], g["foreach"]) for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for g, (fused, foreach) in zip(self.optimizer.param_groups, kernels, strict=True):
            g["fused"], g["foreach"] = fused, foreach  # a checkpoint's kernel choice is not its state
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])


def adapter_start(name: str, shape: torch.Size, seed: int) -> torch.Tensor | None:
    """The start value of a LoRA factor (None for any other parameter): A kaiming-uniform (peft's distribution) from a
    generator seeded by the run seed and the parameter's name, B zeros, so W + s·B·A = W. The same on every rank and
    for every world size, whatever else drew from the global RNG (a sharded rank slices its shard from it)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    if ".lora_A." not in name:
        return None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=gen)


def _hf_name(peft_module_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj`` → ``model.layers.0.self_attn.q_proj``."""
    prefix = "base_model.model."
    return peft_module_name[len(prefix):] if peft_module_name.startswith(prefix) else peft_module_name


def nonfinite_reason(traj: Any) -> str | None:
    """Why this trajectory cannot be trained (a non-finite advantage or μ of a sampled token), or None."""
    if not math.isfinite(traj.advantage):
        return f"non-finite advantage {traj.advantage} (reward {traj.reward})"
    for j, s in enumerate(traj.sequences):
        lps = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=False) if m]
        if not math.isfinite(sum(lps)):  # fast path: one sum over the sampled tokens
            t, bad = next((t, lp) for t, lp in enumerate(lps) if not math.isfinite(lp))
            return f"non-finite μ ({bad}) at sampled token {t} of sequence {j}: the engine reported it"
    return None


def _offsets(groups: list[Group]) -> list[int]:
    """Index of each group's first trajectory in the step."""
    out, n = [], 0
    for g in groups:
        out.append(n)
        n += len(g.trajectories)
    return out


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous, nearly equal, non-empty chunks."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, i = [], 0
    for k in range(parts):
        j = i + size + (1 if k < extra else 0)
        out.append(items[i:j])
        i = j
    return out


def _meta(t: torch.Tensor) -> torch.Tensor:
    """``t``'s dtype and whole shape (a shard's global one), without data."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
