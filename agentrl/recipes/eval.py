"""`agentrl eval`: run an environment against any model and keep every episode, in phases.

    1. env        load_environment(name, **env_args); its held-out tasks (else its dataset)
    2. results    OUT/meta.json must match a previous run (env, args, model) to --resume it
    3. policy     a local model dir starts the embedded engine, else --base-url; prompts are
                  rendered locally with --tokenizer (default: the model dir), /tokenize only
                  without one; the tool-call parser is --tool-parser, else detected from the
                  chat template; one probe checks the model name and the routes the chosen
                  path needs (on --chat: which fields the endpoint accepts, whether token ids
                  and logprobs come back; eval needs neither)
    4. episodes   ``rollouts`` episodes per task, each (task, rollout) with its own seed
                  derived from --seed; one JSON line per episode in OUT/results.jsonl,
                  appended and flushed as each task's group finishes
    5. summary    mean reward, pass@k, error rate and an error table (kind, count, first
                  message) in OUT/summary.json; the exit status says whether the eval worked

``resume=True`` keeps finished, non-errored episodes and reruns only the missing or errored
ones.  The summary is computed from the latest line of every (task, rollout) slot.  pass@k
uses the unbiased estimator 1 − C(n−c, k)/C(n, k) over the n rollouts of a task (c of them
with reward ≥ ``pass_threshold``), averaged over tasks; errored episodes count as failures.

Exit status (:func:`exit_status`): 0 when the error rate is at most ``max_error_rate``, 1
above it, 3 when every episode errored; user errors (bad arguments, unreachable or wrong
endpoint) exit 2 before any episode runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.rollout import gather_all, run_group
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
        "completion_tokens": sum(len(t.completion_ids) or t.completion_tokens for t in traj.turns),
        # what the endpoint processed over all turns (a hosted API bills this)
        "usage": {"prompt_tokens": sum(t.prompt_len for t in traj.turns),
                  "completion_tokens": sum(len(t.completion_ids) or t.completion_tokens for t in traj.turns)},
        "turns": len(traj.turns),
        "reward": traj.reward,
        "metrics": traj.metrics,
        "stop_reason": traj.stop_reason,
        "error": traj.error,
        "error_kind": traj.error_kind,
        "timing": traj.timing,
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def episode_seed(seed: int | None, task_index: int, rollout: int) -> int | None:
    """A per-(task, rollout) sampling seed: rollouts differ, and a rerun reproduces them."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{task_index}:{rollout}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


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
    errors: list[dict[str, Any]] = field(default_factory=list)  # [{kind, count, message}], most frequent first

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


