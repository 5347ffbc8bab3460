"""Metrics: one namespaced schema, one logger protocol, the live status line.

:data:`SCHEMA` names every metric a run writes (``rollout/…``, ``train/…``, ``buffer/…``,
``weights/…``, ``eval/…``, ``ledger/…``, ``time/…``) with one line saying what it is; the
writer refuses names outside it, and the live status line and ``agentrl view`` read the same
names.  ``MetricsLogger.log(row)`` appends one JSON object per call; :class:`NullLogger`
drops rows (tests, benchmarks).  Sinks behind the same protocol: :class:`TensorBoardLogger`
(TensorBoard's ``SummaryWriter``) and :class:`WandbLogger` (``wandb``, offline by default);
:func:`open_metrics_logger` builds JSONL plus the sinks ``[metrics]`` asks for.  :class:`LiveProgress` shows a run on one rich status line
(stderr), and falls back to a plain line per step when stderr is not a terminal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.types import json_default

if TYPE_CHECKING:
    from agentrl.config import MetricsConfig

SCHEMA: dict[str, str] = {
    "step": "optimizer step just applied (0-based)",
    "version": "trainer weight version after the step (= step + 1)",
    # rollout: everything sampled since the previous step
    "rollout/reward_mean": "mean reward of the episodes finished since the last step (errored ones excluded)",
    "rollout/episodes": "episodes finished since the last step",
    "rollout/tokens_per_s": "sampled tokens per second since the last step",
    "rollout/in_flight": "episodes running now",
    "rollout/groups_cancelled_stale": "running groups cancelled because a token became too stale (cumulative)",
    "rollout/worker_restarts": "rollout worker actors restarted after dying (cluster.rollout_workers; cumulative)",
    # train: the optimizer step
    "train/reward_mean": "mean reward of the trained batch (after filtering)",
    "train/reward_std": "reward standard deviation of the trained batch",
    "train/loss": "policy loss of the step",
    "train/grad_norm": "global gradient norm before clipping",
    "train/entropy": "mean per-token entropy of π_θ over the sampling support",
    "train/lr": "learning rate used by the step",
    "train/mismatch_kl": "mean k3 KL(μ‖π_θ) per loss token (0 at identical weights)",
    "train/masked_frac": "share of loss tokens outside the trust band",
    "train/clip_frac": "share of loss tokens clipped or masked by the loss",
    "train/ess": "normalised effective sample size of the ratios π_θ/μ, in (0, 1]",
    "train/tokens": "loss tokens in the step",
    "train/seconds": "wall seconds of the forward/backward/optimizer step",
    "train/idle_frac": "share of the step's wall time the trainer waited for data",
    "train/skipped_steps": "optimizer steps skipped whole: every update non-finite (cumulative)",
    "train/updates": "optimizer updates the step applied (trainer.epochs × trainer.minibatches, minus skipped)",
    "train/skipped_updates": "updates of the step skipped for a non-finite gradient or loss (the others applied)",
    "train/skipped_episodes": "episodes the trainer left out (non-finite μ or advantage, or every update holding "
    "them skipped): fate skipped",
    "train/seq_rejected_frac": "share of loss tokens in trajectories dropped by trainer.loss.seq_rejection",
    "train/outside_frac": "share of loss tokens outside the trainer's own top-K support (π_θ = 0 there, r = 0)",
    # buffer: staleness of what was trained, and the bound
    "buffer/staleness_mean": "mean staleness (trainer version − token version) of the trained tokens",
    "buffer/staleness_max": "largest staleness among the trained tokens",
    "buffer/max_staleness": "η: the bound this step's batch obeyed",
    "buffer/max_staleness_next": "η in force for the next step (adaptive mode may move it)",
    "buffer/adaptive_reason": "why adaptive mode held, raised or lowered η",
    "buffer/ready": "scored groups waiting to be trained",
    # weights
    "weights/push_s": "seconds to push the new weights into every engine (0 when no push)",
    "weights/push_mb": "MiB moved by the last push",
    # held-out evaluation
    "eval/reward_mean": "greedy held-out reward (errored episodes count 0)",
    "eval/errored": "held-out episodes that errored",
    "eval/version": "weight version the held-out evaluation ran on",
    "eval/seconds": "wall seconds of the held-out evaluation",
    # the episode ledger (cumulative over the run)
    "ledger/started": "episodes started",
    "ledger/trained": "episodes trained",
    "ledger/stale": "episodes dropped because a token was more than η versions old",
    "ledger/filtered": "episodes of groups without a learning signal (equal rewards, too few valid)",
    "ledger/errored": "episodes that failed (see ledger/errored/<kind>)",
    "ledger/interrupted": "episodes in flight when an earlier process died (counted on --resume) or running at the end",
    "ledger/skipped": "episodes the trainer left out (non-finite μ, advantage or gradient)",
    "ledger/unused": "episodes that finished and could be trained, but the run ended first",
    "ledger/in_flight": "episodes running or waiting to be trained now (the counted live set)",
    "ledger/top_error": "the most frequent error of the step's errored episodes, with its kind",
    # time
    "time/wall_s": "seconds since the run started",
    "time/rl_wall_s": "seconds since the RL loop started (engine start-up and warm start excluded)",
}
# name families: one entry per error kind (agentrl.errors.ERROR_KINDS)
SCHEMA_PREFIXES = {
    "ledger/errored/": "episodes errored with this kind",
    "ledger/failed/": "episodes with this error kind (the policy's doing) kept in their group as failures",
    "engine/": "what the engine reports in /metrics",
    "rollout/groups/": "groups rollout worker wN delivered to the buffer actor (cumulative)",
    "eval/earlier/": "the held-out evaluation before eval/* when one row holds two (the final step's: the one that "
                     "finished during it, or the warm start's on a 1-step run)",
}


def known_metric(name: str) -> bool:
    return name in SCHEMA or any(name.startswith(p) for p in SCHEMA_PREFIXES)


class UnknownMetric(ValueError):
    """A metric name outside :data:`SCHEMA` (a bug: add it to the schema with its meaning)."""


class MetricsLogger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    def log(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v


class JSONLLogger:
    """Append-only JSONL; every row is flushed so a killed run keeps what it logged.

    ``schema=True`` (the metrics file) refuses names outside :data:`SCHEMA`.
    """

    def __init__(self, path: str | Path, *, schema: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, row: dict[str, Any]) -> None:
        if self.schema:
            unknown = [k for k in row if not known_metric(k)]
            if unknown:
                raise UnknownMetric(f"metrics {unknown} are not in agentrl.metrics.SCHEMA")
        # anything JSON cannot hold (a set in task.info, a custom object) is written as a list or its
        # repr: a log line never costs an episode
        line = json.dumps({k: _clean(v) for k, v in row.items()}, separators=(",", ":"), default=json_default)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a row (sinks plot numbers; strings stay in the JSONL)."""
    out = {}
    for k, v in row.items():
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def _missing_extra(package: str, extra: str) -> Exception:
    from agentrl.errors import AgentrlError

    return AgentrlError(f"{package} is not installed: pip install 'agentrl[{extra}]' (or turn metrics.{extra} off)")


