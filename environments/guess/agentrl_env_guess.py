"""Guess-the-number: a multi-turn game with higher/lower feedback (see README.md)."""

from __future__ import annotations

import math
import random
import re
import zlib

from agentrl.envs import MultiTurnEnv, State
from agentrl.rubrics import Rubric
from agentrl.types import Message, Task

_GUESS_TAG = re.compile(r"<guess>\s*([-+]?[0-9]+)\s*</guess>", re.IGNORECASE)
_INTEGER = re.compile(r"(?<![0-9.])[-+]?[0-9]+(?![0-9]*\.[0-9])")
_MAX_DIGITS = 12  # longer "numbers" are junk, not guesses

RULES = (
    "I am thinking of a whole number between {low} and {high} (inclusive). Find it in as few "
    "guesses as you can. After each guess I tell you whether my number is higher or lower. "
    "Reply with one guess per turn, like <guess>{example}</guess>."
)
TERSE_RULES = "Guess my number from {low} to {high}."  # terse=True: ~5x fewer tokens per episode


def parse_guess(text: str) -> int | None:
    """The number a reply guesses: the last ``<guess>N</guess>``, else the last integer written."""
    tagged = _GUESS_TAG.findall(text)
    found = tagged or _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].lstrip("+-")
    return int(found[-1]) if len(digits) <= _MAX_DIGITS else None


def solved(state: State) -> float:
    """1.0 if the number was found."""
    return 1.0 if state.get("solved") else 0.0


def turn_penalty(state: State) -> float:
    """Minus the fraction of the turn budget used beyond the first guess (0 for a first-guess
    win, -1 for a loss): logged as a metric, or a shaping reward with a weight.

    Clamped to [-1, 0]: an episode may run longer than the env's ``max_turns`` (a rollout or
    eval turn limit overrides it, and the env cannot see that limit), and a win past the
    budget must still score above any loss (1 - w > -w), never below it.
    """
    if not state.get("solved"):
        return -1.0
    budget = max(1, state["max_guesses"] - 1)
    return -min(1.0, (state["guesses"] - 1) / budget)


def binary_search_policy(transcript: str) -> str:
    """Optimal bisection from the rules and feedback in a transcript (demonstrations, tests)."""
    bounds = re.search(r"(?:between|from) (-?\d+) (?:and|to) (-?\d+)", transcript)
    lo, hi = (int(bounds.group(1)), int(bounds.group(2))) if bounds else (1, 100)
    for word, n in re.findall(r"(higher|lower) than (-?\d+)", transcript, re.IGNORECASE):
        if word.lower() == "higher":
            lo = max(lo, int(n) + 1)
        else:
            hi = min(hi, int(n) - 1)
    return f"<guess>{(lo + hi) // 2}</guess>"


def _feedback(secret: int, guess: int, low: int, high: int, interval: tuple[int, int] | None = None,
              terse: bool = False) -> str:
    word = "higher" if secret > guess else "lower"
    if terse:  # "Higher than 23: 24 to 54."
        return f"{word.title()} than {guess}" + (f": {interval[0]} to {interval[1]}." if interval else ".")
    note = "" if low <= guess <= high else f" (remember: it is between {low} and {high})"
    hint = f" It is between {interval[0]} and {interval[1]}." if interval else ""
    return f"No, my number is {word} than {guess}{note}.{hint}"


def narrow(interval: tuple[int, int], secret: int, guess: int) -> tuple[int, int]:
    """The numbers still possible after ``guess`` and its higher/lower answer."""
    lo, hi = interval
    return (max(lo, guess + 1), hi) if secret > guess else (lo, min(hi, guess - 1))


