"""Everything the viewer and ``agentrl plot`` read from disk: the one module that knows file
and field names, so a renamed field is a one-place change.

A **run directory** (``agentrl run``) holds ``metrics.jsonl`` (a row per step, the schema of
:mod:`agentrl.metrics`), ``rollouts.jsonl`` (a record per finished training episode, with its
token arrays), ``eval_rollouts.jsonl`` (the held-out episodes of every evaluation, tagged
``eval_version``), ``ledger.jsonl`` (per step, the ids that reached each fate), ``config.toml``,
``summary.json`` and ``final/`` (whose tokenizer turns token ids back into text).
An **eval directory** (``agentrl eval --out``) holds ``results.jsonl`` (a record per episode,
no token arrays), ``summary.json`` and ``meta.json``.

The files are append-only JSONL written while the run goes on, and grow with it (hundreds of
MB for a long run).  :class:`Tail` reads the complete lines added since its last read, a line
at a time, and starts over when a file shrank or was replaced (``--resume`` truncates the
metrics and the ledger); :class:`RunView` turns each line into a metric row, an episode
summary or fate updates as it is read (a summary is all it keeps of an episode), behind
cursors, so a page can follow a live run.  A poll reads at most :data:`READ_BYTES` of each file
and returns at most :data:`PAGE` rows of each stream: a long run is caught up over several polls.
Every field is read defensively: a missing key or one of the wrong type is skipped, never an
error; a line that is no record is skipped and counted (``skipped_rows``), the rows around it kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError

RUN_FILES = {"metrics": "metrics.jsonl", "rollouts": "rollouts.jsonl", "eval_rollouts": "eval_rollouts.jsonl",
             "ledger": "ledger.jsonl"}
EVAL_FILES = {"results": "results.jsonl"}
FATES = ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "unused")  # none yet: "in flight"
EPISODE_SOURCES = {"rollouts": "train", "eval_rollouts": "eval", "results": "results"}
READ_BYTES = 8 << 20  # per file per poll: a first poll of a long run stays quick and small, the next ones go on
PAGE = {"metrics": 1000, "episodes": 5000, "fates": 5000}  # rows of each stream one poll returns at most

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


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, str) else json.dumps(v)


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
    """Complete lines appended to a JSONL file, read from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.ident = path, 0, None
        self.behind = 0  # bytes the last read left for the next one (it stopped at its byte cap)

    def replaced(self) -> bool:
        """Whether the file shrank, was replaced or went away since it was read: the caller drops what
        it derived from the old content and reads the new one with a fresh Tail."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.offset > 0
        return self.ident is not None and ((st.st_dev, st.st_ino) != self.ident or st.st_size < self.offset)

    def read(self, take: Callable[[int, dict[str, Any] | None], None], max_bytes: int | None = None) -> None:
        """``take(byte offset, row)`` for each complete line past the offset, ``row`` None for a line that
        is no JSON object (a torn or corrupt line); at most ``max_bytes`` (and at least one line) a call.

        The offset moves past a line only once ``take`` returned: a line whose ``take`` raised is read
        again next time, never lost.  One line is in memory at a time, however far behind the file is.
        """
        self.behind = 0
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below; a missing file is no error
        except FileNotFoundError:
            return
        with f:
            st = os.fstat(f.fileno())
            self.ident = (st.st_dev, st.st_ino)
            f.seek(self.offset)
            start = self.offset
            while max_bytes is None or self.offset - start < max_bytes:
                line = f.readline()
                if not line.endswith(b"\n"):  # the end, or a line still being written
                    return
                take(self.offset, _parse(line))
                self.offset += len(line)
            self.behind = max(0, st.st_size - self.offset)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return row if isinstance(row, dict) else None


def read_line_at(path: Path, offset: int) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())
    except (OSError, ValueError, RecursionError):
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


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A transcript message as the page reads it: ``tool_calls`` a list of objects when present."""
    if "tool_calls" in m:
        return {**m, "tool_calls": [c for c in _list(m["tool_calls"]) if isinstance(c, dict)]}
    return m


def _sequences(rec: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in _list(rec.get("sequences")) if isinstance(s, dict)]


def _sampled_versions(rec: dict[str, Any]) -> list[int]:
    out = []
    for s in _sequences(rec):
        out += [v for v, m in zip(_list(s.get("versions")), _list(s.get("loss_mask")), strict=False)
                if m and _int(v) is not None]
    return out