class TensorBoardLogger:
    """Scalars into TensorBoard event files (``tensorboard --logdir RUN_DIR/tensorboard``).

    The x axis is the row's ``step``; names keep their namespace (``train/loss``), which
    TensorBoard shows as one section per prefix.
    """

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            raise _missing_extra("tensorboard", "tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def log(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for k, v in _numbers(row).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases run under ``RUN_DIR/wandb``; ``mode="offline"`` needs no network.

    The run id is derived from the run directory, so ``--resume`` continues the same W&B run.
    """

    def __init__(self, run_dir: str | Path, *, project: str, mode: str = "offline",
                 config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing_extra("wandb", "wandb") from None
        import hashlib

        run_dir = Path(run_dir).resolve()
        run_id = f"{run_dir.name[:40]}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, name=run_dir.name, id=run_id,
                              resume="allow", config=config or {}, settings=wandb.Settings(console="off"))

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_numbers(row), step=int(row.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


class TeeLogger:
    """One row to several loggers, in order (the JSONL first: it checks the names)."""

    def __init__(self, loggers: list[MetricsLogger]) -> None:
        self.loggers = loggers

    def log(self, row: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log(row)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def open_metrics_logger(run_dir: str | Path, mc: MetricsConfig | None = None,
                        config: dict[str, Any] | None = None) -> MetricsLogger:
    """RUN_DIR/metrics.jsonl (schema-checked), plus TensorBoard / W&B as ``[metrics]`` asks."""
    run_dir = Path(run_dir)
    loggers: list[MetricsLogger] = [JSONLLogger(run_dir / "metrics.jsonl", schema=True)]
    try:
        if mc is not None and mc.tensorboard:
            loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
        if mc is not None and mc.wandb:
            loggers.append(WandbLogger(run_dir, project=mc.wandb_project, mode=mc.wandb_mode, config=config))
    except BaseException:
        for lg in loggers:
            lg.close()
        raise
    return loggers[0] if len(loggers) == 1 else TeeLogger(loggers)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a torn last line (killed writer) is skipped."""
    rows = []
    p = Path(path)
    if not p.is_file():
        return rows
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class LiveProgress:
    """One status line: step/steps, reward, eval, tok/s, staleness, buffer depth."""

    def __init__(self, total_steps: int, enabled: bool = True, max_wall_s: float | None = None) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.total = total_steps
        self.max_wall_s = max_wall_s or None  # run.max_wall_s: the run stops there, whatever the steps
        self._live = None
        self._last_eval: float | None = None
        self._first_step: int | None = None  # the first step this process ran (a resumed run starts later)
        if enabled and self.console.is_terminal:
            from rich.live import Live

            self._live = Live("", console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def update(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if row.get("eval/reward_mean") is not None:
            self._last_eval = row["eval/reward_mean"]
        ev = f"{self._last_eval:.3f}" if self._last_eval is not None else "-"
        text = (
            f"step {row['step'] + 1}/{self.total} ({self.eta(row)} left)  reward {row.get('train/reward_mean', 0):.3f}  eval {ev}  "
            f"tok/s {row.get('rollout/tokens_per_s', 0):.0f}  stale {row.get('buffer/staleness_mean', 0):.2f}/"
            f"{row.get('buffer/staleness_max', 0)} (eta {row.get('buffer/max_staleness', 0)})  "
            f"buffer {row.get('buffer/ready', 0)}  in-flight {row.get('rollout/in_flight', 0)}  "
            f"idle {row.get('train/idle_frac', 0):.2f}  {row.get('time/wall_s', 0):.0f}s"
        )
        if row.get("ledger/top_error"):
            text += f"  errored {row.get('ledger/errored', 0)}: {row['ledger/top_error'][:80]}"
        if self._live is not None:
            self._live.update(text)
        else:
            self.console.print(text, highlight=False)

    def eta(self, row: dict[str, Any]) -> str:
        """Time left (ETA): at this process's mean step time so far (RL loop wall time / steps
        run), or to ``run.max_wall_s`` when that comes first."""
        if self._first_step is None:
            self._first_step = row["step"]
        done = row["step"] - self._first_step + 1
        left = self.total - row["step"] - 1
        wall = row.get("time/rl_wall_s")
        if not wall or done <= 0:
            return "-"
        by_steps = wall / done * max(left, 0)
        if self.max_wall_s is not None and left > 0:
            by_budget = max(self.max_wall_s - row.get("time/wall_s", 0.0), 0.0)
            if by_budget < by_steps:
                return f"{format_seconds(by_budget)} of run.max_wall_s"
        return format_seconds(by_steps)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class StepProgress:
    """``with StepProgress("sft", total) as p: p.step("loss 0.3")``: on a terminal a rich bar with
    ETA; otherwise a plain line every ``every`` steps (CI logs stay readable); nothing if disabled."""

    def __init__(self, label: str, total: int, enabled: bool = True, every: int = 20) -> None:
        from rich.console import Console

        self.label, self.total, self.enabled, self.every, self.done = label, total, enabled, every, 0
        self.console = Console(stderr=True)
        self.bar = progress_bar(self.console) if enabled and self.console.is_terminal else None
        self._t0 = 0.0

    def __enter__(self) -> StepProgress:
        import time

        self._t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.start()
            self._task = self.bar.add_task(self.label, total=self.total)
        return self

    def step(self, info: str = "") -> None:
        import time

        self.done += 1
        if self.bar is not None:
            self.bar.update(self._task, advance=1, description=f"{self.label} {info}".strip())
        elif self.enabled and (self.done % self.every == 1 or self.done == self.total):
            self.note(f"{self.label} {self.done}/{self.total} {info} ({time.perf_counter() - self._t0:.0f}s)")

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def busy(text: str) -> Any:
    """``with busy("building the tiny model"):`` a spinner with elapsed time on a terminal; quiet otherwise."""
    import contextlib

    from rich.console import Console

    console = Console(stderr=True)
    return console.status(text) if console.is_terminal else contextlib.nullcontext()


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_bar(console: Any = None) -> Any:
    """A rich progress line on stderr: what, bar, done/total, elapsed, ETA; quiet when not a terminal.

    ``with progress_bar() as p: t = p.add_task("sft", total=n); p.update(t, advance=1, description=...)``
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = console or Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, disable=not console.is_terminal)


# ----------------------------------------------------------------------------- run summary


def summarize_run(run_dir: str | Path, last_rollouts: int = 3) -> str:
    """Readable summary of a run directory (``agentrl view``)."""
    from agentrl.errors import AgentrlError

    run = Path(run_dir)
    rows = read_jsonl(run / "metrics.jsonl")
    if not (run / "config.toml").is_file() and not rows:
        raise AgentrlError(f"{run} is not a run directory (no config.toml or metrics.jsonl)")
    lines = [f"run {run}"]
    summary = _read_summary(run)  # written when a run finished
    if not rows:
        if summary is None:  # running, or stopped before it finished
            lines.append("  no training steps logged yet")
            return "\n".join(lines)
        lines.append(f"  {no_step_reason(summary)}")
    else:
        lines += _step_lines(run, rows, last_rollouts)
    if summary is not None:
        lines.append(f"  final model: {summary.get('final_model')}")
    return "\n".join(lines)


def _step_lines(run: Path, rows: list[dict[str, Any]], last_rollouts: int) -> list[str]:
    """What the steps of a run logged: the last one, the held-out curve, fates, the latest episodes."""
    lines = []
    last = rows[-1]
    lines.append(
        f"  steps {last['step'] + 1} (version {last['version']}), wall {last.get('time/wall_s', 0):.0f}s, "
        f"tokens/s {last.get('rollout/tokens_per_s', 0):.0f}, weight push {last.get('weights/push_s', 0) * 1000:.0f} ms"
    )
    evals = [(r[f"{p}version"], r[f"{p}reward_mean"]) for r in rows for p in ("eval/earlier/", "eval/")
             if r.get(f"{p}reward_mean") is not None]
    if evals:
        curve = "  ".join(f"v{v}:{x:.3f}" for v, x in evals)
        lines.append(f"  eval reward (held-out): {curve}")
        lines.append(f"  change from first eval: {evals[-1][1] - evals[0][1]:+.3f}")
    keys = ("train/reward_mean", "rollout/reward_mean", "buffer/staleness_mean", "train/mismatch_kl",
            "train/masked_frac", "train/ess", "train/entropy", "train/idle_frac")
    lines.append("  last step: " + ", ".join(f"{k} {last[k]:.3g}" for k in keys if last.get(k) is not None))
    ledger = {k[len("ledger/"):]: v for k, v in last.items() if k.startswith("ledger/") and k != "ledger/top_error"}
    lines.append("  episodes: " + ", ".join(f"{k} {v}" for k, v in ledger.items()))
    tail = read_jsonl(run / "rollouts.jsonl")[-last_rollouts:]
    for r in tail:
        msgs = " | ".join(
            f"{m['role']}: {(m.get('content') or '')[:60]}"
            + "".join(f" <call {c['function']['name']}({c['function']['arguments'][:40]})>" for c in m.get("tool_calls") or [])
            for m in r.get("messages", [])
        )
        lines.append(f"  rollout reward {r.get('reward')} {'ERROR ' + r['error'] if r.get('error') else ''}: {msgs}")
    return lines


def _read_summary(run: Path) -> dict[str, Any] | None:
    """summary.json, written when a run finished; None without one (or unreadable)."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


# why episodes reached a fate other than trained (README "Fates, error kinds and exit codes")
WHY_FATE = {"stale": "older than η", "filtered": "zero-variance groups, or too few valid episodes",
            "skipped": "non-finite μ, advantage or gradient", "unused": "finished as the run ended",
            "interrupted": "running as the run ended"}


def no_step_reason(summary: dict[str, Any]) -> str:
    """A finished run that took no training step, from summary.json's ledger: where its episodes went."""
    ledger = {k.removeprefix("ledger/"): v for k, v in (summary.get("ledger") or {}).items()}
    parts = [f"{ledger.get('trained', 0)} trained"]
    for fate in ("filtered", "errored", "stale", "skipped", "unused", "interrupted"):
        if not ledger.get(fate):
            continue
        if fate == "errored":
            kinds = ", ".join(f"{k.removeprefix('errored/')} {n}" for k, n in ledger.items() if k.startswith("errored/"))
            why = "; ".join(x for x in (kinds, summary.get("top_error") and f"most: {summary['top_error']}") if x)
        else:
            why = WHY_FATE[fate]
        parts.append(f"{ledger[fate]} {fate}" + (f" ({why})" if why else ""))
    return f"run ended with no training step: {', '.join(parts)}, of {ledger.get('started', 0)} started"
