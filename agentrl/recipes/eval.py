"""`agentrl eval`: run an environment against any model and keep every episode, in phases.

    1. env        load_environment(name, **env_args); its held-out tasks (else its dataset)
    2. results    OUT/meta.json must match a previous run to --resume it (:func:`check_resume`)
    3. policy     a local model dir starts the embedded engine, else --base-url; prompts are
                  rendered locally with --tokenizer (default: the model dir), /tokenize only
                  without one; the tool-call parser is --tool-parser, else detected from the
                  chat template; one probe checks the model name and the routes the chosen
                  path needs (on --chat: which fields the endpoint accepts, whether token ids
                  and logprobs come back; eval needs neither)
    4. episodes   ``rollouts`` episodes per task, each (task, rollout) with its own seed
                  derived from --seed; one JSON line per episode in OUT/results.jsonl,
                  appended and flushed as each episode finishes (an interrupt keeps them); a
                  rubric with group-level functions scores a task's rollouts together, as
                  training does, and they are written when their group finishes
    5. summary    mean reward, pass@k, error rate and an error table (kind, count, first
                  message) in OUT/summary.json; the exit status says whether the eval worked

An episode the policy failed (kinds ``timeout``, ``context_length``, ``program``: README
"Fates, error kinds and exit codes") is a measurement: reward 0 in the mean and in pass@k,
counted under ``policy_failures``, kept by --resume.  One the infrastructure failed (endpoint,
env, tool, sandbox, rubric, parse) measured nothing: it is left out of the mean and pass@k,
counts in the error rate, and --resume reruns it (rerunning the policy's failures until they
pass would flatter the model).

``resume=True`` keeps finished episodes and reruns only the missing or infrastructure-errored
ones; a torn last line (a write cut short) is cut first.  It refuses other settings (env, its
args and version, model, sampling, --max-turns, --chat) and fewer tasks or rollouts; more of
either extends the run (each slot's seed depends only on --seed, task and rollout).
--pass-threshold may change: it only re-counts.  The summary is computed from the latest line
of every (task, rollout) slot; a slot without one is counted as missing.  pass@k
uses the unbiased estimator 1 − C(n−c, k)/C(n, k) over the n rollouts of a task (c of them
with reward ≥ ``pass_threshold``), averaged over tasks.

Exit status (:func:`exit_status`): 0 when the error rate is at most ``max_error_rate`` and no
slot is missing, 1 above it or with missing slots, 3 when every episode errored; user errors
(bad arguments, other settings on --resume, unreachable or wrong endpoint) exit 2 before any
episode runs.
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

from agentrl.buffer import POLICY_ERRORS
from agentrl.errors import AgentrlError
from agentrl.rollout import gather_all, run_episode_of, run_group
from agentrl.rubrics import score_episodes
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
    error_rate: float  # episodes the infrastructure failed (measured nothing), of all
    policy_failures: dict[str, int] = field(default_factory=dict)  # kind -> episodes the policy failed (reward 0)
    missing: int = 0  # slots (tasks × rollouts) without a record: --resume runs them
    pass_threshold: float = 1.0
    pass_at: dict[int, float] = field(default_factory=dict)
    stop_reasons: dict[str, int] = field(default_factory=dict)
    mean_turns: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)  # [{kind, count, message}], most frequent first

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "pass_at": {str(k): v for k, v in self.pass_at.items()}}


def read_results(out_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Latest record per (task_index, rollout); a line that does not parse is ignored."""
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


def unmeasured(record: dict[str, Any]) -> bool:
    """An episode the infrastructure failed: it says nothing about the model (module docstring)."""
    return record.get("error") is not None and record.get("error_kind") not in POLICY_ERRORS


