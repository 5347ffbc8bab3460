"""agentrl vs TRL's GRPOTrainer: seconds to the same held-out reward, same task and warm start.

Both sides start from the quickstart's SFT warm start (cached) and train on the calc
environment's 2-turn episode (call the calculator, then answer) with the same reward
(``correct_answer``), the same tool (``calculator``), group size 8, 64 completions per
step, the quickstart's lr (1e-4), AdamW betas (0.9, 0.99), 10 warm-up steps, grad clip 1, temperature 0.6:

- **TRL**: ``GRPOTrainer`` with ``tools=[calculator]`` — its own generation and its own
  tool-calling loop (one tool round, like ``rollout.max_turns = 2``), on CPU (``--trl-threads``).
  The tiny model's chat template renders tool calls the way Qwen's does, so TRL's own Qwen
  response template parses them; the tool schema is left out of the prompt, as the calc
  env leaves it out (checked: TRL's prompt tokens equal agentrl's).
- **agentrl**: ``agentrl run examples/quickstart.toml`` (async, η = 1, embedded engine).

Held-out reward is measured by one evaluator (agentrl's greedy evaluation of the same
200 held-out tasks on an embedded engine), and neither side's clock runs while it does: TRL
is evaluated from a callback every ``--eval-every-s`` training seconds with its clock
stopped; agentrl runs with no in-run evaluation, saves a checkpoint every
``--snapshot-every`` versions (its clock keeps running through the saves), and each
checkpoint is evaluated after the run, at the RL seconds when those weights existed
(``benchmarks/heldout.py``).  By default TRL is scored as often as agentrl was
(``checkpoint_spacing``: the last checkpoint's seconds over the number of checkpoints; a side
scored more often gets more chances to cross a target early).  ``speedup_vs_trl`` = TRL's
seconds to ``--target`` / agentrl's
(a run that never gets there stands in with its whole budget: the ratio is then a bound,
marked); ``speedup_held`` is the same ratio when the target must hold for two evaluations in
a row.  ``speedup_by_target`` repeats the ratio at 0.7, 0.8 and at TRL's best held-out score
(``trl_best``: how much sooner agentrl was as good as TRL ever got).  Last line: JSON.

    pip install -e '.[bench]'    # TRL and datasets (the baseline; not agentrl dependencies)
    python benchmarks/vs_trl.py [--seconds 240] [--target 0.6] [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from heldout import apply_snapshot_settings, checkpoint_curve, first_at, start_reward, warm_start_as_run
from heldout import evaluator as held_out_evaluator

from agentrl.config import Config, load_config
from agentrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
CALC_DIR = ROOT / "environments" / "calc"  # this checkout's env, whichever copy is installed


# ----------------------------------------------------------------------------- agentrl


def run_agentrl(cfg: Config, seconds: float, run_dir: Path, snapshot_every: int, evaluator: Any,
                warm_reward: float, batch_groups: int = 0) -> dict[str, Any]:
    """``agentrl run`` for ``seconds`` with no in-run evaluation; then its held-out curve, one
    point per checkpoint scored after the run (``benchmarks/heldout.py``)."""
    from agentrl.recipes.rl import train

    cfg = cfg.model_copy(deep=True)
    cfg.run.dir, cfg.run.max_wall_s = str(run_dir), seconds
    cfg.trainer.steps = 100_000
    apply_snapshot_settings(cfg, snapshot_every)  # scored below, off the clock, as TRL is
    cfg.trainer.batch_groups = batch_groups or cfg.trainer.batch_groups
    train(cfg, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {"curve": checkpoint_curve(run_dir, evaluator.score, warm_reward), "steps": rows[-1]["version"],
            "wall_s": rows[-1]["time/rl_wall_s"], "snapshot_every": snapshot_every}


def checkpoint_spacing(curve: list[tuple[float, float]]) -> float:
    """Mean seconds between the scored points of a held-out curve whose first point is the warm
    start at 0 s: the last point's seconds over the number of points after it."""
    if len(curve) < 2:
        raise ValueError("checkpoint_spacing: the curve has no scored checkpoint after the warm start")
    return curve[-1][0] / (len(curve) - 1)


def trl_scoring_every(eval_every_s: float, agentrl_curve: list[tuple[float, float]]) -> float:
    """TRL's scoring interval: ``--eval-every-s`` when given, else as often as agentrl was scored
    (a side scored more often gets more chances to cross a target early)."""
    return eval_every_s or checkpoint_spacing(agentrl_curve)


# ----------------------------------------------------------------------------- TRL


