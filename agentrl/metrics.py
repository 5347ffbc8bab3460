"""One small logger protocol (JSONL file or nothing) and the live progress line.

``MetricsLogger.log(row)`` appends one JSON object per call; :class:`NullLogger` drops
rows (tests, benchmarks).  :class:`LiveProgress` shows step, reward, eval reward,
tokens/s, staleness and buffer depth on one rich status line (stderr), and falls back
to a plain line per step when stderr is not a terminal.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


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
    """Append-only JSONL; every row is flushed so a killed run keeps what it logged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


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


def truncate_jsonl(path: str | Path, keep: Any) -> None:
    """Rewrite ``path`` keeping only rows for which ``keep(row)`` is true (used on resume)."""
    p = Path(path)
    if not p.is_file():
        return
    rows = [r for r in read_jsonl(p) if keep(r)]
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, p)


class LiveProgress:
    """One status line: step/steps, reward, eval, tok/s, staleness, buffer depth."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.total = total_steps
        self._live = None
        self._last_eval: float | None = None
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
        if row.get("eval_reward_mean") is not None:
            self._last_eval = row["eval_reward_mean"]
        ev = f"{self._last_eval:.3f}" if self._last_eval is not None else "-"
        text = (
            f"step {row['step'] + 1}/{self.total}  reward {row.get('reward_mean', 0):.3f}  eval {ev}  "
            f"tok/s {row.get('tokens_per_s', 0):.0f}  stale {row.get('staleness_mean', 0):.2f}/"
            f"{row.get('staleness_max', 0)} (eta {row.get('max_staleness', 0)})  "
            f"buffer {row.get('buffer_ready', 0)}  in-flight {row.get('rollouts_in_flight', 0)}  "
            f"idle {row.get('trainer_idle_frac', 0):.2f}  {row.get('wall_s', 0):.0f}s"
        )
        if self._live is not None:
            self._live.update(text)
        else:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


# ----------------------------------------------------------------------------- run summary


def summarize_run(run_dir: str | Path, last_rollouts: int = 3) -> str:
    """Readable summary of a run directory (``agentrl view``)."""
    from agentrl.errors import AgentrlError

    run = Path(run_dir)
    rows = read_jsonl(run / "metrics.jsonl")
    if not (run / "config.toml").is_file() and not rows:
        raise AgentrlError(f"{run} is not a run directory (no config.toml or metrics.jsonl)")
    lines = [f"run {run}"]
    if not rows:
        lines.append("  no training steps logged yet")
        return "\n".join(lines)
    last = rows[-1]
    lines.append(
        f"  steps {len(rows)} (version {last['version']}), wall {last.get('wall_s', 0):.0f}s, "
        f"tokens/s {last.get('tokens_per_s', 0):.0f}, weight push {last.get('weight_push_s', 0) * 1000:.0f} ms"
    )
    evals = [(r["eval_version"], r["eval_reward_mean"]) for r in rows if r.get("eval_reward_mean") is not None]
    if evals:
        curve = "  ".join(f"v{v}:{x:.3f}" for v, x in evals)
        lines.append(f"  eval reward (held-out): {curve}")
        lines.append(f"  change from first eval: {evals[-1][1] - evals[0][1]:+.3f}")
    keys = ("reward_mean", "rollout_reward_mean", "staleness_mean", "mismatch_kl", "masked_frac", "ess",
            "entropy", "trainer_idle_frac")
    lines.append("  last step: " + ", ".join(f"{k} {last[k]:.3g}" for k in keys if last.get(k) is not None))
    ledger = {k[len("episodes_"):]: v for k, v in last.items() if k.startswith("episodes_")}
    lines.append("  episodes: " + ", ".join(f"{k} {v}" for k, v in ledger.items()))
    tail = read_jsonl(run / "rollouts.jsonl")[-last_rollouts:]
    for r in tail:
        msgs = " | ".join(
            f"{m['role']}: {(m.get('content') or '')[:60]}"
            + "".join(f" <call {c['function']['name']}({c['function']['arguments'][:40]})>" for c in m.get("tool_calls") or [])
            for m in r.get("messages", [])
        )
        lines.append(f"  rollout reward {r.get('reward')} {'ERROR ' + r['error'] if r.get('error') else ''}: {msgs}")
    summary = run / "summary.json"
    if summary.is_file():
        lines.append(f"  final model: {json.loads(summary.read_text()).get('final_model')}")
    return "\n".join(lines)
