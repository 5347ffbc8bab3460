"""Async (η = 2) vs synchronous (η = 0) on the real quickstart, same seed, fixed steps.

Runs ``examples/quickstart.toml`` twice through ``run_training`` — the real embedded
engine, calc environment, trainer and live weight push — once with
``buffer.max_staleness = 0`` (exactly synchronous on-policy) and once with η = 2.  The
SFT warm start is shared (cached).  Prints RL wall time, trainer idle share, staleness
and the final held-out eval reward for both, and the speed-up ratio.  Last line: JSON.

    python benchmarks/async_vs_sync.py [--steps 30] [extra dotted overrides ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.recipes.rl import train as run_training


def one(eta: int, steps: int, extra: list[str], root: Path) -> dict:
    run_dir = root / f"eta{eta}"
    overrides = [f"--run.dir={run_dir}", f"--buffer.max_staleness={eta}", f"--trainer.steps={steps}",
                 f"--eval.every={steps}", "--trainer.checkpoint_every=0", *extra]
    run_training(load_config(["examples/quickstart.toml"], overrides), progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    return {
        "eta": eta,
        "rl_wall_s": last["time/rl_wall_s"],
        "steps": len(rows),
        "final_eval_reward": last.get("eval/reward_mean"),
        "start_eval_reward": rows[0].get("eval/reward_mean"),
        "trainer_idle_frac": sum(r["train/idle_frac"] for r in rows) / len(rows),
        "staleness_mean": sum(r["buffer/staleness_mean"] for r in rows) / len(rows),
        "episodes_stale": last["ledger/stale"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args, extra = p.parse_known_args()
    root = Path(tempfile.mkdtemp(prefix="agentrl-avs-"))
    try:
        sync, asyn = one(0, args.steps, extra, root), one(2, args.steps, extra, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    ratio = sync["rl_wall_s"] / asyn["rl_wall_s"]
    print(f"quickstart, {args.steps} steps, seed from the config; RL wall time excludes SFT/engine start")
    print(f"{'':>6} {'wall_s':>8} {'idle':>6} {'stale':>6} {'eval start':>10} {'eval end':>9}")
    for r in (sync, asyn):
        print(f"eta={r['eta']:<2} {r['rl_wall_s']:>8.1f} {r['trainer_idle_frac']:>6.2f} {r['staleness_mean']:>6.2f} "
              f"{r['start_eval_reward']:>10.3f} {r['final_eval_reward']:>9.3f}")
    print(f"speed-up eta=2 vs eta=0: {ratio:.2f}x")
    print(json.dumps({"benchmark": "async_vs_sync", "steps": args.steps, "sync": sync, "async": asyn,
                      "speedup": ratio}))


if __name__ == "__main__":
    main()
