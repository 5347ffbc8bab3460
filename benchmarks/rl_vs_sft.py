"""RL beyond the demonstrations: RL vs continued SFT from the same warm start, equal wall time.

The task (``examples/beyond_sft.toml``): the guessing game on ranges 24–31 wide with a
budget of 5 guesses (bisection always wins), demonstrations played by a *legal but
inefficient* teacher that counts up from the lowest possible number and bisects only 30%
of its moves (it wins ~36% of games; counting up alone wins ~19%); the reward adds a turn
penalty.  The good move is in the demonstrations, but the most likely move is the slow
one, and that is what imitation converges to under greedy decoding; only RL is paid for
choosing the move that wins.  Success = ``solved``.

    1. warm start   the config's SFT on the teacher's demonstrations (cached)
    2. RL           ``agentrl run`` on the warm start for ``--rl-seconds`` of wall time
    3. SFT          continued SFT from the same warm start on the same demonstrations, for
                    the RL run's whole wall time (engine start included: SFT gets every
                    second RL had, with the RL trainer's torch threads)
    4. evaluate     the warm start and both results with one evaluator: greedy, the same
                    held-out tasks; success, mean model turns, and the turn distribution

Last line: JSON with ``rl_minus_sft`` (held-out success, RL minus SFT).

    python benchmarks/rl_vs_sft.py [--rl-seconds 180] [--seed 0] [extra dotted overrides ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agentrl.config import Config, load_config
from agentrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "beyond_sft.toml"
ENV_DIR = ROOT / "environments" / "guess"  # this checkout's env, whichever copy is installed


def turn_stats(turns: list[int], solved: list[bool]) -> dict[str, Any]:
    """Success, mean model turns and the turn distribution of a set of episodes."""
    n = len(turns)
    return {
        "success": sum(solved) / n if n else 0.0,
        "mean_turns": statistics.fmean(turns) if turns else 0.0,
        "frac_4plus_turns": sum(t >= 4 for t in turns) / n if n else 0.0,
        "turns": {str(k): v for k, v in sorted(Counter(turns).items())},
    }


def evaluate_model(model: Path, cfg: Config, threads: int) -> dict[str, Any]:
    """Greedy held-out episodes of ``model`` on the config's env (the evaluator RL uses)."""
    from agentrl.inference import EngineArgs, PolicyClient, open_policy
    from agentrl.plugins import load_environment
    from agentrl.rollout import evaluate_tasks
    from agentrl.types import SamplingParams

    env = load_environment(cfg.env.name, **cfg.env.args)
    tasks = list(env.eval_dataset())[: cfg.eval.num_tasks]
    ic, ro = cfg.inference, cfg.rollout
    args = EngineArgs(max_batch_size=ic.max_batch_size, max_model_len=ic.max_model_len, device=ic.device)
    policy = open_policy(model, args=args, env={"OMP_NUM_THREADS": str(threads)})

    async def go() -> list[Any]:
        client = PolicyClient(policy.base_urls, policy.model, tool_parser=policy.tool_parser, api_key=policy.api_key)
        try:
            return await evaluate_tasks(env, client, tasks, SamplingParams(max_tokens=ro.max_tokens, temperature=0.0),
                                        timeout_s=ro.episode_timeout_s, max_turns=ro.max_turns)
        finally:
            await client.close()

    try:
        trajs = asyncio.run(go())
    finally:
        policy.stop()
    ok = [t for t in trajs if not t.errored]
    if len(ok) < len(trajs) / 2:  # a broken evaluator, not a model that scores 0
        bad = next(t for t in trajs if t.errored)
        raise SystemExit(f"rl_vs_sft: {len(trajs) - len(ok)} of {len(trajs)} held-out episodes of {model} errored: {bad.error}")
    return turn_stats([len(t.turns) for t in ok], [t.metrics.get("solved", 0.0) == 1.0 for t in ok]) | {
        "reward": sum(t.reward for t in ok) / len(trajs), "errored": len(trajs) - len(ok)}


