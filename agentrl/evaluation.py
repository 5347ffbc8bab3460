"""``agentrl eval``: run an environment against a model and keep every episode.

Results are JSON lines in ``OUT/results.jsonl``, one per episode, appended (and flushed)
as each task's group of rollouts finishes, so an interrupted eval loses at most the groups
in flight.  ``resume=True`` keeps finished, non-errored episodes and reruns only the
missing or errored ones.  The summary (mean reward, pass@k, error rate) is computed from
the latest line of every (task, rollout) slot.

pass@k uses the unbiased estimator 1 − C(n−c, k)/C(n, k) over the n rollouts of a task
(c of them with reward ≥ ``pass_threshold``), averaged over tasks; errored episodes count
as failures.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.types import SamplingParams, Task, Trajectory

RESULTS = "results.jsonl"
META = "meta.json"


def episode_record(traj: Trajectory, task_index: int, rollout: int, model: str) -> dict[str, Any]:
    """One JSON line: what happened in the episode, without the raw token arrays."""
    return {
        "task_index": task_index,
        "rollout": rollout,
        "task_id": traj.task.id,
        "env": traj.env_name,
        "env_version": traj.env_version,
        "model": model,
        "answer": traj.task.answer,
        "messages": [m.to_dict() for m in traj.messages],
        "num_tool_calls": sum(len(m.tool_calls) for m in traj.messages),
        "prompt_tokens": traj.turns[0].prompt_len if traj.turns else 0,
        "completion_tokens": sum(len(t.completion_ids) for t in traj.turns),
        "turns": len(traj.turns),
        "reward": traj.reward,
        "metrics": traj.metrics,
        "stop_reason": traj.stop_reason,
        "error": traj.error,
        "timing": traj.timing,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSummary:
    env: str
    model: str
    tasks: int
    rollouts: int
    episodes: int
    mean_reward: float
    error_rate: float
    pass_at: dict[int, float] = field(default_factory=dict)
    stop_reasons: dict[str, int] = field(default_factory=dict)
    mean_turns: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "pass_at": {str(k): v for k, v in self.pass_at.items()}}


def read_results(out_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Latest record per (task_index, rollout); a torn last line is ignored."""
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    path = out_dir / RESULTS
    if not path.exists():
        return latest
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            latest[(int(rec["task_index"]), int(rec["rollout"]))] = rec
        except (ValueError, KeyError, TypeError):
            continue
    return latest


def summarize(records: list[dict[str, Any]], env: str, model: str, rollouts: int, pass_threshold: float) -> EvalSummary:
    by_task: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_task.setdefault(r["task_index"], []).append(r)
    n_ep = len(records)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= rollouts]
    pass_at = {}
    for k in ks:
        vals = [
            pass_at_k(len(rs), sum(1 for r in rs if r["error"] is None and r["reward"] >= pass_threshold), k)
            for rs in by_task.values()
            if len(rs) >= k
        ]
        if vals:
            pass_at[k] = sum(vals) / len(vals)
    stops: dict[str, int] = {}
    for r in records:
        stops[str(r["stop_reason"])] = stops.get(str(r["stop_reason"]), 0) + 1
    metric_sums: dict[str, list[float]] = {}
    for r in records:
        if r["error"] is None:
            for k, v in (r.get("metrics") or {}).items():
                if isinstance(v, int | float):
                    metric_sums.setdefault(k, []).append(float(v))
    return EvalSummary(
        env=env,
        model=model,
        tasks=len(by_task),
        rollouts=rollouts,
        episodes=n_ep,
        mean_reward=sum(r["reward"] for r in records) / n_ep if n_ep else 0.0,
        error_rate=sum(1 for r in records if r["error"] is not None) / n_ep if n_ep else 0.0,
        pass_at=pass_at,
        stop_reasons=stops,
        mean_turns=sum(r["turns"] for r in records) / n_ep if n_ep else 0.0,
        metrics={k: sum(v) / len(v) for k, v in sorted(metric_sums.items())},
    )


def _check_meta(out_dir: Path, meta: dict[str, Any], resume: bool) -> None:
    path = out_dir / META
    if path.exists():
        old = json.loads(path.read_text())
        if not resume and (out_dir / RESULTS).exists():
            raise AgentrlError(f"{out_dir} already holds results; pass --resume to continue them or choose another --out")
        for key in ("env", "env_args", "model"):
            if old.get(key) != meta.get(key):
                raise AgentrlError(
                    f"{out_dir} holds results for {key}={old.get(key)!r}, not {meta.get(key)!r}; use another --out"
                )
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2, default=str))


