"""Math-equivalence reward built on Hugging Face's ``math-verify``, as an agentrl rubric plugin.

All symbolic work (LaTeX/expression parsing, equivalence of ``\\frac{1}{\\sqrt2}`` and
``\\sqrt{2}/2``, sets, intervals, equations) is ``math_verify.parse`` + ``math_verify.verify``;
this module only decides *which text* is the model's answer and *where* the check runs.

- Answer text: the last ``<answer>...</answer>`` block if present (math-verify does not see
  through such tags), else the whole final reply (math-verify finds ``\\boxed{}`` and the last
  expression itself).  A bare reference like ``x^2+1`` is retried as ``$x^2+1$`` when
  math-verify finds nothing in it without delimiters.
- Where it runs: math-verify bounds its work with ``SIGALRM``, which only works on a main
  thread, and sympy can take seconds on adversarial input.  The async reward function
  therefore runs each check in a small process pool (each worker's main thread), so the
  event loop never blocks and a pathological answer costs at most the timeout.  A check that
  times out scores 0.0; a crashed worker raises (the episode is marked errored).

Entry point (group ``agentrl.rubrics``): ``math-verify = agentrl_rubric_math_verify:load_rubric``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from agentrl.rubrics import completion_text

if TYPE_CHECKING:
    from agentrl.rubrics import Rubric

__all__ = ["completion_text", "answer_text", "is_equivalent", "math_equivalent", "has_answer", "load_rubric"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def answer_text(text: str) -> str:
    """The part of a reply math-verify should read (see module docstring)."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else text


def _parse(text: str, timeout: int | None) -> list[Any]:
    from math_verify import parse

    parsed = parse(text, parsing_timeout=timeout)
    if not parsed and "$" not in text and "\\(" not in text:
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed


def is_equivalent(prediction: str, reference: str, *, timeout: int | None = 5) -> bool:
    """Whether ``prediction`` (model text) is mathematically equivalent to ``reference``.

    Synchronous and in-process.  math-verify's timeouts need a main thread; elsewhere they
    are switched off (use :func:`math_equivalent` to get them in any context).
    """
    from math_verify import verify

    if threading.current_thread() is not threading.main_thread():
        timeout = None
    gold = _parse(str(reference), timeout)
    pred = _parse(answer_text(prediction), timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


# ----------------------------------------------------------------------------- process pool

_POOL: ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_POOL_WORKERS = 2


def _pool() -> ProcessPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            # spawn: never fork a process that may hold torch/engine threads
            _POOL = ProcessPoolExecutor(_POOL_WORKERS, mp_context=multiprocessing.get_context("spawn"))
        return _POOL


def _reset_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None


def _check_in_worker(prediction: str, reference: str, timeout: int) -> bool:
    return is_equivalent(prediction, reference, timeout=timeout)


async def check_async(prediction: str, reference: str, *, timeout: int = 5) -> bool:
    """:func:`is_equivalent` in a worker process; never blocks the event loop."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(_pool(), _check_in_worker, prediction, reference, timeout)
    try:
        # math-verify's own alarms bound parse and verify; this bounds a wedged worker.
        return await asyncio.wait_for(future, timeout=4 * timeout + 30)
    except BrokenProcessPool:
        _reset_pool()
        raise
    except TimeoutError:
        _reset_pool()  # the worker is stuck; start a fresh pool for the next check
        return False


# ----------------------------------------------------------------------------- reward functions


def _references(answer: Any) -> list[str]:
    if answer is None:
        return []
    if isinstance(answer, list | tuple):
        return [str(a) for a in answer]
    return [str(answer)]


async def math_equivalent(completion: Any, answer: Any) -> float:
    """1.0 if the reply's answer is mathematically equivalent to a reference answer."""
    text = completion_text(completion)
    if not text.strip():
        return 0.0
    for ref in _references(answer):
        if await check_async(text, ref):
            return 1.0
    return 0.0


def has_answer(completion: Any) -> float:
    """Format metric: 1.0 if the reply marks an answer with ``\\boxed{}`` or ``<answer>``."""
    text = completion_text(completion)
    return 1.0 if ("\\boxed" in text or _ANSWER_TAG.search(text)) else 0.0


def load_rubric(format_weight: float = 0.0) -> Rubric:
    """The plugin's rubric: ``math_equivalent`` (weight 1) and the ``has_answer`` format metric
    (``format_weight`` > 0 makes it a small shaping reward)."""
    from agentrl.rubrics import Rubric

    return Rubric([math_equivalent, has_answer], [1.0, float(format_weight)])
