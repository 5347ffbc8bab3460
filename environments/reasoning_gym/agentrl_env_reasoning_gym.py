"""Any task family of the ``reasoning-gym`` package as a single-turn agentrl environment.

reasoning-gym generates problems procedurally (no downloads) and ships a checker per
family (``dataset.score_answer(answer, entry) -> float in [0, 1]``, partial credit
allowed).  This module only turns its entries into Tasks and the model's reply into the
answer string those checkers expect.  See README.md.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator, Sequence
from typing import Any

from agentrl.envs import SingleTurnEnv
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. Think step by step if it helps, then give only the final answer inside "
    "<answer></answer> tags, e.g. <answer>42</answer>. When the problem shows an example of the "
    "answer format, follow it exactly."
)

_EVAL_SEED_OFFSET = 1_000_003  # eval problems come from a far-away seed (and never repeat a train question)


def families() -> list[str]:
    """Every task family name reasoning-gym registers."""
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


def _last_tagged(reply: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> str | None:
    """What reasoning-gym's ``extract_answer`` returns (its regex ``<answer>\\s?(.*?)\\s?</answer>``:
    the leftmost open tag, the nearest close tag after it, repeated; the last pair, stripped),
    in one pass: the regex retries every open tag to the end of the reply, so a reply of
    unclosed tags took seconds, on the event loop (rubric functions run inline)."""
    found, pos = None, 0
    while (start := reply.find(open_tag, pos)) >= 0:
        end = reply.find(close_tag, start + len(open_tag))
        if end < 0:  # no close tag after this open tag, hence none after any later one
            break
        found, pos = reply[start + len(open_tag) : end], end + len(close_tag)
    return None if found is None else found.strip()


def extract_answer(reply: str) -> str | None:
    """The answer in a reply: the last ``<answer>...</answer>``, else its last non-empty line."""
    tagged = _last_tagged(reply)
    if tagged is not None:
        return tagged
    lines = [ln.strip() for ln in reply.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


class ReasoningGymEnv(SingleTurnEnv):
    """Problems from one or more reasoning-gym families, scored by reasoning-gym's checkers.

    Reward ``rg_score``: 1.0 when the family's own ``score_answer`` gives the extracted answer
    full credit, else 0.  Many checkers give partial credit to an answer that merely contains
    the reference (``len(reference) / len(answer)``: "5001" scores 0.75 against "500"), which
    pays a policy for hedging: padding an answer it is unsure of with more digits scores more
    than committing to one.  ``partial_credit=True`` makes the checker's score the reward (for
    families whose partial credit you trust); it is always logged as metric ``rg_checker_score``.
    Metric ``has_answer_tag``.  A checker that raises on a malformed answer scores 0 (a wrong
    answer is not an infrastructure failure).
    """

    version = "0.2.0"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        task: str | Sequence[str] = "leg_counting",
        *,
        size: int = 500,
        eval_size: int = 100,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        format_weight: float = 0.0,
        partial_credit: bool = False,
    ) -> None:
        import reasoning_gym

        names = [t.strip() for t in task.split(",")] if isinstance(task, str) else [str(t) for t in task]
        known = families()
        for name in names:
            if name not in reasoning_gym.factory.DATASETS:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else f"; see families() ({len(known)} known)"
                raise ValueError(f"unknown reasoning-gym task {name!r}{hint}")
        if not names or size < 1:
            raise ValueError("need at least one task family and size >= 1")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # the same problems twice under the same task ids; there are no per-family weights
            raise ValueError(f"task names {', '.join(twice)} twice; list each family once")
        self.families, self.size, self.eval_size, self.seed = names, size, eval_size, seed
        self.config = dict(config or {})
        self._datasets: dict[tuple[str, str], Any] = {}
        self._splits: dict[str, list[Task]] = {}
        for name in names:  # bad options fail here, at load time (problems are generated lazily)
            self._dataset(name, "train")

        self.partial_credit = partial_credit

        def rg_checker_score(completion: str, task: Task) -> float:
            return self.score(completion, task)

        def rg_score(completion: str, task: Task) -> float:
            checker = self.score(completion, task)
            return checker if self.partial_credit else float(checker == 1.0)

        def has_answer_tag(completion: str) -> float:
            return 1.0 if "<answer>" in completion and "</answer>" in completion else 0.0

        rubric = Rubric([rg_score, rg_checker_score, has_answer_tag], [1.0, 0.0, float(format_weight)])
        label = "+".join(names) if len(names) <= 3 else f"{len(names)}-families"
        super().__init__(rubric=rubric, system_prompt=system_prompt, name=f"reasoning-gym-{label}")
        self.reward_range = (0.0, 1.0 + max(0.0, float(format_weight)))

    # ------------------------------------------------------------------ data

    def _dataset(self, name: str, split: str) -> Any:
        key = (name, split)
        if key not in self._datasets:
            import reasoning_gym

            offset = self.families.index(name) * 7919 + (_EVAL_SEED_OFFSET if split == "eval" else 0)
            size = self.size if split == "train" else self.eval_size
            per_family = self.config and all(k in self.families for k in self.config)
            options = self.config.get(name, {}) if per_family else self.config
            try:
                self._datasets[key] = reasoning_gym.create_dataset(name, size=size, seed=self.seed + offset, **options)
            except (AssertionError, TypeError) as e:  # reasoning-gym validates configs with assert
                raise ValueError(f"reasoning-gym rejected config {options} for {name!r}: {e or 'invalid value'}") from e
        return self._datasets[key]

    def _entries(self, split: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """Round-robin over the families: (family, index, entry)."""
        per_family = self.size if split == "train" else self.eval_size
        for i in range(per_family):
            for name in self.families:
                yield name, i, self._dataset(name, split)[i]

    def _build(self, split: str, exclude: set[str]) -> list[Task]:
        tasks = []
        for name, i, entry in self._entries(split):
            if entry["question"] in exclude:
                continue
            tasks.append(
                Task(
                    prompt=[*([Message("system", self.system_prompt)] if self.system_prompt else []),
                            Message("user", entry["question"])],
                    answer=entry["answer"],
                    info={"family": name, "split": split, "index": i, "metadata": _json_safe(entry.get("metadata", {}))},
                    id=f"rg-{name}-{split}-{self.seed}-{i}",
                )
            )
        return tasks

    def dataset(self) -> list[Task]:
        if "train" not in self._splits:
            self._splits["train"] = self._build("train", set())
        return self._splits["train"]

    def eval_dataset(self) -> list[Task]:
        if "eval" not in self._splits:
            seen = {t.prompt[-1].content for t in self.dataset()}
            self._splits["eval"] = self._build("eval", seen)
        return self._splits["eval"]

    # ------------------------------------------------------------------ scoring

    def entry(self, task: Task) -> dict[str, Any]:
        """The reasoning-gym entry behind ``task`` (regenerated from the seed; deterministic)."""
        info = task.info
        return self._dataset(info["family"], info["split"])[int(info["index"])]

    def score(self, reply: str, task: Task) -> float:
        """reasoning-gym's own checker on the answer extracted from ``reply`` (0..1)."""
        dataset = self._dataset(task.info["family"], task.info["split"])
        try:
            value = float(dataset.score_answer(extract_answer(reply), self.entry(task)))
        except Exception:  # a checker choking on a malformed answer: wrong, not broken
            return 0.0
        return min(1.0, max(0.0, value))

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """Reference answers in the expected format, for tasks whose reference the checker accepts
        (some families, e.g. propositional_logic, have no single reference answer)."""
        demos = []
        for task in self.dataset()[seed:]:
            if len(demos) >= n:
                break
            if task.answer is None:
                continue
            reply = f"<answer>{task.answer}</answer>"
            if self.score(reply, task) == 1.0:
                demos.append([*task.prompt, Message("assistant", reply)])
        return demos


def load_environment(
    task: str | list[str] = "leg_counting",
    size: int = 500,
    eval_size: int = 100,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    format_weight: float = 0.0,
    partial_credit: bool = False,
) -> ReasoningGymEnv:
    """``task``: a reasoning-gym family name, a comma-separated list, or a list of names;
    ``config``: dataset options for the family (e.g. ``{"min_animals": 2}``), or per family
    (``{"leg_counting": {...}, "gcd": {...}}``)."""
    return ReasoningGymEnv(
        task, size=size, eval_size=eval_size, seed=seed, config=config,
        system_prompt=system_prompt, format_weight=format_weight, partial_credit=partial_credit,
    )