def error_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Episodes the infrastructure failed, by kind: count and the first message of each, most frequent first."""
    table: dict[str, dict[str, Any]] = {}
    for r in records:
        if unmeasured(r):
            kind = r.get("error_kind") or "env"
            row = table.setdefault(kind, {"kind": kind, "count": 0, "message": r["error"]})
            row["count"] += 1
    return sorted(table.values(), key=lambda row: -row["count"])


def cut_torn_tail(path: Path) -> int:
    """A last line without its newline (a write cut short: kill -9, a full disk) is cut, so the
    next record starts a line of its own; one that parses keeps its record.  Returns the bytes cut."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, 2)
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = size
        while keep > 0:  # back to the last newline, a block at a time (the file may be large)
            start = max(0, keep - 65536)
            f.seek(start)
            i = f.read(keep - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            keep = start
        f.seek(keep)
        try:
            json.loads(f.read())["task_index"]
            f.write(b"\n")
            return 0
        except (ValueError, KeyError, TypeError):
            f.truncate(keep)
            return size - keep


def summarize(records: list[dict[str, Any]], env: str, model: str, rollouts: int, pass_threshold: float,
              num_tasks: int | None = None) -> EvalSummary:
    """The headline numbers of ``records``; with ``num_tasks``, slots without a record count as missing."""
    by_task: dict[int, list[dict[str, Any]]] = {}
    scored = [r for r in records if not unmeasured(r)]  # the policy's own failures score 0 among them
    for r in scored:
        by_task.setdefault(r["task_index"], []).append(r)
    n_ep = len(records)
    failures: dict[str, int] = {}
    for r in records:
        if r.get("error") is not None and not unmeasured(r):
            failures[r["error_kind"]] = failures.get(r["error_kind"], 0) + 1
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
        env=env, model=model, tasks=len({r["task_index"] for r in records}) if num_tasks is None else num_tasks,
        rollouts=rollouts, episodes=n_ep,
        mean_reward=sum(r["reward"] if r["error"] is None else 0.0 for r in scored) / len(scored) if scored else 0.0,
        error_rate=(n_ep - len(scored)) / n_ep if n_ep else 0.0, policy_failures=failures,
        missing=0 if num_tasks is None else max(0, num_tasks * rollouts - n_ep), pass_threshold=pass_threshold,
        pass_at=pass_at, stop_reasons=stops,
        mean_turns=sum(r["turns"] for r in records) / n_ep if n_ep else 0.0,
        metrics={k: sum(v) / len(v) for k, v in sorted(metric_sums.items())},
        errors=error_table(records),
    )  # fmt: skip


def exit_status(summary: EvalSummary, max_error_rate: float) -> int:
    """0: the eval worked; 1: more than ``max_error_rate`` of the episodes errored, or slots are
    missing; 3: all episodes errored."""
    if summary.episodes and summary.error_rate >= 1.0:
        return 3
    return 1 if summary.error_rate > max_error_rate or summary.missing else 0


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


def eval_meta(env: Any, *, model: str, env_args: dict[str, Any] | None, sampling: SamplingParams, max_turns: int | None,
              chat: bool, num_tasks: int, rollouts: int, pass_threshold: float) -> dict[str, Any]:
    """OUT/meta.json: how the episodes were sampled (the seed included), what a rerun needs to
    reproduce them, and the slots and threshold the summary (and `agentrl view`) counts with."""
    meta = {"env": env.name, "env_version": env.version, "env_args": env_args or {}, "model": model,
            "sampling": dataclasses.asdict(sampling), "max_turns": max_turns, "chat": chat,
            "num_tasks": num_tasks, "rollouts": rollouts, "pass_threshold": pass_threshold}
    return json.loads(json.dumps(meta, default=str))  # as it reads back from the file


# the flag that sets each setting a resumed run must share (a sampling field without one keeps its name)
_FLAGS = {"env": "ENV", "env_version": "the environment's version", "env_args": "--env-args", "model": "--model",
          "max_turns": "--max-turns", "chat": "--chat", "sampling.max_tokens": "--max-tokens",
          "sampling.temperature": "--temperature", "sampling.seed": "--seed"}


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, dict | list) else str(value)