def trl_tokenizer(model: Path, calculator: Any) -> Any:
    """The warm start's tokenizer for TRL: tool calls parsed by TRL's Qwen response template,
    no tool schema in the prompt (as the calc env renders it)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tok = AutoTokenizer.from_pretrained(model)
    plain = tok.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], add_generation_prompt=True)
    tok.chat_template = tok.chat_template.replace("has_system or tools", "has_system").replace(
        "{%- if tools -%}", "{%- if false -%}")
    with_tools = tok.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], tools=[calculator],
                                         add_generation_prompt=True)
    if with_tools != plain:
        raise SystemExit("vs_trl: the tiny chat template changed; TRL's prompts would differ from agentrl's")
    tok.response_template = qwen3_template
    return tok


class _Clock:
    """TRL's training seconds, with evaluation time taken out; held-out curve; the budget."""

    def __init__(self, seconds: float, every_s: float, score: Any) -> None:
        self.seconds, self.every_s, self.score = seconds, every_s, score
        self.t0 = time.perf_counter()
        self.paused = 0.0
        self.next_eval = 0.0
        self.curve: list[tuple[float, float]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def evaluate(self, model: Any, step: int) -> None:
        t, t_eval = self.now(), time.perf_counter()
        self.curve.append((round(t, 1), self.score(model, step)))
        self.paused += time.perf_counter() - t_eval
        self.next_eval = t + self.every_s


def run_trl(cfg: Config, warm: Path, seconds: float, out_dir: Path, every_s: float, threads: int, evaluator: Any,
            warm_reward: float) -> dict[str, Any]:
    """TRL's GRPOTrainer on the calc task for ``seconds`` (evaluation time excluded)."""
    import torch
    from agentrl_env_calc import calculator, correct_answer
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.plugins import load_environment
    from agentrl.trainer.trainer import resolve_lr

    torch.set_num_threads(threads)
    env = load_environment(cfg.env.name, **cfg.env.args)
    rows = [{"prompt": [{"role": m.role, "content": m.content} for m in t.prompt], "answer": t.answer}
            for t in env.dataset()]

    def reward(completions: list[list[dict]], answer: list[Any], **_: Any) -> list[float]:
        return [correct_answer(c[-1]["content"] if c else "", a) for c, a in zip(completions, answer, strict=True)]

    ro, tc = cfg.rollout, cfg.trainer
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, seed=cfg.run.seed, max_steps=100_000, learning_rate=resolve_lr(tc, warm),
        adam_beta1=tc.betas[0], adam_beta2=tc.betas[1], weight_decay=0.0, warmup_steps=tc.warmup_steps,
        lr_scheduler_type="constant_with_warmup", max_grad_norm=tc.grad_clip,
        num_generations=ro.group_size, per_device_train_batch_size=ro.group_size * tc.batch_groups,
        temperature=ro.temperature, max_completion_length=2 * ro.max_tokens + 16, max_tool_calling_iterations=1,
        beta=0.0, logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
        # GRPOConfig turns activation (gradient) checkpointing on by default; agentrl's trainer does not
        # recompute activations, and for a tiny model it only costs TRL time
        activation_checkpointing=False,
    )
    clock = _Clock(seconds, every_s, evaluator.score)

    class Budget(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if clock.now() >= clock.next_eval or clock.now() >= seconds:
                clock.evaluate(model, state.global_step)
            control.should_training_stop = clock.now() >= seconds

    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=trl_tokenizer(warm, calculator), tools=[calculator], callbacks=[Budget()])
    clock.curve.append((0.0, warm_reward))  # the warm start, on the same evaluator
    clock.t0, clock.paused = time.perf_counter(), 0.0
    clock.next_eval = every_s
    trainer.train()
    return {"curve": clock.curve, "steps": trainer.state.global_step, "wall_s": clock.now()}


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="training seconds per side")
    p.add_argument("--target", type=float, default=0.6, help="held-out reward to reach")
    p.add_argument("--eval-every-s", type=float, default=0.0,
                   help="TRL: evaluate every N training seconds (0 = as often as agentrl's checkpoints were scored)")
    p.add_argument("--snapshot-every", type=int, default=10,
                   help="agentrl: save (and afterwards evaluate) the weights every N versions")
    p.add_argument("--agentrl-batch-groups", type=int, default=0,
                   help="agentrl's groups per step (0 = TRL's: 64 completions). 4 trains 32 episodes, all in groups "
                        "with signal, from about the 64 a TRL step samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-threads", type=int, default=0,
                   help="torch threads for TRL (0 = agentrl's trainer's; on a shared 2-core machine 2 ran slower than 1)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args, extra = p.parse_known_args()
    if args.eval_every_s < 0:
        p.error(f"--eval-every-s must be >= 0 (0: as often as agentrl's checkpoints), got {args.eval_every_s:g}")
    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:  # say so before agentrl's side spends its minutes
        print(f"vs_trl.py: the baseline needs {' and '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        sys.exit(2)
    cfg = load_config([str(QUICKSTART)], [f"--env.name={CALC_DIR}", f"--run.seed={args.seed}", *extra])
    from agentrl.recipes.rl import torch_threads

    warm = warm_start_as_run(cfg)
    evaluator = held_out_evaluator(cfg, warm)
    root = Path(tempfile.mkdtemp(prefix="agentrl-vstrl-"))
    try:
        warm_reward = start_reward(evaluator.score, warm)
        ours = run_agentrl(cfg, args.seconds, root / "agentrl", args.snapshot_every, evaluator, warm_reward,
                           args.agentrl_batch_groups)
        args.eval_every_s = trl_scoring_every(args.eval_every_s, ours["curve"])
        trl = run_trl(cfg, warm, args.seconds, root / "trl", args.eval_every_s, args.trl_threads or torch_threads(cfg),
                      evaluator, warm_reward)
    finally:
        evaluator.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(args, ours, trl)


def ratio(t_trl: float | None, t_ours: float | None, trl_s: float, ours_s: float) -> tuple[float | None, str | None]:
    """(TRL's seconds to the target / agentrl's, "lower"/"upper" when one side never got there
    and its whole budget stands in); None when neither got there, or the shared warm start
    already was there (0 s on both sides)."""
    if t_ours == 0 or t_trl == 0:
        return None, None  # the shared warm start's point: no race was run
    if t_ours is not None and t_trl is not None:
        return t_trl / t_ours, None
    if t_ours is not None:
        return trl_s / t_ours, "lower"  # TRL never got there
    if t_trl is not None:
        return t_trl / ours_s, "upper"  # agentrl never got there
    return None, None


def ladder(ours: dict[str, Any], trl: dict[str, Any], targets: list[float]) -> dict[str, dict[str, Any]]:
    """``ratio`` at each target, plus ``trl_best``: agentrl's seconds to TRL's best held-out score
    against TRL's own (the "as good as the baseline ever got" race, which a target set near the
    warm start cannot show)."""
    best_trl = max(v for _, v in trl["curve"])
    rungs = {f"{t:g}": t for t in targets} | {"trl_best": best_trl}
    out = {}
    for name, t in rungs.items():
        t_ours, t_trl = first_at(ours["curve"], t), first_at(trl["curve"], t)
        r, bound = ratio(t_trl, t_ours, trl["wall_s"], ours["wall_s"])
        out[name] = {"target": t, "agentrl_s": t_ours, "trl_s": t_trl, "speedup": r, "bound": bound}
    return out


def _shown(speedup: float | None, bound: str | None) -> str:
    if speedup is None:
        return "-"
    return {"lower": "≥ ", "upper": "≤ "}.get(bound or "", "") + f"{speedup:.2f}x"


def report(args: argparse.Namespace, ours: dict[str, Any], trl: dict[str, Any]) -> None:
    import trl as trl_pkg

    t_ours, t_trl = first_at(ours["curve"], args.target), first_at(trl["curve"], args.target)
    speedup, bound = ratio(t_trl, t_ours, trl["wall_s"], ours["wall_s"])
    print(f"calc quickstart task, seed {args.seed}, {args.seconds:.0f} s each; TRL {trl_pkg.__version__} GRPOTrainer "
          f"(its tool loop) vs agentrl run; target held-out {args.target}")
    for name, r in (("agentrl", ours), ("TRL", trl)):
        t = first_at(r["curve"], args.target)
        print(f"{name:<8} {r['steps']:>4} steps  s to target: {'never' if t is None else f'{t:.0f}':>5}  "
              f"final {r['curve'][-1][1]:.3f}  best {max(v for _, v in r['curve']):.3f}  curve {r['curve']}")
    if speedup is not None:
        print(f"speed-up vs TRL to {args.target}: {speedup:.2f}x" + (f" ({bound} bound)" if bound else ""))
    rungs = ladder(ours, trl, sorted({args.target, 0.7, 0.8}))
    print("speed-up by target: " + ", ".join(f"{k} {_shown(v['speedup'], v['bound'])}" for k, v in rungs.items()))
    # the same ratio when the target must hold for two evaluations in a row (a lone high point does not count)
    held = {name: first_at(r["curve"], args.target, hold=2) for name, r in (("agentrl", ours), ("trl", trl))}
    held_ratio, held_bound = ratio(held["trl"], held["agentrl"], trl["wall_s"], ours["wall_s"])
    print(json.dumps({"benchmark": "vs_trl", "trl_version": trl_pkg.__version__, "seed": args.seed,
                      "agentrl_batch_groups": args.agentrl_batch_groups or None, "trl_eval_every_s": args.eval_every_s,
                      "target": args.target, "seconds": args.seconds, "agentrl": ours, "trl": trl,
                      "seconds_to_target": {"agentrl": t_ours, "trl": t_trl}, "seconds_to_target_held": held,
                      "speedup_held": held_ratio, "speedup_held_bound": held_bound, "speedup_vs_trl": speedup,
                      "speedup_bound": bound, "speedup_by_target": rungs}))


if __name__ == "__main__":
    main()