async def evaluate(
    env: Any,
    client: Any,
    *,
    model: str,
    out_dir: str | Path,
    num_tasks: int = 5,
    rollouts: int = 3,
    concurrency: int = 32,
    sampling: SamplingParams | None = None,
    max_turns: int | None = None,
    resume: bool = False,
    token_exact: bool = True,
    pass_threshold: float = 1.0,
    env_args: dict[str, Any] | None = None,
    on_episode: Callable[[int], None] | None = None,
) -> EvalSummary:
    """Run ``rollouts`` episodes on each of the first ``num_tasks`` held-out tasks."""
    out = Path(out_dir)
    sampling = sampling or SamplingParams(max_tokens=256, temperature=0.0)
    _check_meta(out, {"env": env.name, "env_version": env.version, "env_args": env_args or {}, "model": model}, resume)
    held = env.eval_dataset()
    source = held if held is not None else env.dataset()
    tasks: list[Task] = []
    for t in source:
        if len(tasks) >= num_tasks:
            break
        tasks.append(t)
    if not tasks:
        raise AgentrlError(f"environment {env.name!r} has no tasks to evaluate")
    done = {key for key, rec in read_results(out).items() if rec["error"] is None} if resume else set()
    todo = {i: [r for r in range(rollouts) if (i, r) not in done] for i in range(len(tasks))}
    todo = {i: rs for i, rs in todo.items() if rs}
    if on_episode is not None and done:
        on_episode(sum(1 for i in range(len(tasks)) for r in range(rollouts) if (i, r) in done))

    gate = asyncio.Semaphore(concurrency)
    write_lock = asyncio.Lock()
    fh = (out / RESULTS).open("a", encoding="utf-8")

    async def one(task: Task) -> Trajectory:
        async with gate:
            return await env.rollout(client, task, sampling, max_turns=max_turns, token_exact=token_exact)

    async def group(i: int, slots: list[int]) -> None:
        trajs = list(await asyncio.gather(*(one(tasks[i]) for _ in slots)))
        live = [t for t in trajs if t.error is None]
        if live:
            try:
                await env.rubric.score_group(live)
            except Exception as e:  # a rubric crash is this group's error, not the eval's
                for t in live:
                    t.error, t.stop_reason = f"rubric: {type(e).__name__}: {e}"[:500], "error"
        async with write_lock:
            for r, t in zip(slots, trajs, strict=True):
                fh.write(json.dumps(episode_record(t, i, r, model), default=str) + "\n")
            fh.flush()
        if on_episode is not None:
            on_episode(len(slots))

    try:
        await asyncio.gather(*(group(i, rs) for i, rs in todo.items()))
    finally:
        fh.close()
    latest = read_results(out)
    records = [latest[(i, r)] for i in range(len(tasks)) for r in range(rollouts) if (i, r) in latest]
    summary = summarize(records, env.name, model, rollouts, pass_threshold)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def summary_table(summary: EvalSummary):
    """A rich table of the headline numbers."""
    from rich.table import Table

    table = Table(title=f"{summary.env} · {summary.model}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("episodes", f"{summary.episodes} ({summary.tasks} tasks × {summary.rollouts})")
    table.add_row("mean reward", f"{summary.mean_reward:.4f}")
    for k, v in summary.pass_at.items():
        table.add_row(f"pass@{k}", f"{v:.4f}")
    table.add_row("error rate", f"{summary.error_rate:.4f}")
    table.add_row("mean turns", f"{summary.mean_turns:.2f}")
    table.add_row("stop reasons", ", ".join(f"{k}={v}" for k, v in sorted(summary.stop_reasons.items())))
    for k, v in summary.metrics.items():
        table.add_row(f"metrics/{k}", f"{v:.4f}")
    return table


def run_eval_command(
    env_name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str,
    num_tasks: int,
    rollouts: int,
    concurrency: int,
    out_dir: str,
    resume: bool,
    env_args: dict[str, Any],
    sampling: SamplingParams,
    max_turns: int | None,
    chat: bool,
    pass_threshold: float,
) -> EvalSummary:
    """What ``agentrl eval`` does: load env, pick/start the endpoint, run with a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentrl.inference.client import PolicyClient
    from agentrl.plugins import load_environment

    env = load_environment(env_name, **env_args)
    console = Console(stderr=True)
    handle = None
    served = model
    if base_url is None:
        if not (Path(model) / "config.json").is_file():
            raise AgentrlError(f"--model {model!r} is not a local model dir; pass --base-url for a remote endpoint")
        from agentrl.inference.launcher import start_embedded_engine

        console.print(f"starting the embedded engine for {model} ...")
        handle = start_embedded_engine(model)
        base_url, served = handle.base_url, handle.model
    try:

        async def go() -> EvalSummary:
            client = PolicyClient(base_url, served, api_key=api_key)
            total = num_tasks * rollouts
            with Progress(
                TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
            ) as progress:
                bar = progress.add_task("episodes", total=total)
                try:
                    return await evaluate(
                        env,
                        client,
                        model=model,
                        out_dir=out_dir,
                        num_tasks=num_tasks,
                        rollouts=rollouts,
                        concurrency=concurrency,
                        sampling=sampling,
                        max_turns=max_turns,
                        resume=resume,
                        token_exact=not chat,
                        pass_threshold=pass_threshold,
                        env_args=env_args,
                        on_episode=lambda k: progress.advance(bar, k),
                    )
                finally:
                    await client.close()

        summary = asyncio.run(go())
    finally:
        if handle is not None:
            handle.stop()
    Console(width=None if sys.stdout.isatty() else 200).print(summary_table(summary))
    return summary


__all__ = ["EvalSummary", "evaluate", "pass_at_k", "read_results", "run_eval_command", "summarize", "summary_table"]
