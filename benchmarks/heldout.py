"""Held-out curves for the time-to-reward benchmarks (``vs_trl.py``, ``async_vs_sync.py``).

A run saves a checkpoint every few versions and evaluates nothing while its clock runs; after
it ends, every checkpoint is scored by one greedy evaluator (the same 200 held-out tasks, an
embedded engine, temperature 0) and placed at the RL seconds when those weights existed.  So
evaluation costs no run any time (an in-run evaluation holds back a synchronous run's next
push far longer than an asynchronous one's), and every run is scored by the same evaluator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

Curve = list[tuple[float, float]]  # (RL seconds, held-out reward)


def first_at(curve: Curve, target: float, hold: int = 1) -> float | None:
    """Seconds of the first point at or above ``target`` that starts ``hold`` such points in a
    row (None: never).  ``hold=2`` ignores a lone lucky evaluation."""
    for i, (t, _) in enumerate(curve):
        run = curve[i: i + hold]
        if len(run) == hold and all(r >= target for _, r in run):
            return t
    return None


def evaluator(cfg: Any, warm: Path) -> Any:
    """The one greedy evaluator: ``cfg.eval.num_tasks`` held-out tasks of ``cfg.env``, no tool latency."""
    from agentrl.plugins import load_environment
    from agentrl.recipes.sft import GreedyEvaluator

    held_out = cfg.model_copy(deep=True)
    held_out.sft.eval_tasks = cfg.eval.num_tasks  # the evaluator takes its task count from [sft]
    args = {k: v for k, v in cfg.env.args.items() if not k.startswith("tool_latency")}  # score the policy only
    return GreedyEvaluator(warm, load_environment(cfg.env.name, **args), held_out)


def warm_start_as_run(cfg: Any) -> Path:
    """The runs' shared warm start, built (or found cached) as ``agentrl run`` builds it: under
    the torch thread count it sets first (this process keeps that count)."""
    import torch

    from agentrl.recipes.rl import torch_threads
    from agentrl.recipes.sft import warm_start

    torch.set_num_threads(torch_threads(cfg))
    return warm_start(cfg, progress=False)


def start_reward(score: Any, warm: Path) -> float:
    """The warm start's held-out reward by ``score(model, version)``: every curve's point at 0 s."""
    from transformers import AutoModelForCausalLM

    return score(AutoModelForCausalLM.from_pretrained(warm), 0)


def snapshot_settings(every: int) -> dict[str, int]:
    """What a run needs for :func:`checkpoint_curve`, as dotted config keys: a checkpoint every
    ``every`` versions, all kept, and no evaluation of its own."""
    return {"trainer.checkpoint_every": every, "trainer.keep_checkpoints": 0, "eval.every": 0}


def snapshot_overrides(every: int) -> list[str]:
    """:func:`snapshot_settings` as command-line overrides."""
    return [f"--{key}={value}" for key, value in snapshot_settings(every).items()]


def apply_snapshot_settings(cfg: Any, every: int) -> None:
    """:func:`snapshot_settings` set on a loaded config."""
    for key, value in snapshot_settings(every).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def checkpoint_curve(run_dir: Path, score: Any, start: float) -> Curve:
    """``start`` (the warm start's reward) at 0 s, then every checkpoint of ``run_dir`` scored by
    ``score(model, version)`` at the RL seconds of its version (from the run's metrics).
    Full fine-tuning runs only: a LoRA trainer's checkpoint holds peft's parameter names."""
    from transformers import AutoModelForCausalLM

    from agentrl.metrics import read_jsonl
    from agentrl.trainer.checkpoint import checkpoint_step, complete_checkpoints, load_checkpoint

    at_version: dict[int, float] = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):  # a skipped step repeats its version: the first row counts
        at_version.setdefault(r["version"], r["time/rl_wall_s"])
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")  # the architecture; weights per checkpoint
    curve = [(0.0, start)]
    for ckpt in complete_checkpoints(run_dir):
        version = checkpoint_step(ckpt)
        model.load_state_dict(load_checkpoint(ckpt)[0]["model"])
        curve.append((round(at_version[version], 1), score(model, version)))
    return curve