def episode_summary(rec: dict[str, Any], source: str) -> dict[str, Any] | None:
    """One row of the episode browser; ``source``: train | eval (held-out in a run) | results (eval dir)."""
    if source == "results":
        if rec.get("task_index") is None:
            return None
        eid, version, key = f"{rec['task_index']}.{rec.get('rollout', 0)}", None, f"t{rec['task_index']}"
    else:
        if not rec.get("id"):
            return None
        eid, key = str(rec["id"]), task_key(_dict(rec.get("task")))
        version = (_int(rec.get("eval_version")) if source == "eval"
                   else max(_sampled_versions(rec), default=_int(rec.get("trainer_version"))))
    messages = [m for m in _list(rec.get("messages")) if isinstance(m, dict)]
    turns = rec.get("turns")
    return {
        "id": eid, "source": source, "group": _str(rec.get("group_id")), "task": key,
        "question": _question(messages)[:200], "version": version, "reward": _num(rec.get("reward")),
        "error": (rec.get("error") or None) and str(rec["error"])[:300], "error_kind": _str(rec.get("error_kind")),
        "stop_reason": _str(rec.get("stop_reason")), "turns": len(turns) if isinstance(turns, list) else _int(turns),
        "tool_calls": sum(len(_list(m.get("tool_calls"))) for m in messages),
        "tokens": sum(1 for s in _sequences(rec) for m in _list(s.get("loss_mask")) if m),
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
                 streams: tuple[str, ...] | None = None, *, read_bytes: int = READ_BYTES) -> None:
        """``streams``: read only these files (e.g. ``("metrics",)`` for plots); default all.
        ``read_bytes``: how much of each file one :meth:`poll` reads at most."""
        self.root = Path(root)
        if not self.root.is_dir():
            raise AgentrlError(f"{self.root} is not a directory")
        self.kind = detect_kind(self.root)
        self.files = {k: v for k, v in (RUN_FILES if self.kind == "run" else EVAL_FILES).items()
                      if streams is None or k in streams}
        self.config = _read_toml(self.root / "config.toml")
        self.read_bytes = read_bytes
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
        self.skipped, self.skipped_first = 0, None  # lines that were no record we could read; the first's reason
        self.epoch += 1

    def refresh(self, max_bytes: int | None = None) -> None:
        """Read what the files gained since the last call: all of it, or at most ``max_bytes`` of each
        file (``behind`` in :meth:`poll`'s status says how much is left)."""
        with self._lock:
            if any(tail.replaced() for tail in self._tails.values()):
                self._clear()
            for name in (*EPISODE_SOURCES, "metrics", "ledger"):  # episodes before the fates that name them
                if name not in self._tails:
                    continue
                if name == "ledger" and any(self._tails[n].behind for n in EPISODE_SOURCES if n in self._tails):
                    continue  # a trained fate takes its advantage from its episode: wait until that is read
                self._tails[name].read(functools.partial(self._take, name), max_bytes)

    def _take(self, name: str, offset: int, row: dict[str, Any] | None) -> None:
        """One line of file ``name`` into the streams; one that cannot be read is counted and skipped."""
        try:
            if row is None:
                raise ValueError("not a JSON object (a torn or corrupt line)")
            if name == "metrics":
                self.metrics.append(row)
            elif name == "ledger":
                self._add_fates(row)
            else:
                summary = episode_summary(row, EPISODE_SOURCES[name])
                if summary is None:
                    raise ValueError("an episode record without an id")
                self._where[summary["id"]] = (name, offset, summary)
                self.episodes.append(summary)
        except Exception as e:  # noqa: BLE001 - one bad record must not cost the page the rows around it
            self.skipped += 1
            if self.skipped_first is None:
                self.skipped_first = f"{self.files[name]} at byte {offset}: {type(e).__name__}: {e}"[:300]

    def _add_fates(self, row: dict[str, Any]) -> None:
        entries = []
        for eid, fate, extra in _ledger_fates(row):
            # the advantage the trainer used is logged with the episode (set when its group was scored)
            adv = self._where[eid][2].get("advantage") if eid in self._where and fate == "trained" else None
            entries.append({"id": eid, "fate": fate, "step": row.get("step"), "advantage": adv,
                            "advantage_source": "rollouts" if adv is not None else None, **extra})
        self.fate_log += entries
        self._fate_of.update((e["id"], e) for e in entries)

    def poll(self, epoch: int = 0, metrics: int = 0, episodes: int = 0, fates: int = 0,
             limit: int | None = None) -> dict[str, Any]:
        """What the three streams gained past the caller's cursors (all of it on a new epoch), at most
        ``limit`` rows of each (default :data:`PAGE`); ``more``: poll again now (a page was full, or the
        files are still being read: ``status.behind_bytes``)."""
        self.refresh(self.read_bytes)
        with self._lock:
            if epoch != self.epoch:
                metrics = episodes = fates = 0
            streams = {"metrics": (self.metrics, metrics), "episodes": (self.episodes, episodes),
                       "fates": (self.fate_log, fates)}
            pages = {k: rows[max(0, at): max(0, at) + (limit or PAGE[k])] for k, (rows, at) in streams.items()}
            cursor = {k: max(0, at) + len(pages[k]) for k, (_, at) in streams.items()}
            status = self._status()
            more = status["behind_bytes"] > 0 or any(cursor[k] < len(rows) for k, (rows, _) in streams.items())
            return {"epoch": self.epoch, **pages, "cursor": cursor, "more": more, "status": status}

    def _status(self) -> dict[str, Any]:
        mtimes = []
        for f in self.files.values():
            try:
                mtimes.append((self.root / f).stat().st_mtime)
            except OSError:  # not written yet
                continue
        return {
            "finished": (self.root / "summary.json").is_file(),
            "steps": _dict(self.config.get("trainer")).get("steps"),
            "last_step": self.metrics[-1].get("step") if self.metrics else None,
            "episodes": len(self._where),
            "updated": max(mtimes, default=None),
            "behind_bytes": sum(tail.behind for tail in self._tails.values()),
            "skipped_rows": self.skipped, "skipped_first": self.skipped_first,
        }

    def meta(self) -> dict[str, Any]:
        """Static facts for the page header and the chart layout."""
        c = self.config
        get = lambda sec, key: _dict(c.get(sec)).get(key)  # noqa: E731
        config = {
            "env": get("env", "name"), "steps": get("trainer", "steps"), "η": get("buffer", "max_staleness"),
            "group size": get("rollout", "group_size"), "groups per step": get("trainer", "batch_groups"),
            "loss": _dict(get("trainer", "loss")).get("name"),
        } if self.kind == "run" else _read_json(self.root / "meta.json")
        return {
            "kind": self.kind, "name": self.root.resolve().name, "path": str(self.root.resolve()),
            "charts": CHARTS if self.kind == "run" else [], "x_label": X_LABEL,
            "config": {k: v for k, v in config.items() if v is not None},
            "summary": _read_json(self.root / "summary.json"),
            "fates": list(FATES),
        }

    def episode(self, eid: str) -> dict[str, Any] | None:
        """One episode in full: transcript, per-token provenance (text, μ logprob, version, loss mask).

        ``problems``: a line for each part of the record that could not be shown as it is (the rest is)."""
        self.refresh(self.read_bytes)
        with self._lock:
            where, fate = self._where.get(eid), self._fate_of.get(eid)
        if where is None:
            return None
        name, offset, summary = where
        rec = read_line_at(self.root / self.files[name], offset)
        if not isinstance(rec, dict):
            return None
        try:
            return self._detail(rec, summary, fate)
        except Exception as e:  # noqa: BLE001 - a shape no one foresaw: this episode says so, the page goes on
            return {"summary": summary, "fate": fate, "messages": [], "metrics": {}, "timing": {}, "turns": [],
                    "sequences": [], "problems": [f"this record could not be shown: {type(e).__name__}: {e}"[:300]]}

    def _detail(self, rec: dict[str, Any], summary: dict[str, Any], fate: dict[str, Any] | None) -> dict[str, Any]:
        task, problems = _dict(rec.get("task")), []
        return {
            "summary": summary, "fate": fate,
            "answer": task.get("answer", rec.get("answer")), "info": task.get("info"),
            "messages": [_message(m) for m in _list(rec.get("messages")) if isinstance(m, dict)],
            "metrics": _dict(rec.get("metrics")), "timing": _dict(rec.get("timing")),
            "error": rec.get("error"), "error_kind": rec.get("error_kind"),
            "trainer_version": rec.get("trainer_version"),
            "turns": [{"finish_reason": t.get("finish_reason"), "latency_s": t.get("latency_s"),
                       "prompt_len": t.get("prompt_len"), "completion_tokens": len(_list(t.get("completion_ids")))}
                      for t in _list(rec.get("turns")) if isinstance(t, dict)],
            "sequences": [self._tokens(s, problems) for s in _sequences(rec)],
            "problems": problems,
        }

    def _tokens(self, seq: dict[str, Any], problems: list[str]) -> dict[str, Any]:
        ids = _list(seq.get("token_ids"))
        n = len(ids)

        def col(key: str, fill: Any) -> list[Any]:
            vals = _list(seq.get(key))[:n]
            return vals + [fill] * (n - len(vals))

        text = [f"⟨{str(i)[:40]}⟩" for i in ids]  # numbers, unless the tokenizer can read them
        tok = self.tokenizer()
        if not all(_int(i) is not None and 0 <= i < 2**32 for i in ids):
            problems.append("some token ids are not token ids: the tokens show the values logged")
        elif tok:
            try:
                text = token_texts(tok, ids)
            except Exception as e:  # noqa: BLE001 - ids outside this tokenizer's vocabulary, say
                problems.append(f"the tokenizer could not decode these token ids ({type(e).__name__}: {e}): "
                                "they are shown as numbers")
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
        model = _dict(self.config.get("model")).get("path") or _read_json(self.root / "meta.json").get("model")
        if isinstance(model, str) and model:
            p = Path(model)
            # a relative model.path is relative to where the run started: usually the parent of runs/
            dirs += [p] if p.is_absolute() else [Path.cwd() / p, self.root.parent.parent / p, self.root / p]
        return dirs
