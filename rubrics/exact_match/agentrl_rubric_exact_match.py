"""Exact and numeric answer matching, as an agentrl rubric plugin.

The model's answer is taken from its last reply: the last ``<answer>...</answer>`` block if
there is one, else the last ``\\boxed{...}``, else the last non-empty line.  Both sides are
normalised before comparison (case, surrounding whitespace/quotes/``$``, a trailing full
stop, ``\\text{}``, repeated spaces).  Numbers compare by value: ``1,000`` = ``1000.0``,
``3/4`` = ``\\frac{3}{4}`` = ``0.75``, and ``50%`` matches a reference ``0.5`` or ``50``.
A task's ``answer`` may be one value or a list of acceptable values.

Numeric tolerance is for values written inexactly, never for integers: two sides written as
integers or fractions must be equal (``1234568`` is not ``1234567``); a reference written as
a decimal (or in ``e`` notation, or a non-integral float) matches within ``rel_tol``/``abs_tol``;
a decimal reply to an integer (or ``3/4``-like) reference may differ only by ``abs_tol``
(float noise), as it could have been written exactly; to ``1/3`` it may differ by ``rel_tol``.
An answer that is not one number counts only if it is one number among words (``x = 12
apples`` → 12): operators (``2^{10}``, ``sqrt(16)``, ``5 - 3``) or a second number
(``7 apples or 5``) make it no number at all, so a hedge or an expression never scores.

Entry point (group ``agentrl.rubrics``): ``exact-match = agentrl_rubric_exact_match:load_rubric``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

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


class _Num(NamedTuple):
    value: Fraction
    exact: bool  # written as an integer or fraction: compared without tolerance


# LaTeX a number is often written in: \frac{3}{4} -> 3/4, 50\% -> 50%, 1{,}000 -> 1,000
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_LATEX_PLAIN = {"\\%": "%", "\\$": "$", "{,}": ","}


def _number_text(s: str) -> str:
    text = _LATEX_FRAC.sub(r"\1/\2", normalize_text(s))
    for latex, plain in _LATEX_PLAIN.items():
        text = text.replace(latex, plain)
    return text


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


def _match_number(m: re.Match[str]) -> _Num | None:
    value = _to_number(m)
    if value is None:
        return None
    exact = not (m["exp"] or (m["num"] and "." in m["num"]))
    return _Num(value, exact)


def _parse(s: Any) -> _Num | None:
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return _Num(Fraction(s), True)
    if isinstance(s, float):
        if not math.isfinite(s):
            return None
        # an integral float (a pandas column with gaps) is an integer, up to where floats skip them
        return _Num(Fraction(s), s.is_integer() and abs(s) < 2**53)
    m = _NUMBER.fullmatch(_number_text(str(s)))
    return _match_number(m) if m else None


def parse_number(s: Any) -> Fraction | None:
    """The value of ``s`` if the whole (normalised) string is one number, else ``None``."""
    parsed = _parse(s)
    return parsed.value if parsed else None


_WORD_PUNCT = frozenset("=:,.'’°≈~")  # what may sit beside the number: "x = 12 apples", "ans: 3"


def _sole_number(s: str) -> re.Match[str] | None:
    """The one number in ``s`` if everything else is words (``"x = 12 apples"`` → 12), else None.

    A second number or any operator (``2^{10}``, ``sqrt(16)``, ``\\sqrt{2}``, ``5 - 3``) means
    ``s`` is an expression or a hedge, not a number: taking its last number would reward both.
    """
    text = _number_text(s)
    found = [m for m in _NUMBER.finditer(text) if m["frac"] or m["num"]]
    if len(found) != 1:
        return None
    m = found[0]
    rest = text[: m.start()] + text[m.end() :]
    if not all(c.isalpha() or c.isspace() or c in _WORD_PUNCT for c in rest):
        return None
    if m["sign"]:  # "is -3" and "x = - 3" are signs; "x - 3" and "x-3" are subtractions
        before = text[: m.start("sign")]
        spaced = text[m.end("sign") : m.end("sign") + 1].isspace() or not before[-1:].isspace()
        if before.strip() and before.rstrip()[-1] not in "=:≈" and spaced:
            return None
    return m


def _terminates(value: Fraction) -> bool:
    """Whether ``value`` has a finite decimal expansion (its denominator is 2^a 5^b)."""
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def _numbers_close(got: _Num, ref: _Num, rel_tol: float, abs_tol: float) -> bool:
    """Equality for exact values, tolerance for inexact ones (module docstring); exact
    arithmetic throughout, so ``1e400`` cannot overflow."""
    a, b = got.value, ref.value
    if got.exact and ref.exact:
        return a == b
    if ref.exact and _terminates(b):  # the reply could have been written exactly
        rel_tol = 0.0
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

    The answer counts if it is one number, or one number among words (``"x = 12 apples"`` →
    12); ``N%`` matches a reference ``N`` or ``N/100``.
    """
    got = extract_answer(text, tag)
    if got is None:
        return False
    m = _NUMBER.fullmatch(_number_text(got)) or _sole_number(got)
    value = _match_number(m) if m else None
    if value is None:
        return False
    values = [value, _Num(value.value * 100, value.exact)] if m["pct"] else [value]
    refs = [r for r in (_parse(a) for a in _references(answer)) if r is not None]
    return any(_numbers_close(v, r, rel_tol, abs_tol) for v in values for r in refs)


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