def check_resume(out_dir: str | Path, meta: dict[str, Any], resume: bool) -> None:
    """--resume continues only the same run: every setting in :func:`eval_meta` but the
    threshold must match OUT/meta.json (a key an older meta.json lacks is not compared), and
    -n/-r may grow but not shrink.  One line naming each differing flag, both values; exit 2."""
    check_out_dir(out_dir, resume)
    path = Path(out_dir) / META
    if not path.exists():
        return
    old = json.loads(path.read_text())

    def flat(m: dict[str, Any]) -> dict[str, Any]:
        return {**{k: v for k, v in m.items() if k != "sampling"},
                **{f"sampling.{k}": v for k, v in (m.get("sampling") or {}).items()}}

    was, now = flat(old), flat(meta)
    diffs = [f"{_FLAGS.get(k, k)} {_shown(was[k])} (now {_shown(now[k])})"
             for k in now if k in was and k not in ("num_tasks", "rollouts", "pass_threshold") and was[k] != now[k]]
    for key, flag, what in (("num_tasks", "--num-tasks", "tasks"), ("rollouts", "--rollouts", "rollouts")):
        if key in was and now[key] < was[key]:  # dropping slots would leave their episodes out of the summary
            diffs.append(f"{flag} {was[key]} (now {now[key]}; a resume may add {what}, not drop them)")
    if diffs:
        raise AgentrlError(f"--resume: {out_dir} holds a run with other settings: {', '.join(diffs)}; pass the same "
                           "values to continue it, or choose another --out")


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
    note: Callable[[str], None] | None = None,
) -> EvalSummary:
    """Phases 2, 4 and 5: run ``rollouts`` episodes on each of the first ``num_tasks`` held-out
    tasks.  ``note`` gets the one-line news of the results file (a torn line cut, an interrupt)."""
    out = Path(out_dir)
    say = note or (lambda _: None)
    sampling = sampling or SamplingParams(max_tokens=256, temperature=0.0)
    meta = eval_meta(env, model=model, env_args=env_args, sampling=sampling, max_turns=max_turns,
                     chat=not token_exact, num_tasks=num_tasks, rollouts=rollouts, pass_threshold=pass_threshold)
    check_resume(out, meta, resume)
    tasks = held_out_tasks(env, num_tasks)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).write_text(json.dumps({**meta, "num_tasks": len(tasks)}, indent=2))  # the slots the summary counts
    if cut := cut_torn_tail(out / RESULTS):  # else the next record would be appended onto the fragment
        say(f"{out / RESULTS}: cut a torn last line ({cut} bytes of a record cut short); its episode runs again")
    all_slots = [(i, r) for i in range(len(tasks)) for r in range(rollouts)]
    done = {key for key, rec in read_results(out).items() if not unmeasured(rec)} if resume else set()
    todo = [key for key in all_slots if key not in done]
    if on_episode is not None and done:
        on_episode(len(all_slots) - len(todo))

    gate = asyncio.Semaphore(max(1, concurrency))
    write_lock = asyncio.Lock()
    fh = (out / RESULTS).open("a", encoding="utf-8")

    def seeded(i: int, r: int) -> SamplingParams:
        return dataclasses.replace(sampling, seed=episode_seed(sampling.seed, i, r))

    async def keep(i: int, r: int, traj: Trajectory) -> None:
        async with write_lock:
            fh.write(json.dumps(episode_record(traj, i, r, model), default=str) + "\n")
            fh.flush()
        if on_episode is not None:
            on_episode(1)

    async def slot(i: int, r: int) -> None:
        async with gate:
            (traj,) = await run_group(env, client, tasks[i], seeded(i, r), 1, max_turns=max_turns,
                                      token_exact=token_exact)
        await keep(i, r, traj)  # each episode is kept as it finishes: an interrupt loses only those in flight

    async def group(i: int, rs: list[int]) -> None:
        """A task's rollouts scored together, as training scores a group: the rubric has group-level
        functions (``completions``...), which scored alone would each see a group of one."""
        pin = client.pin(len(rs)) if hasattr(client, "pin") else None

        async def one(r: int) -> Trajectory:
            async with gate:
                return await run_episode_of(env, pin or client, tasks[i], seeded(i, r), timeout_s=None,
                                            max_turns=max_turns, token_exact=token_exact)

        try:
            trajs = await gather_all(*(one(r) for r in rs))
        finally:
            if pin is not None:
                pin.release()
        await score_episodes(env.rubric, trajs)
        for r, traj in zip(rs, trajs, strict=True):
            await keep(i, r, traj)

    by_task: dict[int, list[int]] = {}
    for i, r in todo:
        by_task.setdefault(i, []).append(r)
    grouped = any(getattr(f, "group_level", False) for f in getattr(env.rubric, "funcs", ()))
    try:
        # no episode outlives a cancelled eval (Ctrl-C): the env and client close right after
        await gather_all(*(group(i, rs) for i, rs in by_task.items()) if grouped else
                         (slot(i, r) for i, r in todo))
    except asyncio.CancelledError:  # Ctrl-C: every finished episode is already on disk (flushed)
        kept = {key for key, rec in read_results(out).items() if not unmeasured(rec)} & set(all_slots)
        say(f"interrupted: {len(kept)} of {len(all_slots)} episodes finished and are saved in {out / RESULTS}; "
            f"the same command with --resume runs the other {len(all_slots) - len(kept)}")
        raise
    finally:
        fh.close()
    latest = read_results(out)
    records = [latest[key] for key in all_slots if key in latest]
    summary = summarize(records, env.name, model, rollouts, pass_threshold, num_tasks=len(tasks))
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


