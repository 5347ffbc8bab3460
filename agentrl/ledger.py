"""The episode ledger: every started episode is tracked by id until it reaches one fate.

Fates: ``trained``, ``stale`` (a token more than η versions old), ``filtered`` (its group had
no learning signal), ``errored`` (with an error kind), ``interrupted`` (in flight when an
earlier process died, settled on ``--resume``; or still running when the run ended),
``skipped`` (the trainer left it out: a non-finite μ or advantage, or every update holding it
had a non-finite gradient), ``unused`` (finished and trainable, but the run ended first).  The live set is *counted* — a dict of episode ids —
not derived from the other numbers, so two checks can fail (:meth:`Ledger.check`):

- ``started == Σ fates + |live|`` (an episode counted twice or never), and
- the live ids are exactly the episodes someone still holds (running in the rollout
  manager, ready or in training in the buffer, cancelled at shutdown): an episode whose
  group vanished without a fate is caught.

A violation is agentrl's bug: :class:`LedgerError` stops the run with a diagnostic.
Every settled episode becomes one ``ledger.jsonl`` record (:meth:`drain_records`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

FATES = ("trained", "stale", "filtered", "errored", "interrupted", "skipped", "unused")


class LedgerError(RuntimeError):
    """The ledger disagrees with itself or with who holds the episodes (a bug in agentrl)."""


@dataclass
class Ledger:
    started: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FATES, 0))
    errored_kinds: Counter = field(default_factory=Counter)
    live: dict[str, tuple[str, str]] = field(default_factory=dict)  # episode id -> (group id, task id)
    first_error: dict[str, str] = field(default_factory=dict)  # kind -> first message seen
    failed_kinds: Counter = field(default_factory=Counter)  # policy errors kept in their group as failures
    _records: list[dict[str, Any]] = field(default_factory=list)

    # -- counts by fate (read-only views)
    trained = property(lambda self: self.counts["trained"])
    stale = property(lambda self: self.counts["stale"])
    filtered = property(lambda self: self.counts["filtered"])
    errored = property(lambda self: self.counts["errored"])
    interrupted = property(lambda self: self.counts["interrupted"])
    skipped = property(lambda self: self.counts["skipped"])
    unused = property(lambda self: self.counts["unused"])

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def start(self, ids: list[str], group_id: str, task_id: str) -> None:
        for eid in ids:
            if eid in self.live:
                raise LedgerError(f"episode {eid} started twice")
            self.live[eid] = (group_id, task_id)
        self.started += len(ids)

    def settle(
        self, ids: list[str], fate: str, *, step: int, reason: str | None = None, kind: str | None = None,
    ) -> None:
        """Give these live episodes their fate (one ``ledger.jsonl`` record each)."""
        if fate not in FATES:
            raise LedgerError(f"unknown fate {fate!r}")
        for eid in ids:
            where = self.live.pop(eid, None)
            if where is None:
                raise LedgerError(f"episode {eid} reached fate {fate!r} but is not live (unknown, or settled twice)")
            record = {"id": eid, "group": where[0], "task": where[1], "fate": fate, "step": step}
            if reason is not None:
                record["reason"] = reason
            if kind is not None:
                record["kind"] = kind
            self._records.append(record)
        self.counts[fate] += len(ids)
        if fate == "errored" and kind is not None:
            self.errored_kinds[kind] += len(ids)
            if reason is not None:
                self.first_error.setdefault(kind, reason)

    def note_failure(self, kind: str, reason: str | None) -> None:
        """An episode errored by the policy's doing stays in its group as a failure (not a fate: it
        still trains, or is filtered or stale, with its group); counted per kind."""
        self.failed_kinds[kind] += 1
        if reason is not None:
            self.first_error.setdefault(kind, reason)

    def check(self, held: set[str]) -> None:
        """Raise :class:`LedgerError` if the counts do not add up or the live set is not ``held``."""
        total = sum(self.counts.values()) + len(self.live)
        if total != self.started:
            raise LedgerError(f"ledger does not add up: started {self.started} != fates {dict(self.counts)} + "
                              f"live {len(self.live)}")
        live = set(self.live)
        if live != held:
            lost, unknown = sorted(live - held)[:5], sorted(held - live)[:5]
            raise LedgerError(
                f"ledger live set != episodes held: {len(live - held)} live but held by no one (e.g. {lost}), "
                f"{len(held - live)} held but not live (e.g. {unknown})"
            )

    def settled_since_drain(self) -> set[str]:
        """Episodes that reached their fate since the last :meth:`drain_records`."""
        return {r["id"] for r in self._records}

    def drain_records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []
        return out

    def as_metrics(self) -> dict[str, Any]:
        row: dict[str, Any] = {"ledger/started": self.started, **{f"ledger/{f}": n for f, n in self.counts.items()},
                               "ledger/in_flight": self.in_flight}
        row.update({f"ledger/errored/{k}": n for k, n in self.errored_kinds.items()})
        row.update({f"ledger/failed/{k}": n for k, n in self.failed_kinds.items()})
        return row

    def top_error(self) -> str | None:
        """The most frequent error kind with its first message, for the status line."""
        kinds = self.errored_kinds + self.failed_kinds
        if not kinds:
            return None
        kind, n = kinds.most_common(1)[0]
        return f"{n}× {kind}: {self.first_error.get(kind, '')}"[:300]

    # -- checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {"started": self.started, "counts": dict(self.counts), "errored_kinds": dict(self.errored_kinds),
                "first_error": dict(self.first_error), "failed_kinds": dict(self.failed_kinds),
                "live": {k: list(v) for k, v in self.live.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.started = state["started"]
        self.counts = {**dict.fromkeys(FATES, 0), **state["counts"]}
        self.errored_kinds = Counter(state.get("errored_kinds", {}))
        self.first_error = dict(state.get("first_error", {}))
        self.failed_kinds = Counter(state.get("failed_kinds", {}))
        self.live = {k: (v[0], v[1]) for k, v in state["live"].items()}
        self._records = []
