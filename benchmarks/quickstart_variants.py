"""Engine settings on the real quickstart: optimizer steps per wall-clock budget, variants alternated.

Each variant is a set of dotted overrides (``--variant NAME=--inference.x=1,--inference.y=2``;
the first is the baseline).  Every round runs ``agentrl run examples/quickstart.toml`` once per
variant, in turn, each a fresh process as a user runs it, for ``--seconds`` of RL after the
(shared, cached) SFT warm start, with evaluation off, so the machine's drift hits every variant
alike.  Reports per variant: optimizer steps, sampled tokens and engine
steps (from the engine's ``/metrics``: tokens per engine step), draft acceptance when n-gram
speculation is on, and the trainer's idle share; ``steps_ratio`` = a variant's mean steps ÷
the baseline's.  Last line: JSON.

    python benchmarks/quickstart_variants.py --seconds 100 --rounds 2 \\
        --variant padded=--inference.ragged_batches=false --variant ragged= \\
        --variant spec4=--inference.num_speculative_tokens=4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from agentrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant NAME=OVERRIDES, got {text!r}")
    return name, [o for o in overrides.split(",") if o]


def one(name: str, overrides: list[str], seconds: float, root: Path) -> dict[str, Any]:
    run_dir = root / name
    cmd = [sys.executable, "-m", "agentrl.cli", "run", str(QUICKSTART), "--eval.every=0",
           f"--run.max_wall_s={seconds:g}", f"--run.dir={run_dir}", "--trainer.checkpoint_every=0", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
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
    }
    if out["engine_steps"]:
        out["tokens_per_engine_step"] = out["generated_tokens"] / out["engine_steps"]
    if "engine/0/draft_acceptance" in last:
        out["draft_acceptance"] = last["engine/0/draft_acceptance"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME=OVERRIDE[,OVERRIDE...] (the first is the baseline; NAME= runs the defaults)")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=100.0, help="RL wall-clock budget per run")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    names = [n for n, _ in a.variant]
    if len(set(names)) != len(names):
        ap.error(f"variant names must differ: {names}")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="agentrl-qs-variants-") as tmp:
        for r in range(a.rounds):
            for name, overrides in a.variant:
                res = one(f"{name}-{r}", overrides, a.seconds, Path(tmp))
                runs[name].append(res)
                print(f"round {r} {name:>10}: {res['steps']} steps, {res['generated_tokens']:.0f} tokens sampled, "
                      f"{res.get('tokens_per_engine_step', 0):.1f} tokens/engine step, idle {res['trainer_idle']:.2f}"
                      + (f", drafts kept {res['draft_acceptance']:.2f}" if "draft_acceptance" in res else ""),
                      flush=True)  # fmt: skip
    base = statistics.mean(x["steps"] for x in runs[names[0]])
    summary = {
        "seconds": a.seconds,
        "rounds": a.rounds,
        "baseline": names[0],
        "steps": {n: [x["steps"] for x in runs[n]] for n in names},
        "steps_ratio": {n: statistics.mean(x["steps"] for x in runs[n]) / base for n in names},
        "runs": runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