def error_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Errored episodes by kind: count and the first message of each, most frequent first."""
    table: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("error") is not None:
            kind = r.get("error_kind") or "env"
            row = table.setdefault(kind, {"kind": kind, "count": 0, "message": r["error"]})
            row["count"] += 1
    return sorted(table.values(), key=lambda row: -row["count"])


def summarize(records: list[dict[str, Any]], env: str, model: str, rollouts: int, pass_threshold: float) -> EvalSummary:
    by_task: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_task.setdefault(r["task_index"], []).append(r)
    n_ep = len(records)
    pass_at = {}
    for k in (k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= rollouts):
        vals = [
            pass_at_k(len(rs), sum(1 for r in rs if r["error"] is None and r["reward"] >= pass_threshold), k)
            for rs in by_task.values()
            if len(rs) >= k
        ]
        if vals:
            pass_at[k] = sum(vals) / len(vals)
    stops: dict[str, int] = {}
    metric_sums: dict[str, list[float]] = {}
    for r in records:
        stops[str(r["stop_reason"])] = stops.get(str(r["stop_reason"]), 0) + 1
        if r["error"] is None:
            for k, v in (r.get("metrics") or {}).items():
                if isinstance(v, int | float):
                    metric_sums.setdefault(k, []).append(float(v))
    return EvalSummary(
        env=env, model=model, tasks=len(by_task), rollouts=rollouts, episodes=n_ep,
        mean_reward=sum(r["reward"] for r in records) / n_ep if n_ep else 0.0,
        error_rate=sum(1 for r in records if r["error"] is not None) / n_ep if n_ep else 0.0,
        pass_at=pass_at, stop_reasons=stops,
        mean_turns=sum(r["turns"] for r in records) / n_ep if n_ep else 0.0,
        metrics={k: sum(v) / len(v) for k, v in sorted(metric_sums.items())},
        errors=error_table(records),
    )  # fmt: skip


def exit_status(summary: EvalSummary, max_error_rate: float) -> int:
    """0: the eval worked; 1: more than ``max_error_rate`` of the episodes errored; 3: all did."""
    if summary.episodes and summary.error_rate >= 1.0:
        return 3
    return 1 if summary.error_rate > max_error_rate else 0


def check_out_dir(out_dir: str | Path, resume: bool) -> None:
    """--out can take results: not a file (nor under one), and not a finished eval's directory without
    --resume.  Runs before the env loads or an engine starts; one line."""
    from agentrl.recipes.rl import file_in_the_way

    out = Path(out_dir)
    if (blocker := file_in_the_way(out)) is not None:
        where = f"--out {out}" if blocker == out else f"--out {out}: {blocker}"
        raise AgentrlError(f"{where} is a file, not a directory; choose another --out")
    if not resume and (out / RESULTS).exists():
        raise AgentrlError(f"{out} already holds results; pass --resume to continue them or choose another --out")


def _check_meta(out_dir: Path, meta: dict[str, Any], resume: bool) -> None:
    check_out_dir(out_dir, resume)
    path = out_dir / META
    if path.exists():
        old = json.loads(path.read_text())
        for key in ("env", "env_args", "model"):
            if old.get(key) != meta.get(key):
                raise AgentrlError(
                    f"{out_dir} holds results for {key}={old.get(key)!r}, not {meta.get(key)!r}; use another --out"
                )
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2, default=str))


def held_out_tasks(env: Any, num_tasks: int) -> list[Task]:
    held = env.eval_dataset()
    tasks: list[Task] = []
    for t in held if held is not None else env.dataset():
        if len(tasks) >= num_tasks:
            break
        tasks.append(t)
    if not tasks:
        raise AgentrlError(f"environment {env.name!r} has no tasks to evaluate")
    return tasks


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
    """Phases 2, 4 and 5: run ``rollouts`` episodes on each of the first ``num_tasks`` held-out tasks."""
    out = Path(out_dir)
    sampling = sampling or SamplingParams(max_tokens=256, temperature=0.0)
    # how the episodes were sampled (the seed included): what a rerun needs to reproduce them
    meta = {"env": env.name, "env_version": env.version, "env_args": env_args or {}, "model": model,
            "sampling": dataclasses.asdict(sampling), "max_turns": max_turns}
    _check_meta(out, meta, resume)
    tasks = held_out_tasks(env, num_tasks)
    done = {key for key, rec in read_results(out).items() if rec["error"] is None} if resume else set()
    todo = {i: [r for r in range(rollouts) if (i, r) not in done] for i in range(len(tasks))}
    todo = {i: rs for i, rs in todo.items() if rs}
    if on_episode is not None and done:
        on_episode(sum(1 for i in range(len(tasks)) for r in range(rollouts) if (i, r) in done))

    gate = asyncio.Semaphore(max(1, concurrency))
    write_lock = asyncio.Lock()
    fh = (out / RESULTS).open("a", encoding="utf-8")

    async def slot(i: int, r: int) -> Trajectory:
        async with gate:
            seeded = dataclasses.replace(sampling, seed=episode_seed(sampling.seed, i, r))
            (traj,) = await run_group(env, client, tasks[i], seeded, 1, max_turns=max_turns, token_exact=token_exact)
            return traj

    async def group(i: int, slots: list[int]) -> None:
        trajs = await gather_all(*(slot(i, r) for r in slots))
        async with write_lock:
            for r, t in zip(slots, trajs, strict=True):
                fh.write(json.dumps(episode_record(t, i, r, model), default=str) + "\n")
            fh.flush()
        if on_episode is not None:
            on_episode(len(slots))

    try:
        # no episode outlives a cancelled eval (Ctrl-C): the env and client close right after
        await gather_all(*(group(i, rs) for i, rs in todo.items()))
    finally:
        fh.close()
    latest = read_results(out)
    records = [latest[(i, r)] for i in range(len(tasks)) for r in range(rollouts) if (i, r) in latest]
    summary = summarize(records, env.name, model, rollouts, pass_threshold)
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def summary_table(summary: EvalSummary):
    """A rich table of the headline numbers, and the error table when episodes errored."""
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
    if not summary.errors:
        return table
    errors = Table(title="errored episodes", show_header=True)
    for col in ("kind", "count", "first message"):
        errors.add_column(col)
    for row in summary.errors:
        errors.add_row(row["kind"], str(row["count"]), row["message"][:200])
    from rich.console import Group

    return Group(table, errors)


def run(
    env_name: str,
    *,
    model: str,
    base_url: str | None,
    api_key: str | None,
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
    tokenizer: str | None = None,
    max_error_rate: float = 0.5,
    tool_parser: str | None = None,
) -> int:
    """What ``agentrl eval`` does; returns the exit status (:func:`exit_status`)."""
    from rich.console import Console

    from agentrl.inference import PolicyClient, open_policy
    from agentrl.inference.client import load_tokenizer
    from agentrl.inference.launcher import is_model_dir
    from agentrl.metrics import progress_bar
    from agentrl.plugins import load_environment
    from agentrl.tool_format import get_parser

    check_out_dir(out_dir, resume)  # 2) before anything starts: a bad --out would be found only after the engine
    # 1) env
    if tool_parser not in (None, "auto"):
        get_parser(tool_parser)  # a misspelt name fails before anything starts
    env = load_environment(env_name, **env_args)
    console = Console(stderr=True)
    # 3) policy: prompts are rendered locally with --tokenizer (default: the model dir), /tokenize
    # only without one; the chat path needs neither
    local_tok = load_tokenizer(tokenizer) if tokenizer is not None and not chat else None
    if base_url is None and is_model_dir(model):
        console.print(f"starting the embedded engine for {model} ...")
    policy = open_policy(model, base_url, tool_parser=tool_parser, tokenizer_dir=tokenizer)
    if local_tok is None and not chat and tokenizer is None and policy.tokenizer_dir is not None:
        local_tok = str(policy.tokenizer_dir)

    async def go() -> EvalSummary:
        # engines started here have their own key; --api-key (else AGENTRL_API_KEY) is for --base-url
        key = policy.api_key if policy.started else api_key
        client = PolicyClient(policy.base_urls, policy.model, api_key=key, tokenizer=local_tok,
                              tool_parser=policy.tool_parser)
        total = num_tasks * rollouts
        try:
            await client.probe(token_path=not chat)
            for line in client.capabilities():
                console.print(f"chat endpoint {line}", highlight=False, soft_wrap=True)
            with progress_bar(console) as progress:  # bar with ETA on a terminal, quiet otherwise
                bar = progress.add_task("eval", total=total)
                # 2, 4, 5) results, episodes, summary
                return await evaluate(
                    env, client, model=model, out_dir=out_dir, num_tasks=num_tasks, rollouts=rollouts,
                    concurrency=concurrency, sampling=sampling, max_turns=max_turns, resume=resume,
                    token_exact=not chat, pass_threshold=pass_threshold, env_args=env_args,
                    on_episode=lambda k: progress.advance(bar, k),
                )
        finally:
            await env.close()
            await client.close()

    try:
        summary = asyncio.run(go())
    finally:
        policy.stop()
    Console(width=None if sys.stdout.isatty() else 200).print(summary_table(summary))
    status = exit_status(summary, max_error_rate)
    if status:
        top = summary.errors[0] if summary.errors else {"kind": "?", "message": ""}
        console.print(
            f"error: {summary.error_rate:.0%} of episodes errored (max {max_error_rate:.0%}); most: "
            f"{top['kind']} — {top['message'][:200]}", highlight=False,
        )
    return status


__all__ = ["EvalSummary", "evaluate", "exit_status", "pass_at_k", "read_results", "run", "summarize", "summary_table"]
