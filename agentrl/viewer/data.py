"""Everything the viewer and ``agentrl plot`` read from disk: the one module that knows file
and field names, so a renamed field is a one-place change.

A **run directory** (``agentrl run``) holds ``metrics.jsonl`` (a row per step, the schema of
:mod:`agentrl.metrics`), ``rollouts.jsonl`` (a record per finished training episode, with its
token arrays), ``eval_rollouts.jsonl`` (the held-out episodes of every evaluation, tagged
``eval_version``), ``ledger.jsonl`` (per step, the ids that reached each fate), ``config.toml``,
``summary.json`` and ``final/`` (whose tokenizer turns token ids back into text).
An **eval directory** (``agentrl eval --out``) holds ``results.jsonl`` (a record per episode,
no token arrays), ``summary.json`` and ``meta.json``.

The files are append-only JSONL written while the run goes on.  :class:`Tail` reads the
complete lines added since its last read and starts over when a file shrank or was replaced
(``--resume`` truncates the metrics and the ledger); :class:`RunView` turns them into metric
rows, episode summaries and fate updates behind cursors, so a page can follow a live run.
Every field is read defensively: a missing key is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import tomllib
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError

RUN_FILES = {"metrics": "metrics.jsonl", "rollouts": "rollouts.jsonl", "eval_rollouts": "eval_rollouts.jsonl",
             "ledger": "ledger.jsonl"}
EVAL_FILES = {"results": "results.jsonl"}
FATES = ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "unused")  # none yet: "in flight"

# The curves, in one place for the page and for `agentrl plot`: metric names, labels, colours.
# x is the weight version after the step (= step + 1); a series may name its own x.
X_KEY, X_LABEL = "version", "trainer step"
CHARTS: list[dict[str, Any]] = [
    {"id": "reward", "title": "reward", "y": "mean reward", "series": [
        {"key": "rollout/reward_mean", "label": "rollouts", "color": "#1f77b4"},
        {"key": "train/reward_mean", "label": "trained batch", "color": "#aec7e8"},
        {"key": "eval/reward_mean", "label": "held-out eval", "color": "#d62728", "x": "eval/version", "marker": True,
         "episodes": "eval"}]},
    {"id": "staleness", "title": "staleness", "y": "versions behind", "series": [
        {"key": "buffer/staleness_mean", "label": "mean", "color": "#2ca02c"},
        {"key": "buffer/staleness_max", "label": "max", "color": "#98df8a"},
        {"key": "buffer/max_staleness", "label": "η (bound)", "color": "#7f7f7f", "dash": True}]},
    {"id": "mismatch_kl", "title": "mismatch KL(μ‖π_θ)", "y": "KL per loss token", "series": [
        {"key": "train/mismatch_kl", "label": "mismatch KL", "color": "#9467bd"}]},
    {"id": "masked", "title": "masked / clipped tokens", "y": "share of loss tokens", "series": [
        {"key": "train/masked_frac", "label": "masked", "color": "#8c564b"},
        {"key": "train/clip_frac", "label": "clipped", "color": "#c49c94"}]},
    {"id": "ess", "title": "effective sample size", "y": "ESS / n", "series": [
        {"key": "train/ess", "label": "ESS", "color": "#e377c2"}]},
    {"id": "tokens_per_s", "title": "rollout throughput", "y": "sampled tokens / s", "series": [
        {"key": "rollout/tokens_per_s", "label": "tokens/s", "color": "#17becf"}]},
    {"id": "idle", "title": "trainer idle", "y": "share of step waiting", "series": [
        {"key": "train/idle_frac", "label": "idle", "color": "#bcbd22"}]},
    {"id": "push", "title": "weight push", "y": "seconds", "series": [
        {"key": "weights/push_s", "label": "push", "color": "#ff7f0e"}]},
    {"id": "ledger", "title": "episode ledger", "y": "episodes (cumulative)", "stacked": True, "series": [
        {"key": "ledger/trained", "label": "trained", "color": "#2ca02c"},
        {"key": "ledger/stale", "label": "stale", "color": "#ff7f0e"},
        {"key": "ledger/filtered", "label": "filtered", "color": "#c7c7c7"},
        {"key": "ledger/errored", "label": "errored", "color": "#d62728"},
        {"key": "ledger/interrupted", "label": "interrupted", "color": "#9467bd"},
        {"key": "ledger/skipped", "label": "skipped", "color": "#8c564b"},
        {"key": "ledger/unused", "label": "unused", "color": "#dbdb8d"},
        {"key": "ledger/in_flight", "label": "in flight", "color": "#1f77b4"}]},
]


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def series_points(rows: list[dict[str, Any]], series: dict[str, Any],
                  episodes: list[dict[str, Any]] | None = None) -> list[tuple[float, float]]:
    """(x, y) for one chart series; rows without the metric are skipped.

    A series with ``"episodes": source`` also gets a point for each version that no row carries
    but episodes of that source do: their mean reward, errored ones counting 0 (as
    ``eval/reward_mean`` counts them).  A metrics row holds one held-out eval, so a run whose first
    step is also its last logs only the final eval; the warm-start one is in eval_rollouts.jsonl.
    """
    out = []
    for r in rows:
        y = _num(r.get(series["key"]))
        x = _num(r.get(series.get("x", X_KEY)))
        if x is None and "x" not in series and _num(r.get("step")) is not None:
            x = r["step"] + 1
        if x is not None and y is not None:
            out.append((x, y))
    if series.get("episodes") and episodes:
        have, sums = {x for x, _ in out}, {}
        for e in episodes:
            v = _num(e.get("version"))
            if e.get("source") == series["episodes"] and v is not None and v not in have:
                n, total = sums.get(v, (0, 0.0))
                sums[v] = (n + 1, total + (0.0 if e.get("error") else _num(e.get("reward")) or 0.0))
        out = sorted(out + [(v, total / n) for v, (n, total) in sums.items()])
    return out


# ----------------------------------------------------------------------------- files


class Tail:
    """Complete lines appended to a JSONL file since the last :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.ident = path, 0, None

    def read(self) -> tuple[bool, list[tuple[int, dict[str, Any]]]]:
        """``(reset, [(byte offset, row), ...])``; ``reset`` when the file shrank or was replaced
        (the caller drops what it derived from the old content; the rows then start at 0)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            reset = self.offset > 0
            self.offset, self.ident = 0, None
            return reset, []
        ident = (st.st_dev, st.st_ino)
        reset = self.ident is not None and (ident != self.ident or st.st_size < self.offset)
        if reset:
            self.offset = 0
        self.ident = ident
        if st.st_size <= self.offset:
            return reset, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:  # a line still being written
            return reset, []
        rows, pos = [], self.offset
        for line in data[: end + 1].splitlines(keepends=True):
            try:
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append((pos, row))
            except ValueError:  # a torn line left by a killed writer
                pass
            pos += len(line)
        self.offset += end + 1
        return reset, rows


def read_line_at(path: Path, offset: int) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())
    except (OSError, ValueError):
        return None


def detect_kind(root: Path) -> str:
    """``"run"`` (``agentrl run``) or ``"eval"`` (``agentrl eval --out``)."""
    if (root / "config.toml").is_file() or (root / RUN_FILES["metrics"]).is_file():
        return "run"
    if (root / EVAL_FILES["results"]).is_file() or (root / "meta.json").is_file():
        return "eval"
    raise AgentrlError(f"{root} is neither a run directory (config.toml, metrics.jsonl) nor an eval directory "
                       "(results.jsonl from `agentrl eval --out`)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


# ----------------------------------------------------------------------------- episodes


def task_key(task: dict[str, Any]) -> str:
    """The same task across steps (and across a resume, which gives tasks new ids): its prompt."""
    blob = json.dumps([task.get("prompt"), task.get("answer")], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _question(messages: list[dict[str, Any]]) -> str:
    users = [m.get("content") or "" for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    text = users[0] if users else ""
    return text if isinstance(text, str) else json.dumps(text)


def _sampled_versions(rec: dict[str, Any]) -> list[int]:
    out = []
    for s in rec.get("sequences") or []:
        out += [v for v, m in zip(s.get("versions") or [], s.get("loss_mask") or [], strict=False) if m]
    return out


def episode_summary(rec: dict[str, Any], source: str) -> dict[str, Any] | None:
    """One row of the episode browser; ``source``: train | eval (held-out in a run) | results (eval dir)."""
    if source == "results":
        if "task_index" not in rec:
            return None
        eid, task = f"{rec['task_index']}.{rec.get('rollout', 0)}", {"prompt": rec.get("task_id") or rec["task_index"]}
        version, key = None, f"t{rec['task_index']}"
    else:
        if not rec.get("id"):
            return None
        eid, task = str(rec["id"]), rec.get("task") or {}
        versions = _sampled_versions(rec)
        version = rec.get("eval_version") if source == "eval" else max(versions, default=rec.get("trainer_version"))
        key = task_key(task)
    messages = rec.get("messages") or []
    turns = rec.get("turns")
    return {
        "id": eid, "source": source, "group": rec.get("group_id"), "task": key,
        "question": _question(messages)[:200], "version": version, "reward": _num(rec.get("reward")),
        "error": (rec.get("error") or None) and str(rec["error"])[:300], "error_kind": rec.get("error_kind"),
        "stop_reason": rec.get("stop_reason"), "turns": len(turns) if isinstance(turns, list) else turns,
        "tool_calls": sum(len(m.get("tool_calls") or []) for m in messages if isinstance(m, dict)),
        "tokens": sum(1 for s in rec.get("sequences") or [] for m in s.get("loss_mask") or [] if m),
        "fate": None if source == "train" else ("errored" if rec.get("error") else "evaluated"),
        "advantage": _num(rec.get("advantage")) if source == "train" else None,
    }


def _ledger_fates(row: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(episode id, fate, extra)`` from one ledger.jsonl record: one per episode
    (``{id, group, task, fate, step, reason?, kind?}``); older per-step rows (``{step, <fate>: [ids]}``)
    are read too."""
    if isinstance(row.get("id"), str) and row.get("fate") in FATES:
        return [(row["id"], row["fate"], {k: row[k] for k in ("reason", "kind") if k in row})]
    out = []
    for fate, items in row.items():
        if fate in FATES and isinstance(items, list):
            out += [(str(it.get("id") if isinstance(it, dict) else it), fate, {}) for it in items]
    return out


