"""Async vs synchronous on the real quickstart, same seed: with instant tools, or with slow ones.

Runs ``examples/quickstart.toml`` through ``run_training`` — the real embedded engine, calc
environment, trainer and live weight push — with ``buffer.max_staleness = 0`` (exactly
synchronous on-policy) and with η = 2.  The SFT warm start is shared (cached).

Default (instant tools): a fixed number of steps each; prints RL wall time, trainer idle
share, staleness and held-out reward; ``speedup`` = η=0 wall time / η=2 wall time.

``--tool-latency``: every calculator call first waits a heavy-tailed delay (lognormal,
median ``--latency-median`` s, p99 ``--latency-p99`` s, the calc env's
``tool_latency_*`` arguments), as real tools do.  Three runs — η = 0 for
``--sync-seconds``, η = 2 and adaptive η for ``--seconds`` each — save a checkpoint every
few versions and evaluate nothing while they run; afterwards one greedy evaluator scores
every checkpoint on the held-out tasks (``benchmarks/heldout.py``), so evaluation costs no
run any time.  (In-run, an evaluation holds back η=0's next push, and with it all of its
rollouts, far longer than an async run's.)  η=0 saves every ``--sync-snapshot-every``
versions and the async runs every ``--snapshot-every``, so that all three are scored about
equally often in wall time: a noisy curve crosses a threshold sooner when it is sampled more
often.  ``speedup`` = η=0's seconds to ``--target`` held-out reward / the best async run's;
when η=0 never gets there, its whole budget stands in and the ratio is a lower bound
(``speedup_is_lower_bound``).  ``speedup_held`` is the same ratio when the target must hold
for two scored checkpoints in a row.  The ledger's counts show what each run dropped as
stale.  Last line: JSON.

    python benchmarks/async_vs_sync.py [--steps 30] [extra dotted overrides ...]
    python benchmarks/async_vs_sync.py --tool-latency [--seconds 180] [--sync-seconds 300] [--target 0.6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from heldout import checkpoint_curve, evaluator, first_at, snapshot_overrides, start_reward, warm_start_as_run

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.recipes.rl import train as run_training

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
CALC_DIR = ROOT / "environments" / "calc"  # this checkout's env, whichever copy is installed


def one(name: str, overrides: list[str], root: Path, scored: tuple[Any, float] | None = None) -> dict[str, Any]:
    """One quickstart run with ``overrides``; the numbers the comparison needs.  ``scored``
    (evaluator, warm-start reward): the held-out curve comes from the run's checkpoints,
    scored after it (the overrides must include :func:`heldout.snapshot_overrides`)."""
    run_dir = root / name
    ckpt = [] if scored else ["--trainer.checkpoint_every=0"]
    run_training(load_config([str(QUICKSTART)], [f"--run.dir={run_dir}", *ckpt, *overrides]), progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    if scored:
        curve = checkpoint_curve(run_dir, scored[0].score, scored[1])
    else:
        curve = [(round(r["time/rl_wall_s"], 1), r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    return {
        "run": name,
        "rl_wall_s": last["time/rl_wall_s"],
        "steps": last["version"],
        "final_eval_reward": curve[-1][1] if curve else None,
        "start_eval_reward": curve[0][1] if curve else None,
        "eval_curve": curve,
        "trainer_idle_frac": sum(r["train/idle_frac"] for r in rows) / len(rows),
        "staleness_mean": sum(r["buffer/staleness_mean"] for r in rows) / len(rows),
        "max_staleness_last": last["buffer/max_staleness"],
        "ledger": {k[len("ledger/"):]: v for k, v in last.items()
                   if k.startswith("ledger/") and isinstance(v, int | float)},
        "groups_cancelled_stale": last.get("rollout/groups_cancelled_stale", 0),
    }


def fixed_steps(args: argparse.Namespace, extra: list[str], root: Path) -> None:
    steps = [f"--trainer.steps={args.steps}", f"--eval.every={args.steps}"]
    sync = one("eta0", ["--buffer.max_staleness=0", *steps, *extra], root)
    asyn = one("eta2", ["--buffer.max_staleness=2", *steps, *extra], root)
    ratio = sync["rl_wall_s"] / asyn["rl_wall_s"]
    print(f"quickstart, {args.steps} steps, seed from the config; RL wall time excludes SFT/engine start")
    print(f"{'':>6} {'wall_s':>8} {'idle':>6} {'stale':>6} {'eval start':>10} {'eval end':>9}")
    for r in (sync, asyn):
        print(f"{r['run']:<6} {r['rl_wall_s']:>8.1f} {r['trainer_idle_frac']:>6.2f} {r['staleness_mean']:>6.2f} "
              f"{r['start_eval_reward']:>10.3f} {r['final_eval_reward']:>9.3f}")
    print(f"speed-up eta=2 vs eta=0: {ratio:.2f}x")
    print(json.dumps({"benchmark": "async_vs_sync", "steps": args.steps, "sync": sync, "async": asyn,
                      "speedup": ratio}))


def slow_tools(args: argparse.Namespace, extra: list[str], root: Path) -> None:
    # one warm start for all three, trained and cached on instant tools (its early-stop
    # evaluations need not wait on slow ones)
    cfg = load_config([str(QUICKSTART)], [f"--env.name={CALC_DIR}", *extra])
    warm = warm_start_as_run(cfg)
    latency = {"tool_latency_median_s": args.latency_median, "tool_latency_p99_s": args.latency_p99}
    common = [f"--env.name={CALC_DIR}", *(f"--env.args.{k}={v}" for k, v in latency.items()),
              f"--model.path={warm}", "--sft.enabled=false", "--trainer.steps=100000", *extra]
    sync_budget = [f"--run.max_wall_s={args.sync_seconds}", *snapshot_overrides(args.sync_snapshot_every)]
    budget = [f"--run.max_wall_s={args.seconds}", *snapshot_overrides(args.snapshot_every)]
    judge = evaluator(cfg, warm)
    try:
        scored = (judge, start_reward(judge.score, warm))
        runs = [
            one("eta0", ["--buffer.max_staleness=0", *sync_budget, *common], root, scored),
            one("eta2", ["--buffer.max_staleness=2", *budget, *common], root, scored),
            one("adaptive", ["--buffer.adaptive=true", "--buffer.max_staleness=1", "--buffer.max_staleness_cap=4",
                             *budget, *common], root, scored),
        ]
    finally:
        judge.close()
    speedup, lower_bound, times = speedup_to(runs, args.target)
    held, held_bound, _ = speedup_to(runs, args.target, hold=2)
    print(f"quickstart with slow tools: lognormal latency, median {args.latency_median} s, p99 {args.latency_p99} s; "
          f"eta=0 {args.sync_seconds:.0f} s, async {args.seconds:.0f} s per run; target held-out reward {args.target}")
    print(f"{'run':<9} {'steps':>5} {'idle':>5} {'stale':>5} {'eta end':>7} {'eval start':>10} {'eval end':>8} "
          f"{'s to target':>11}  ledger")
    for r in runs:
        t = times[r["run"]]
        led = ", ".join(f"{k}={int(v)}" for k, v in r["ledger"].items() if k != "in_flight")
        print(f"{r['run']:<9} {r['steps']:>5} {r['trainer_idle_frac']:>5.2f} {r['staleness_mean']:>5.2f} "
              f"{r['max_staleness_last']:>7} {r['start_eval_reward']:>10.3f} {r['final_eval_reward']:>8.3f} "
              f"{'never' if t is None else f'{t:.0f}':>11}  {led}")
    for r in runs:
        print(f"{r['run']}: held-out curve (RL s, reward) {r['eval_curve']}")
    by_target = {}  # the headline's target, and its neighbours: how much the ratio hangs on the choice
    for target in sorted({args.target - 0.1, args.target, args.target + 0.1}):
        ratio, bound, at = speedup_to(runs, target)
        by_target[f"{target:.2f}"] = {"speedup": ratio, "is_lower_bound": bound}
        if ratio is None and 0.0 in at.values():
            print(f"speed-up to {target:.2f}: the warm start is already there")
        elif ratio is None:
            print(f"speed-up to {target:.2f}: no async run got there (raise --seconds or lower --target)")
        else:
            print(f"speed-up to {target:.2f} held-out, best async vs eta=0: {'>=' if bound else ''}{ratio:.2f}x")
    if held is not None:
        print(f"speed-up to {args.target:.2f} held for two scored checkpoints in a row: {'>=' if held_bound else ''}"
              f"{held:.2f}x")
    print(json.dumps({"benchmark": "async_vs_sync", "tool_latency": latency, "target": args.target,
                      "seconds_per_run": {"eta0": args.sync_seconds, "async": args.seconds},
                      "seconds_to_target": times, "runs": runs, "speedup_by_target": by_target,
                      "speedup_held": held, "speedup_held_is_lower_bound": held_bound,
                      "speedup": speedup, "speedup_is_lower_bound": lower_bound}))


def speedup_to(runs: list[dict[str, Any]], target: float,
               hold: int = 1) -> tuple[float | None, bool, dict[str, float | None]]:
    """(η=0's seconds to ``target`` / the best async run's, whether that is a lower bound because
    η=0 never got there and its whole budget stands in, every run's seconds to ``target``);
    ``hold``: the target must hold for that many scored points in a row (:func:`heldout.first_at`)."""
    times = {r["run"]: first_at(r["eval_curve"], target, hold) for r in runs}
    sync = runs[0]
    reached = [times[r["run"]] for r in runs[1:] if times[r["run"]] is not None]
    if not reached or min(reached) == 0:  # never, or the shared warm start is already there: no ratio
        return None, False, times
    t_sync = times[sync["run"]]
    return (t_sync if t_sync is not None else sync["rl_wall_s"]) / min(reached), t_sync is None, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="instant tools: steps per run")
    p.add_argument("--tool-latency", action="store_true", help="slow, heavy-tailed tools; time to --target")
    p.add_argument("--latency-median", type=float, default=0.2, help="tool delay median, seconds")
    p.add_argument("--latency-p99", type=float, default=4.0, help="tool delay 99th percentile, seconds")
    p.add_argument("--seconds", type=float, default=180.0, help="slow tools: wall-time budget per async run")
    p.add_argument("--sync-seconds", type=float, default=300.0,
                   help="slow tools: wall-time budget of the eta=0 run (slower per step: give it room to get there)")
    p.add_argument("--target", type=float, default=0.6, help="slow tools: held-out reward to reach")
    p.add_argument("--snapshot-every", type=int, default=5,
                   help="slow tools: async runs save (and are afterwards scored) every N versions")
    p.add_argument("--sync-snapshot-every", type=int, default=2,
                   help="slow tools: eta=0 saves every N versions (~3x slower steps: about as often in wall time)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args, extra = p.parse_known_args()
    root = Path(tempfile.mkdtemp(prefix="agentrl-avs-"))
    try:
        (slow_tools if args.tool_latency else fixed_steps)(args, extra, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