def run_rl(cfg: Config, seconds: float, run_dir: Path) -> dict[str, Any]:
    """``agentrl run`` for ``seconds`` of wall time; its final model and what its episodes looked like."""
    from agentrl.recipes.rl import train

    cfg = cfg.model_copy(deep=True)
    cfg.run.dir, cfg.run.max_wall_s = str(run_dir), seconds
    cfg.trainer.steps, cfg.trainer.checkpoint_every = 100_000, 0
    cfg.eval.every = 0  # evaluated afterwards, like SFT: no held-out episodes compete with training
    train(cfg, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    episodes = [r for r in read_jsonl(run_dir / "rollouts.jsonl") if not r.get("error")]
    k = max(1, len(episodes) // 10)  # the first and the last tenth of the training episodes

    def stats(eps: list[dict[str, Any]]) -> dict[str, Any]:
        return turn_stats([len(e["turns"]) for e in eps], [e["metrics"].get("solved", 0.0) == 1.0 for e in eps])

    return {
        "wall_s": rows[-1]["time/wall_s"], "steps": rows[-1]["version"], "final_model": run_dir / "final",
        "train_episodes_first": stats(episodes[:k]), "train_episodes_last": stats(episodes[-k:]),
        "stale": rows[-1].get("ledger/stale", 0), "filtered": rows[-1].get("ledger/filtered", 0),
    }


def run_sft(cfg: Config, warm: Path, seconds: float, out_dir: Path, threads: int) -> dict[str, Any]:
    """Continued SFT from ``warm`` on the same demonstrations, for ``seconds`` of wall time."""
    import torch

    from agentrl.plugins import load_environment
    from agentrl.recipes.sft import train_sft

    torch.set_num_threads(threads)
    log = read_jsonl(warm / "sft_metrics.jsonl")
    per_step = statistics.median(b["wall_s"] - a["wall_s"] for a, b in zip(log, log[1:], strict=False)
                                 if "eval_reward_mean" not in b)
    steps = int(seconds / per_step * 1.5) + 10  # an upper bound; the wall limit ends it (warm-up: 5% of this)
    sft = cfg.sft.model_copy(update={"steps": steps})
    env = load_environment(cfg.env.name, **cfg.env.args)
    t0 = time.perf_counter()
    train_sft(warm, env, sft, seed=cfg.run.seed, out_dir=out_dir, device=cfg.trainer.device, progress=False,
              max_wall_s=seconds, cpu_linear=cfg.trainer.cpu_linear)
    done = read_jsonl(out_dir / "sft_metrics.jsonl")
    return {"wall_s": time.perf_counter() - t0, "steps": len(done), "final_model": out_dir,
            "loss_first": done[0]["loss"], "loss_last": statistics.fmean(r["loss"] for r in done[-20:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rl-seconds", type=float, default=180.0, help="RL wall-time budget (SFT gets what RL used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-threads", type=int, default=0,
                   help="torch threads for continued SFT (0 = the RL trainer's: on a shared 2-core machine "
                        "2 threads ran SFT 4-6x slower than 1)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args, extra = p.parse_known_args()
    cfg = load_config([str(CONFIG)], [f"--env.name={ENV_DIR}", f"--run.seed={args.seed}", *extra])
    import torch

    from agentrl.recipes.rl import torch_threads
    from agentrl.recipes.sft import warm_start

    threads = torch_threads(cfg)
    torch.set_num_threads(threads)  # as `agentrl run` does before its warm start

    root = Path(tempfile.mkdtemp(prefix="agentrl-rlsft-"))
    try:
        t0 = time.perf_counter()
        warm = warm_start(cfg, progress=False)  # 1) warm start (cached)
        warm_s = time.perf_counter() - t0
        rl = run_rl(cfg, args.rl_seconds, root / "rl")  # 2) RL
        sft = run_sft(cfg, warm, rl["wall_s"], root / "sft", args.sft_threads or threads)  # 3) equal wall time
        evals = {name: evaluate_model(m, cfg, threads) for name, m in
                 (("warm_start", warm), ("rl", rl["final_model"]), ("sft", sft["final_model"]))}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(cfg, args, warm_s, rl, sft, evals)


def report(cfg: Config, args: argparse.Namespace, warm_s: float, rl: dict, sft: dict, evals: dict) -> None:
    print(f"guess game, {cfg.env.args}; seed {args.seed}; warm start {warm_s:.0f} s (0 when cached)")
    print(f"RL : {rl['steps']} steps in {rl['wall_s']:.0f} s (stale dropped {rl['stale']}, zero-variance "
          f"filtered {rl['filtered']})")
    print(f"SFT: {sft['steps']} steps in {sft['wall_s']:.0f} s; loss {sft['loss_first']:.3f} -> {sft['loss_last']:.3f}")
    print(f"{'greedy held-out':<16} {'success':>8} {'reward':>7} {'turns':>6} {'>=4 turns':>9}  turn distribution")
    for name, e in evals.items():
        print(f"{name:<16} {e['success']:>8.3f} {e['reward']:>7.3f} {e['mean_turns']:>6.2f} {e['frac_4plus_turns']:>9.2f}"
              f"  {e['turns']}")
    for name in ("train_episodes_first", "train_episodes_last"):
        e = rl[name]
        print(f"RL {name[15:]:<5} tenth of training episodes: success {e['success']:.3f}, mean turns "
              f"{e['mean_turns']:.2f}, turns {e['turns']}")
    diff = evals["rl"]["success"] - evals["sft"]["success"]
    print(f"RL minus SFT (held-out success): {diff:+.3f}; turns RL {evals['rl']['mean_turns']:.2f} vs "
          f"SFT {evals['sft']['mean_turns']:.2f}")
    rl_out = {k: v for k, v in rl.items() if k != "final_model"}
    sft_out = {k: v for k, v in sft.items() if k != "final_model"}
    print(json.dumps({"benchmark": "rl_vs_sft", "seed": args.seed, "eval": evals, "rl": rl_out, "sft": sft_out,
                      "rl_minus_sft": diff,
                      "turns_rl_minus_sft": evals["rl"]["mean_turns"] - evals["sft"]["mean_turns"]}))


if __name__ == "__main__":
    main()
