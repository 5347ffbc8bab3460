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
