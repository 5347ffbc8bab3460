"""Steps/s of the same RL run on the local backend and on the Ray backend (one machine).

The quickstart shape (``calc`` env, tiny model, group 4, 2 groups a step) runs twice with the
same config, once per ``cluster.backend``; only the backend changes.  What Ray adds on one
machine: the engine lives in a Ray actor (its own process, placed by Ray), the supervisor
health-checks it every second off the event loop, and Ray's own start-up (excluded from the
rate: steps/s counts steps 1..N over their wall time, step 0 absorbs compilation and warm-up).

``--trainer-actor`` and ``--rollout-workers N`` move those roles into Ray actors too.

Prints a table, the ratio ray / local (goal ≥ 0.8), and a JSON line last.  Runs one after the
other, never in parallel, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.recipes.rl import train
from agentrl.tiny_model import build_tiny_model


def run(model: Path, root: Path, backend: str, steps: int, engines: int, **roles: object) -> dict[str, float]:
    run_dir = root / backend
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": backend, "cluster.num_inference": engines, "cluster.engine_cpus": 0.5,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 24, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": steps, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 0, "inference.max_batch_size": 16, "trainer.num_threads": 1,
        **{f"cluster.{k}": v for k, v in roles.items()},
    }  # fmt: skip
    t0 = time.perf_counter()
    train(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    total = time.perf_counter() - t0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    span = rows[-1]["time/rl_wall_s"] - rows[0]["time/rl_wall_s"]
    return {"steps_per_s": (len(rows) - 1) / span, "total_s": total, "trained": rows[-1]["ledger/trained"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (step 0 is warm-up)")
    ap.add_argument("--engines", type=int, default=1, help="engines on the Ray backend (local starts one)")
    ap.add_argument("--trainer-actor", action="store_true", help="Ray: the trainer in its own actor")
    ap.add_argument("--rollout-workers", type=int, default=0, help="Ray: rollout worker actors (0: the driver)")
    args = ap.parse_args()
    roles: dict[str, object] = {}
    if args.trainer_actor:
        roles.update(trainer_actor="true", trainer_cpus=0.5)
    if args.rollout_workers:
        roles.update(rollout_workers=args.rollout_workers, worker_cpus=0.25)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny", layers=2, hidden=64, heads=4)
        local = run(model, root, "local", args.steps, 1)
        on_ray = run(model, root, "ray", args.steps, args.engines, **roles)
    ratio = on_ray["steps_per_s"] / local["steps_per_s"]
    print(f"{'backend':<8} {'steps/s':>8} {'total s':>8} {'trained':>8}")
    for name, r in (("local", local), (f"ray x{args.engines}", on_ray)):
        print(f"{name:<8} {r['steps_per_s']:>8.3f} {r['total_s']:>8.1f} {r['trained']:>8.0f}")
    print(f"ray / local steps/s: {ratio:.2f}x (goal >= 0.8x)")
    print(json.dumps({"benchmark": "ray_overhead", "steps": args.steps, "engines": args.engines,
                      "trainer_actor": args.trainer_actor, "rollout_workers": args.rollout_workers,
                      "local_steps_per_s": round(local["steps_per_s"], 4), "ray_steps_per_s": round(on_ray["steps_per_s"], 4),
                      "ratio": round(ratio, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