def summarize_dir(out_dir: Path) -> EvalSummary:
    """An eval directory's summary as the eval counted it (`agentrl view`): its slots and
    --pass-threshold from meta.json; one from before meta.json kept them counts every record,
    rollouts from the records, threshold 1.0."""
    meta = json.loads((out_dir / META).read_text()) if (out_dir / META).is_file() else {}
    latest = read_results(out_dir)
    env, model, threshold = meta.get("env", "?"), meta.get("model", "?"), float(meta.get("pass_threshold", 1.0))
    if "num_tasks" in meta and "rollouts" in meta:
        n, k = int(meta["num_tasks"]), int(meta["rollouts"])
        records = [latest[(i, r)] for i in range(n) for r in range(k) if (i, r) in latest]
        return summarize(records, env, model, k, threshold, num_tasks=n)
    records = list(latest.values())
    return summarize(records, env, model, max((r["rollout"] + 1 for r in records), default=1), threshold)


def summary_table(summary: EvalSummary):
    """A rich table of the headline numbers, and the error table when episodes errored."""
    from rich.table import Table

    table = Table(title=f"{summary.env} · {summary.model}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    of = f" of {summary.episodes + summary.missing}" if summary.missing else ""
    missing = f"; {summary.missing} missing" if summary.missing else ""
    table.add_row("episodes", f"{summary.episodes}{of} ({summary.tasks} tasks × {summary.rollouts}){missing}")
    table.add_row("mean reward", f"{summary.mean_reward:.4f}")
    for k, v in summary.pass_at.items():
        table.add_row(f"pass@{k}", f"{v:.4f}")
    if summary.policy_failures:  # measured: reward 0, in the mean and pass@k
        table.add_row("policy failures", ", ".join(f"{k}={v}" for k, v in sorted(summary.policy_failures.items())))
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
    if not math.isfinite(pass_threshold):  # nan passes no reward: every pass@k would read 0
        raise AgentrlError(f"--pass-threshold must be a finite number, got {pass_threshold}")
    # 1) env
    if tool_parser not in (None, "auto"):
        get_parser(tool_parser)  # a misspelt name fails before anything starts
    env = load_environment(env_name, **env_args)
    # 2) other settings than the run in --out: refused before an engine starts
    check_resume(out_dir, eval_meta(env, model=model, env_args=env_args, sampling=sampling, max_turns=max_turns,
                                    chat=chat, num_tasks=num_tasks, rollouts=rollouts, pass_threshold=pass_threshold),
                 resume)
    console = Console(stderr=True)
    if (have := len(held_out_tasks(env, num_tasks))) < num_tasks:
        console.print(f"note: {env.name} has {have} held-out tasks; -n {num_tasks} evaluates those {have}", highlight=False)
        num_tasks = have  # the progress bar's total and meta.json count the tasks that exist
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
                    note=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
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
    if summary.missing:
        console.print(f"error: {summary.missing} of {summary.episodes + summary.missing} episodes are missing from "
                      f"{Path(out_dir) / RESULTS}; the same command with --resume runs them", highlight=False)
    if status == 3 or summary.error_rate > max_error_rate:
        top = summary.errors[0] if summary.errors else {"kind": "?", "message": ""}
        console.print(
            f"error: {summary.error_rate:.0%} of episodes errored (max {max_error_rate:.0%}); most: "
            f"{top['kind']} — {top['message'][:200]}", highlight=False,
        )
    return status


__all__ = ["EvalSummary", "check_resume", "cut_torn_tail", "eval_meta", "evaluate", "exit_status", "pass_at_k",
           "read_results", "run", "summarize", "summarize_dir", "summary_table", "unmeasured"]
