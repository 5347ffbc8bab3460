"""Exact and numeric answer matching, as an agentrl rubric plugin.

The model's answer is taken from its last reply: the last ``<answer>...</answer>`` block if
there is one, else the last ``\\boxed{...}``, else the last non-empty line.  Both sides are
normalised before comparison (case, surrounding whitespace/quotes/``$``, a trailing full
stop, ``\\text{}``, repeated spaces).  Numbers compare by value: ``1,000`` = ``1000.0``,
``3/4`` = ``0.75``, ``50%`` = ``0.5`` only if the reference is also written as a percent.
A task's ``answer`` may be one value or a list of acceptable values.

Entry point (group ``agentrl.rubrics``): ``exact-match = agentrl_rubric_exact_match:load_rubric``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

from agentrl.rubrics import completion_text, tagged

if TYPE_CHECKING:
    from agentrl.rubrics import Rubric

__all__ = [
    "completion_text",
    "extract_answer",
    "last_boxed",
    "tagged",
    "has_tagged",
    "normalize_text",
    "parse_number",
    "match_exact",
    "match_numeric",
    "match_answer",
    "exact_match",
    "numeric_match",
    "has_answer",
    "answer_reward",
    "load_rubric",
]

Mode = Literal["auto", "exact", "numeric"]


# ----------------------------------------------------------------------------- reading the reply


# Reading the reply is linear in its length: a regex like <answer>(.*?)</answer>, or a brace
# scan per \boxed{, rescans to the end from every unclosed opening, and a reply full of them
# would stall the event loop for seconds to minutes.
def has_tagged(text: str, tag: str) -> bool:
    """Whether ``text`` has a ``<tag>...</tag>`` block."""
    return bool(tagged(text, tag, first_only=True))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    starts = {m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)}
    if not starts:
        return None
    # one pass matching every brace: a box's content ends where its own "{" is closed
    closes: dict[int, int] = {}
    stack: list[int] = []
    for m in re.finditer(r"[{}]", text):
        if m[0] == "{":
            stack.append(m.start())
        elif stack:
            opened = stack.pop()
            if opened in starts:
                closes[opened] = m.start()
    if not closes:
        return None
    last = max(closes)
    return text[last + 1 : closes[last]]


def extract_answer(text: str, tag: str | None = "answer") -> str | None:
    """The answer the reply commits to, or ``None`` if it is empty.

    Order: last ``<tag>...</tag>``, last ``\\boxed{}``, last non-empty line.
    """
    if tag:
        found = tagged(text, tag)
        if found:
            return found[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


# ----------------------------------------------------------------------------- normalising


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_WRAPPERS = ("$", "`", '"', "'", "*", "**")


def normalize_text(s: str, *, case_sensitive: bool = False) -> str:
    """Canonical form for string comparison (see module docstring)."""
    s = _TEXT_CMD.sub(r"\1", str(s)).strip()
    # peel wrappers and full stops by moving the ends i, j inward (slicing each round would be
    # quadratic in a reply of 100k dots)
    i, j, changed = 0, len(s), True
    while changed and i < j:
        changed = False
        for w in _WRAPPERS:
            n = len(w)
            if j - i >= 2 * n and s.startswith(w, i, j) and s.endswith(w, i, j):
                i, j, changed = i + n, j - n, True
                while i < j and s[i].isspace():
                    i += 1
                while j > i and s[j - 1].isspace():
                    j -= 1
        if s.endswith(".", i, j):  # every trailing full stop (no wrapper can match before they go)
            changed = True
            while j > i and (s[j - 1] == "." or s[j - 1].isspace()):
                j -= 1
    s = re.sub(r"\s+", " ", s[i:j])
    return s if case_sensitive else s.casefold()


_NUMBER = re.compile(
    r"""
    (?P<sign>[-+−]?)\s*
    (?P<cur>[$€£])?\s*
    (?:
        (?P<frac>\d+\s*/\s*\d+)
      | (?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE](?P<exp>[-+]?\d+))?
    )
    \s*(?P<pct>%)?
    """,
    re.VERBOSE,
)


def _to_number(m: re.Match[str]) -> Fraction | None:
    try:
        if m["frac"]:
            num, den = (int(p) for p in m["frac"].replace(" ", "").split("/"))
            if den == 0:
                return None
            value = Fraction(num, den)
        else:
            value = Fraction(m["num"].replace(",", ""))
            if m["exp"]:
                exp = int(m["exp"])
                if abs(exp) > 400:  # keep Fraction arithmetic bounded on absurd exponents
                    return None
                value *= Fraction(10) ** exp
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    if m["pct"]:
        value /= 100
    return -value if m["sign"] in ("-", "−") else value


def parse_number(s: Any) -> Fraction | None:
    """The value of ``s`` if the whole (normalised) string is one number, else ``None``."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return Fraction(s)
    if isinstance(s, float):
        return Fraction(s) if math.isfinite(s) else None
    text = normalize_text(str(s))
    m = _NUMBER.fullmatch(text)
    return _to_number(m) if m else None


