"""Engine settings on the real quickstart: optimizer steps per wall-clock budget, variants alternated.

Each variant is a set of dotted overrides (``--variant NAME=--inference.x=1,--inference.y=2``;
the first is the baseline).  Every round runs ``agentrl run examples/quickstart.toml`` once per
variant, in turn, each a fresh process as a user runs it, for ``--seconds`` of RL after the
(shared, cached) SFT warm start, with evaluation off, so the machine's drift hits every variant
alike.  Reports per variant: optimizer steps, sampled tokens and engine
steps (from the engine's ``/metrics``: tokens per engine step), draft acceptance when n-gram
speculation is on, and the trainer's idle share; ``steps_ratio`` = a variant's mean steps ÷
the baseline's.

``--score-every N`` also asks what the variants learn: each run saves a checkpoint every N
versions (still no evaluation on its clock), and after it ends every checkpoint is scored by
one greedy evaluator on the held-out tasks (``benchmarks/heldout.py``), placed at the RL
seconds when those weights existed; a variant then reports its seconds to ``--target``, its
best and its final held-out reward.  For training settings (the learning rate, the loss),
where steps per second say little.  Last line: JSON.

    python benchmarks/quickstart_variants.py --seconds 100 --rounds 2 \\
        --variant padded=--inference.ragged_batches=false --variant ragged= \\
        --variant spec4=--inference.num_speculative_tokens=4
    python benchmarks/quickstart_variants.py --seconds 45 --score-every 2 \\
        --variant lr2e-4=--trainer.lr=2e-4 --variant lr1e-4=--trainer.lr=1e-4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from heldout import checkpoint_curve, first_at, snapshot_overrides, start_reward, warm_start_as_run
from heldout import evaluator as held_out_evaluator

from agentrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


# set by the script for every run: a variant that changed them would break its clock or its scoring
OWN = ("--run.dir", "--run.max_wall_s", "--eval.every", "--trainer.checkpoint_every", "--trainer.keep_checkpoints")
# what the shared warm start and evaluator depend on (the SFT cache key, with sft.target_reward's
# evaluation settings), and LoRA, whose checkpoints the held-out scoring cannot load
WARM_START = ("--run.seed", "--model.", "--sft.", "--env.", "--trainer.device", "--trainer.dtype", "--trainer.lora",
              "--rollout.max_tokens", "--rollout.max_turns")  # fmt: skip


def parse_overrides(text: str) -> list[str]:
    """``--a=1,--b=[0.9,0.99]``: split at the commas that start another override."""
    return [o for o in re.split(r",(?=--)", text) if o]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant NAME=OVERRIDES, got {text!r}")
    return name, parse_overrides(overrides)


def command(overrides: list[str], seconds: float, run_dir: Path, score_every: int) -> list[str]:
    """``agentrl run`` of the quickstart for one variant: no evaluation on its clock; checkpoints
    every ``score_every`` versions, all kept, when it will be scored (else none)."""
    saves = snapshot_overrides(score_every) if score_every else ["--eval.every=0", "--trainer.checkpoint_every=0"]
    return [sys.executable, "-m", "agentrl.cli", "run", str(QUICKSTART), f"--run.max_wall_s={seconds:g}",
            f"--run.dir={run_dir}", *saves, *overrides]  # fmt: skip


def one(name: str, overrides: list[str], seconds: float, root: Path, score_every: int = 0) -> dict[str, Any]:
    run_dir = root / name
    proc = subprocess.run(command(overrides, seconds, run_dir, score_every), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"quickstart_variants: variant {name!r} failed (exit {proc.returncode}): {' | '.join(tail)}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    out = {
        "steps": len(rows),
        "generated_tokens": last.get("engine/0/generated_tokens", 0),
        "engine_steps": last.get("engine/0/steps", 0),
        "trainer_idle": statistics.mean(r.get("train/idle_frac", 0.0) for r in rows),
        "run_dir": run_dir,
    }
    if out["engine_steps"]:
        out["tokens_per_engine_step"] = out["generated_tokens"] / out["engine_steps"]
    if "engine/0/draft_acceptance" in last:
        out["draft_acceptance"] = last["engine/0/draft_acceptance"]
    return out


class Scorer:
    """The one greedy evaluator of every run's checkpoints, and what a curve says about ``target``."""

    def __init__(self, common: list[str], target: float) -> None:
        from agentrl.config import load_config

        cfg = load_config([str(QUICKSTART)], common)
        if not Path(cfg.model.path).is_absolute():  # the runs resolve relative paths from the checkout
            cfg.model.path = str(ROOT / cfg.model.path)
        if (ROOT / cfg.env.name).is_dir() and not Path(cfg.env.name).is_absolute():
            cfg.env.name = str(ROOT / cfg.env.name)
        warm = warm_start_as_run(cfg)  # once, before any run's clock
        self.evaluator, self.target = held_out_evaluator(cfg, warm), target
        self.start = start_reward(self.evaluator.score, warm)

    def close(self) -> None:
        self.evaluator.close()

    def __call__(self, run_dir: Path) -> dict[str, Any]:
        curve = checkpoint_curve(run_dir, self.evaluator.score, self.start)
        return {"curve": curve, "to_target_s": first_at(curve, self.target),
                "best": max(r for _, r in curve), "final": curve[-1][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME=OVERRIDE[,OVERRIDE...] (the first is the baseline; NAME= runs the defaults)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=100.0, help="RL wall-clock budget per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--common", type=parse_overrides, default=[],
                    help="OVERRIDE[,OVERRIDE...] for every run (and, with --score-every, the evaluator), e.g. "
                         "--common=--run.seed=1")  # fmt: skip
    ap.add_argument("--score-every", type=int, default=0,
                    help="save every N versions and score the checkpoints on held-out tasks after each run (0: off)")
    ap.add_argument("--target", type=float, default=0.6, help="with --score-every: held-out reward to report seconds to")
    a = ap.parse_args()
    names = [n for n, _ in a.variant]
    if len(set(names)) != len(names):
        ap.error(f"variant names must differ: {names}")
    if a.score_every < 0:
        ap.error(f"--score-every must be >= 0, got {a.score_every}")
    if any(o.startswith(OWN) for o in [*a.common, *(o for _, v in a.variant for o in v)]):
        ap.error(f"quickstart_variants sets {', '.join(OWN)} itself: leave them out of --variant and --common")
    if a.score_every and any(o.startswith(WARM_START) for _, v in a.variant for o in v):
        ap.error("with --score-every every variant shares one warm start and evaluator: vary none of "
                 f"{', '.join(WARM_START)} (set them for all with --common)")
    score = Scorer(a.common, a.target) if a.score_every else None
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        with tempfile.TemporaryDirectory(prefix="agentrl-qs-variants-") as tmp:
            for r in range(a.rounds):
                for name, overrides in a.variant:
                    res = one(f"{name}-{r}", [*a.common, *overrides], a.seconds, Path(tmp), a.score_every)
                    if score:  # after the run: its clock is over
                        res.update(score(res["run_dir"]))
                    res.pop("run_dir")
                    runs[name].append(res)
                    print(f"round {r} {name:>10}: {res['steps']} steps, {res['generated_tokens']:.0f} tokens sampled, "
                          f"{res.get('tokens_per_engine_step', 0):.1f} tokens/engine step, idle {res['trainer_idle']:.2f}"
                          + (f", drafts kept {res['draft_acceptance']:.2f}" if "draft_acceptance" in res else "")
                          + (f"; held-out {res['curve'][0][1]:.3f} -> best {res['best']:.3f}, final {res['final']:.3f}, "
                             f"{a.target} " + (f"at {res['to_target_s']} s" if res["to_target_s"] is not None else "never")
                             if score else ""),
                          flush=True)  # fmt: skip
    finally:
        if score:
            score.close()
    base = statistics.mean(x["steps"] for x in runs[names[0]])
    summary = {
        "seconds": a.seconds,
        "rounds": a.rounds,
        "baseline": names[0],
        "common": a.common,
        "steps": {n: [x["steps"] for x in runs[n]] for n in names},
        "steps_ratio": {n: statistics.mean(x["steps"] for x in runs[n]) / base for n in names},
        "runs": runs,
    }
    if score:
        summary |= {"target": a.target, "warm_start": score.start,
                    "to_target_s": {n: [x["to_target_s"] for x in runs[n]] for n in names},
                    "final": {n: [x["final"] for x in runs[n]] for n in names}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