def token_texts(tok: Any, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text: ``"".join`` of the result is the whole decode.

    A byte-level tokenizer splits a character outside ASCII ("π", "日", an emoji) over several
    tokens, and one token alone decodes to U+FFFD; a SentencePiece token alone loses its leading
    space.  So each token is decoded in the context of the tokens before it (the difference of two
    short decodes, as streaming detokenizers do); a token that ends inside a character gets ""
    and the token that completes the character carries all of it.
    """
    out: list[str] = []
    start = done = 0  # ids[start:done] were decoded last; their text is already in `out`
    for i in range(len(ids)):
        before = tok.decode(ids[start:done], skip_special_tokens=False)
        now = tok.decode(ids[start: i + 1], skip_special_tokens=False)
        if now.endswith("\ufffd") and i + 1 < len(ids) and i + 1 - done < 4:  # inside a character (≤ 4 UTF-8 bytes)
            out.append("")
            continue
        if done < i:  # tokens held back: did this one complete their character?
            held = tok.decode(ids[start:i], skip_special_tokens=False)
            if now.startswith(held) and held.startswith(before):  # no: they were broken bytes, shown as U+FFFD
                out[done], before = held[len(before):], held
        out.append(now[len(before):] if now.startswith(before) else now)
        start, done = done, i + 1
    return out


# ----------------------------------------------------------------------------- the view


class RunView:
    """A run or eval directory read incrementally, behind cursors a page can poll.

    Three streams, each a list that only grows (until a file is truncated: then ``epoch``
    moves on and every cursor starts again at 0): metric rows, episode summaries (an
    episode rerun by ``agentrl eval --resume`` appears again with its new outcome), and fate
    updates from the ledger (with the advantage the trainer used).  Thread-safe.
    """

    def __init__(self, root: str | Path, tokenizer: str | Path | None = None,
                 streams: tuple[str, ...] | None = None) -> None:
        """``streams``: read only these files (e.g. ``("metrics",)`` for plots); default all."""
        self.root = Path(root)
        if not self.root.is_dir():
            raise AgentrlError(f"{self.root} is not a directory")
        self.kind = detect_kind(self.root)
        self.files = {k: v for k, v in (RUN_FILES if self.kind == "run" else EVAL_FILES).items()
                      if streams is None or k in streams}
        self.config = _read_toml(self.root / "config.toml")
        self._tokenizer_dir = tokenizer
        self._tok: Any = None  # tokenizers.Tokenizer once loaded; False when none was found
        self._lock = threading.Lock()
        self.epoch = 0
        self._clear()

    def _clear(self) -> None:
        self._tails = {name: Tail(self.root / f) for name, f in self.files.items()}
        self.metrics: list[dict[str, Any]] = []
        self.episodes: list[dict[str, Any]] = []
        self.fate_log: list[dict[str, Any]] = []
        self._where: dict[str, tuple[str, int, dict[str, Any]]] = {}  # id -> (stream, byte offset, summary)
        self._fate_of: dict[str, dict[str, Any]] = {}
        self.epoch += 1

    def refresh(self) -> None:
        """Read what the files gained since the last call."""
        with self._lock:
            batches = {name: tail.read() for name, tail in self._tails.items()}
            if any(reset for reset, _ in batches.values()):
                self._clear()
                batches = {name: tail.read() for name, tail in self._tails.items()}
            for name in ("rollouts", "eval_rollouts", "results"):  # episodes before the fates that name them
                source = {"rollouts": "train", "eval_rollouts": "eval"}.get(name, name)
                for offset, rec in batches.get(name, (False, []))[1]:
                    summary = episode_summary(rec, source)
                    if summary is not None:
                        self._where[summary["id"]] = (name, offset, summary)
                        self.episodes.append(summary)
            self.metrics += [row for _, row in batches.get("metrics", (False, []))[1]]
            for _, row in batches.get("ledger", (False, []))[1]:
                self._add_fates(row)

    def _add_fates(self, row: dict[str, Any]) -> None:
        for eid, fate, extra in _ledger_fates(row):
            # the advantage the trainer used is logged with the episode (set when its group was scored)
            adv = self._where[eid][2].get("advantage") if eid in self._where and fate == "trained" else None
            entry = {"id": eid, "fate": fate, "step": row.get("step"), "advantage": adv,
                     "advantage_source": "rollouts" if adv is not None else None, **extra}
            self.fate_log.append(entry)
            self._fate_of[eid] = entry

    def poll(self, epoch: int = 0, metrics: int = 0, episodes: int = 0, fates: int = 0,
             limit: int = 5000) -> dict[str, Any]:
        """What the three streams gained past the caller's cursors (all of it on a new epoch)."""
        self.refresh()
        with self._lock:
            if epoch != self.epoch:
                metrics = episodes = fates = 0
            eps = self.episodes[episodes: episodes + limit]
            return {
                "epoch": self.epoch,
                "metrics": self.metrics[metrics:], "episodes": eps, "fates": self.fate_log[fates:],
                "cursor": {"metrics": len(self.metrics), "episodes": episodes + len(eps), "fates": len(self.fate_log)},
                "more": episodes + len(eps) < len(self.episodes),
                "status": self._status(),
            }

    def _status(self) -> dict[str, Any]:
        mtimes = [(self.root / f).stat().st_mtime for f in self.files.values() if (self.root / f).is_file()]
        return {
            "finished": (self.root / "summary.json").is_file(),
            "steps": (self.config.get("trainer") or {}).get("steps"),
            "last_step": self.metrics[-1].get("step") if self.metrics else None,
            "episodes": len(self._where),
            "updated": max(mtimes, default=None),
        }

    def meta(self) -> dict[str, Any]:
        """Static facts for the page header and the chart layout."""
        c = self.config
        get = lambda sec, key: (c.get(sec) or {}).get(key)  # noqa: E731
        config = {
            "env": get("env", "name"), "steps": get("trainer", "steps"), "η": get("buffer", "max_staleness"),
            "group size": get("rollout", "group_size"), "groups per step": get("trainer", "batch_groups"),
            "loss": ((c.get("trainer") or {}).get("loss") or {}).get("name"),
        } if self.kind == "run" else _read_json(self.root / "meta.json")
        return {
            "kind": self.kind, "name": self.root.resolve().name, "path": str(self.root.resolve()),
            "charts": CHARTS if self.kind == "run" else [], "x_label": X_LABEL,
            "config": {k: v for k, v in config.items() if v is not None},
            "summary": _read_json(self.root / "summary.json"),
            "fates": list(FATES),
        }

    def episode(self, eid: str) -> dict[str, Any] | None:
        """One episode in full: transcript, per-token provenance (text, μ logprob, version, loss mask)."""
        self.refresh()
        with self._lock:
            where, fate = self._where.get(eid), self._fate_of.get(eid)
        if where is None:
            return None
        name, offset, summary = where
        rec = read_line_at(self.root / self.files[name], offset)
        if rec is None:
            return None
        task = rec.get("task") or {}
        return {
            "summary": summary, "fate": fate,
            "answer": task.get("answer", rec.get("answer")), "info": task.get("info"),
            "messages": [m for m in _list(rec.get("messages")) if isinstance(m, dict)],
            "metrics": rec.get("metrics") or {}, "timing": rec.get("timing") or {},
            "error": rec.get("error"), "error_kind": rec.get("error_kind"),
            "trainer_version": rec.get("trainer_version"),
            "turns": [{"finish_reason": t.get("finish_reason"), "latency_s": t.get("latency_s"),
                       "prompt_len": t.get("prompt_len"), "completion_tokens": len(t.get("completion_ids") or [])}
                      for t in _list(rec.get("turns")) if isinstance(t, dict)],
            "sequences": [self._tokens(s) for s in _list(rec.get("sequences")) if isinstance(s, dict)],
        }

    def _tokens(self, seq: dict[str, Any]) -> dict[str, Any]:
        ids = [int(i) for i in seq.get("token_ids") or []]
        n = len(ids)

        def col(key: str, fill: Any) -> list[Any]:
            vals = list(seq.get(key) or [])[:n]
            return vals + [fill] * (n - len(vals))

        tok = self.tokenizer()
        text = token_texts(tok, ids) if tok else [f"⟨{i}⟩" for i in ids]
        return {"ids": ids, "text": text, "logprobs": col("logprobs", None), "versions": col("versions", -1),
                "mask": col("loss_mask", 0)}

    def tokenizer(self) -> Any:
        """The run's tokenizer (``tokenizers.Tokenizer``), or None: token ids are then shown as numbers."""
        if self._tok is None:
            self._tok = False
            from tokenizers import Tokenizer

            for d in self._tokenizer_dirs():
                if (d / "tokenizer.json").is_file():
                    try:
                        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
                        break
                    except Exception:  # noqa: BLE001 - a broken file: try the next place
                        continue
        return self._tok or None

    def _tokenizer_dirs(self) -> list[Path]:
        dirs = [Path(self._tokenizer_dir)] if self._tokenizer_dir else []
        dirs.append(self.root / "final")
        model = (self.config.get("model") or {}).get("path") or _read_json(self.root / "meta.json").get("model")
        if isinstance(model, str) and model:
            p = Path(model)
            # a relative model.path is relative to where the run started: usually the parent of runs/
            dirs += [p] if p.is_absolute() else [Path.cwd() / p, self.root.parent.parent / p, self.root / p]
        return dirs