# Demonstration strategies: the next guess from the numbers still possible and the mixing
# fraction (used by "mixed" only).  All are legal (every guess is still possible); only
# bisection always fits the default turn budget.
DEMO_STRATEGIES = {
    "bisect": lambda lo, hi, rng, frac: (lo + hi) // 2,
    "random": lambda lo, hi, rng, frac: rng.randint(lo, hi),  # uniform over the numbers still possible
    "linear": lambda lo, hi, rng, frac: lo,  # count up from the lowest possible number
    # mostly counting up, bisecting a minority of moves: the good move is in the data, but
    # the most likely move (what imitation converges to) is the slow one
    "mixed": lambda lo, hi, rng, frac: (lo + hi) // 2 if rng.random() < frac else lo,
}


class GuessEnv(MultiTurnEnv):
    """Find a secret integer with higher/lower feedback.

    Each task draws a range inside ``[low, high]`` (at least ``min_width`` wide; set
    ``min_width = high - low + 1`` for the classic fixed range) and a secret in it.  Which
    (range, secret) pairs are held out for eval is fixed by a hash, so the eval split never
    repeats a training task.  Reward 1 for finding the number within ``max_turns`` turns
    (default: the bisection bound for the widest range + 1).  Metrics: ``turn_penalty`` (see
    :func:`turn_penalty`; give it a weight to reward speed), ``guesses``, ``invalid_replies``
    (no number in the reply: feedback, and the turn is spent), ``out_of_range``.

    ``demo_strategy`` picks how :meth:`demonstrations` play: ``"bisect"`` (optimal),
    ``"random"`` (a uniform guess among the numbers still possible), ``"linear"`` (the
    lowest number still possible) or ``"mixed"`` (each guess bisects with probability
    ``demo_bisect_frac``, otherwise counts up): legal but inefficient teachers, for showing
    RL going beyond imitation.  ``show_interval`` adds the numbers still possible to each feedback
    ("It is between 38 and 63."), so the state of the game is in the last message.
    ``terse`` shortens what the game says (``Guess my number from 17 to 54.``,
    ``Higher than 23: 24 to 54.``) and makes demonstrations reply with the bare number:
    about a third of the tokens, for tiny models on a CPU.
    """

    version = "0.2.0"

    def __init__(
        self,
        *,
        low: int = 1,
        high: int = 100,
        min_width: int = 100,
        num_train: int = 2000,
        num_eval: int = 100,
        seed: int = 0,
        max_turns: int | None = None,
        turn_penalty_weight: float = 0.0,
        demo_strategy: str = "bisect",
        demo_bisect_frac: float = 0.3,
        show_interval: bool = False,
        terse: bool = False,
    ) -> None:
        if high - low + 1 < max(min_width, 5):
            raise ValueError(f"need high - low + 1 >= max(min_width, 5), got low={low}, high={high}, min_width={min_width}")
        if demo_strategy not in DEMO_STRATEGIES:
            raise ValueError(f"demo_strategy must be one of {sorted(DEMO_STRATEGIES)}, got {demo_strategy!r}")
        if not 0.0 <= demo_bisect_frac <= 1.0:
            raise ValueError(f"demo_bisect_frac must be in [0, 1], got {demo_bisect_frac}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns (the turn budget) must be >= 1, got {max_turns}")
        self.low, self.high, self.min_width, self.seed = low, high, min_width, seed
        self.demo_strategy, self.demo_bisect_frac = demo_strategy, demo_bisect_frac
        self.show_interval, self.terse = show_interval, terse
        bound = math.ceil(math.log2(high - low + 1))  # bisection always finishes within this
        rubric = Rubric([solved, turn_penalty], [1.0, float(turn_penalty_weight)])
        super().__init__(rubric=rubric, max_turns=max_turns or bound + 1, name="guess")
        self.reward_range = (-abs(turn_penalty_weight), 1.0)
        self._train = self._tasks(num_train, "train")
        self._eval = self._tasks(num_eval, "eval")
        for split, n, tasks in (("num_train", num_train, self._train), ("num_eval", num_eval, self._eval)):
            if len(tasks) < n:  # the hash holds out no (range, secret) pair of a tiny range, or all
                raise ValueError(f"{split}={n}: only {len(tasks)} tasks can be drawn from low={low}, high={high}, "
                                 f"min_width={min_width}; widen the range or lower min_width")

    def _tasks(self, n: int, split: str) -> list[Task]:
        rng = random.Random(f"guess-{split}-{self.seed}")
        tasks: list[Task] = []
        for _ in range(200 * n):
            if len(tasks) >= n:
                break
            lo = rng.randint(self.low, self.high - self.min_width + 1)
            hi = rng.randint(lo + self.min_width - 1, self.high)
            secret = rng.randint(lo, hi)
            held_out = zlib.crc32(f"{lo},{hi},{secret}".encode()) % 5 == 0
            if held_out != (split == "eval"):
                continue
            if self.terse:
                prompt = [Message("user", TERSE_RULES.format(low=lo, high=hi))]
            else:
                rules = RULES.format(low=lo, high=hi, example=(lo + hi) // 2)
                prompt = [Message("system", rules), Message("user", "Make your first guess.")]
            tasks.append(
                Task(
                    prompt=prompt,
                    answer=secret,
                    info={"low": lo, "high": hi},
                    id=f"guess-{split}-{self.seed}-{len(tasks)}",
                )
            )
        return tasks

    async def setup(self, task: Task) -> State:
        state = State(task, guesses=0, solved=False, max_guesses=self.max_turns,
                      interval=(task.info["low"], task.info["high"]))
        state.metrics.update(guesses=0.0, invalid_replies=0.0, out_of_range=0.0)
        return state

    async def step(self, state: State, assistant_msg: Message) -> list[Message]:
        low, high = state.info["low"], state.info["high"]
        guess = parse_guess(assistant_msg.content)
        if guess is None:
            state.count("invalid_replies")
            if self.terse:
                return [Message("user", "Reply with a number.")]
            return [Message("user", f"I could not find a number in your reply. Answer like <guess>{(low + high) // 2}</guess>.")]
        state["guesses"] += 1
        state.count("guesses")
        secret = int(state.task.answer)
        if guess == secret:
            state["solved"] = True
            state.done = True
            if self.terse:
                return [Message("user", "Correct!")]
            return [Message("user", f"Correct! The number is {secret}. You found it in {state['guesses']} guesses.")]
        if not low <= guess <= high:
            state.count("out_of_range")
        state["interval"] = narrow(state["interval"], secret, guess)
        hint = state["interval"] if self.show_interval else None
        return [Message("user", _feedback(secret, guess, low, high, hint, self.terse))]

    def reference_policy(self):
        """Bisection: finds the number within the turn budget."""
        return lambda task, conversation: Message(
            "assistant", binary_search_policy("\n".join(m.content for m in conversation))
        )

    def demonstrations(self, n: int, seed: int = 0) -> list[list[Message]]:
        """Games on training tasks played by ``demo_strategy`` until found or out of turns
        (bisection always finds it within the budget; the others often do not)."""
        strategy = DEMO_STRATEGIES[self.demo_strategy]
        mix = f"-{self.demo_bisect_frac}" if self.demo_strategy == "mixed" else ""
        rng = random.Random(f"guess-demos-{self.demo_strategy}{mix}-{seed}")
        demos = []
        for i in range(n):
            task = self._train[(seed + i) % len(self._train)]
            messages = list(task.prompt)
            secret, low, high = int(task.answer), task.info["low"], task.info["high"]
            interval = (low, high)
            for _ in range(self.max_turns):
                guess = strategy(*interval, rng, self.demo_bisect_frac)
                messages.append(Message("assistant", str(guess) if self.terse else f"<guess>{guess}</guess>"))
                if guess == secret:
                    break
                interval = narrow(interval, secret, guess)
                hint = interval if self.show_interval else None
                messages.append(Message("user", _feedback(secret, guess, low, high, hint, self.terse)))
            demos.append(messages)
        return demos


def load_environment(**kwargs) -> GuessEnv:
    return GuessEnv(**kwargs)