def last_number(s: str) -> Fraction | None:
    """The last number written anywhere in ``s`` (``"x = 12 apples"`` → 12)."""
    found = [m for m in _NUMBER.finditer(normalize_text(s)) if m["frac"] or m["num"]]
    for m in reversed(found):
        value = _to_number(m)
        if value is not None:
            return value
    return None


def _numbers_close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
    """``math.isclose`` in exact arithmetic: no float conversion, so ``1e400`` cannot overflow."""
    return abs(a - b) <= max(Fraction(rel_tol) * max(abs(a), abs(b)), Fraction(abs_tol))


def _references(answer: Any) -> list[Any]:
    if answer is None:
        return []
    if isinstance(answer, list | tuple | set | frozenset):
        return list(answer)
    return [answer]


# ----------------------------------------------------------------------------- matching


def match_exact(text: str, answer: Any, *, tag: str | None = "answer", case_sensitive: bool = False) -> bool:
    """Whether the answer in ``text`` equals a reference answer after normalisation."""
    got = extract_answer(text, tag)
    if got is None:
        return False
    refs = {normalize_text(str(a), case_sensitive=case_sensitive) for a in _references(answer)}
    return normalize_text(got, case_sensitive=case_sensitive) in refs


def match_numeric(
    text: str, answer: Any, *, tag: str | None = "answer", rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> bool:
    """Whether the number the answer in ``text`` states equals a numeric reference answer.

    The answer counts if it is one number, else its last number (``"x = 12 apples"`` → 12).
    """
    got = extract_answer(text, tag)
    if got is None:
        return False
    value = parse_number(got)
    if value is None:
        value = last_number(got)
    if value is None:
        return False
    refs = [r for r in (parse_number(a) for a in _references(answer)) if r is not None]
    return any(_numbers_close(value, r, rel_tol, abs_tol) for r in refs)


def match_answer(
    text: str,
    answer: Any,
    *,
    mode: Mode = "auto",
    tag: str | None = "answer",
    case_sensitive: bool = False,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> bool:
    """``exact`` or ``numeric`` matching; ``auto`` tries exact, then numeric for numeric references."""
    if mode not in ("auto", "exact", "numeric"):
        raise ValueError(f"mode must be 'auto', 'exact' or 'numeric', not {mode!r}")
    if mode != "numeric" and match_exact(text, answer, tag=tag, case_sensitive=case_sensitive):
        return True
    if mode == "exact":
        return False
    return match_numeric(text, answer, tag=tag, rel_tol=rel_tol, abs_tol=abs_tol)


# ----------------------------------------------------------------------------- reward functions
# Named by what they measure (the name is the metric's name); they take only arguments a
# Rubric injects.  Options go through :func:`load_rubric` / :func:`answer_reward`.


def exact_match(completion: Any, answer: Any) -> float:
    """1.0 if the reply's answer equals a reference answer after normalisation."""
    return float(match_exact(completion_text(completion), answer))


def numeric_match(completion: Any, answer: Any) -> float:
    """1.0 if the reply's answer is numerically equal to a reference answer."""
    return float(match_numeric(completion_text(completion), answer))


def has_answer(completion: Any) -> float:
    """Format metric: 1.0 if the reply wrote its answer inside ``<answer>...</answer>``."""
    return 1.0 if has_tagged(completion_text(completion), "answer") else 0.0


def answer_reward(
    mode: Mode = "auto",
    *,
    tag: str | None = "answer",
    case_sensitive: bool = False,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    name: str | None = None,
) -> Callable[[Any, Any], float]:
    """A ``(completion, answer) -> float`` reward function with these matching options."""
    match_answer("", None, mode=mode)  # validate options now, not at scoring time
    if not (0 <= rel_tol < math.inf and 0 <= abs_tol < math.inf):
        raise ValueError(f"rel_tol and abs_tol must be finite and >= 0, not {rel_tol!r} and {abs_tol!r}")

    def reward(completion: Any, answer: Any) -> float:
        return float(
            match_answer(
                completion_text(completion), answer, mode=mode, tag=tag,
                case_sensitive=case_sensitive, rel_tol=rel_tol, abs_tol=abs_tol,
            )
        )

    reward.__name__ = name or {"auto": "answer_match", "exact": "exact_match", "numeric": "numeric_match"}[mode]
    return reward


def load_rubric(
    mode: Mode = "auto",
    tag: str | None = "answer",
    case_sensitive: bool = False,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    format_weight: float = 0.0,
) -> Rubric:
    """The plugin's rubric: the match (weight 1) and, if ``tag``, an answer-format metric.

    ``format_weight`` > 0 turns the format metric into a small shaping reward.
    """
    from agentrl.rubrics import Rubric

    funcs: list[Callable[..., float]] = [
        answer_reward(mode, tag=tag, case_sensitive=case_sensitive, rel_tol=rel_tol, abs_tol=abs_tol)
    ]
    weights = [1.0]
    if tag:

        def has_answer(completion: Any) -> float:
            return 1.0 if has_tagged(completion_text(completion), tag) else 0.0

        funcs.append(has_answer)
        weights.append(float(format_weight))
    return Rubric(funcs, weights)
