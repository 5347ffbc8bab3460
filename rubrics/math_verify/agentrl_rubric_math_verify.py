"""Math-equivalence reward built on Hugging Face's ``math-verify``, as an agentrl rubric plugin.

All symbolic work (LaTeX/expression parsing, equivalence of ``\\frac{1}{\\sqrt2}`` and
``\\sqrt{2}/2``, sets, intervals, equations) is ``math_verify.parse`` + ``math_verify.verify``;
this module only decides *which text* is the model's answer and *where* the check runs.

- Answer text: the last ``<answer>...</answer>`` block if present (math-verify does not see
  through such tags), else the whole final reply (math-verify finds ``\\boxed{}`` and the last
  expression itself).
- References and ``<answer>`` contents without math delimiters are read as LaTeX first
  (``3\\sqrt{2}`` as ``$3\\sqrt{2}$``), and bare only when that finds no expression (or
  the text uses Python's ``**``).  Read bare first, math-verify's expression extractor
  takes a leading number: ``3\\sqrt{2}`` would be ``3``, ``[0, 1)`` ``1`` and ``2x+1``
  ``2``, so the wrong answer ``3`` would score and the right one would not.
- Where it runs: math-verify bounds its work with ``SIGALRM``, which only works on a main
  thread and never interrupts a computation inside C (a huge integer power), and sympy can
  take seconds on adversarial input.  The async reward function therefore runs each check in
  one of a few worker processes (each check on a worker's main thread), so the event loop
  never blocks.  A check still running at its wall limit has its worker killed and scores
  0.0; so does one whose worker dies or raises.  Other episodes' checks, queued or running
  on other workers, are untouched: an answer that breaks the checker is a wrong answer, never
  an errored episode (which would drop it, and its 0, from training).  Only a worker that
  cannot start raises.

Entry point (group ``agentrl.rubrics``): ``math-verify = agentrl_rubric_math_verify:load_rubric``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from agentrl.rubrics import completion_text, tagged

if TYPE_CHECKING:
    from agentrl.rubrics import Rubric

__all__ = ["completion_text", "answer_text", "is_equivalent", "math_equivalent", "has_answer", "load_rubric"]

def answer_text(text: str) -> str:
    """The part of a reply math-verify should read (see module docstring)."""
    found = tagged(text, "answer")
    return found[-1].strip() if found else text


_DELIMITED = ("$", "\\(", "\\[", "\\boxed")


def _parse(text: str, timeout: int | None) -> list[Any]:
    """A reference or ``<answer>`` content: LaTeX first, bare as the fallback (module docstring)."""
    from math_verify import parse

    if any(d in text for d in _DELIMITED) or "**" in text:  # delimited already, or Python syntax
        return parse(text, parsing_timeout=timeout)
    parsed = parse(f"${text}$", parsing_timeout=timeout)
    # a LaTeX parse that fails leaves only the raw string: no expression to compare
    if any(not isinstance(p, str) for p in parsed):
        return parsed
    return parse(text, parsing_timeout=timeout) or parsed


def is_equivalent(prediction: str, reference: str, *, timeout: int | None = 5) -> bool:
    """Whether ``prediction`` (model text) is mathematically equivalent to ``reference``.

    Synchronous and in-process.  math-verify's timeouts need a main thread; elsewhere they
    are switched off (use :func:`math_equivalent` to get them in any context).
    """
    from math_verify import parse, verify

    if threading.current_thread() is not threading.main_thread():
        timeout = None
    gold = _parse(str(reference), timeout)
    found = tagged(prediction, "answer")
    pred = _parse(found[-1].strip(), timeout) if found else parse(prediction, parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


# ----------------------------------------------------------------------------- worker processes
# Each of _POOL_WORKERS threads owns one spawn-started process and runs one check at a time
# in it.  A check that overruns its wall limit kills that process only (the thread starts a
# fresh one for its next check); checks waiting for a thread wait in the executor's queue,
# which nothing cancels.  (A ProcessPoolExecutor cannot do this: killing one of its workers
# breaks the pool and fails every pending check with it.)

_POOL_WORKERS = 2
_START_TIMEOUT_S = 120.0  # spawning and importing math-verify + sympy, on a loaded machine
_THREADS: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_LOCAL = threading.local()  # .worker: this thread's _Worker
_WORKERS: set[_Worker] = set()
log = logging.getLogger(__name__)


def _wall_limit_s(timeout: int) -> float:
    """How long one check may run: math-verify's alarms bound up to four parses and a verify."""
    return 5 * timeout + 5.0


def _serve(conn: Connection) -> None:
    """A worker process's loop: run ``(fn, args)`` jobs, answer ``(status, value)``."""
    import math_verify  # noqa: F401  (imported before "ready": startup is not a check's time)

    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            result = ("ok", fn(*args))
        except Exception as e:
            result = ("error", f"{type(e).__name__}: {e}"[:500])
        conn.send(result)


class _Worker:
    """One spawn-started process (spawn: never fork a process that may hold torch threads)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), name="math-verify", daemon=True)
        self.process.start()
        child.close()
        with _POOL_LOCK:
            _WORKERS.add(self)
        try:
            ready = self.conn.poll(_START_TIMEOUT_S) and self.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(f"a math-verify worker process did not start within {_START_TIMEOUT_S:.0f}s "
                               f"(exit code {self.process.exitcode}); is math-verify installed?")  # fmt: skip

    def run(self, fn: Any, args: tuple[Any, ...], limit_s: float) -> tuple[str, Any]:
        """``("ok", value)``, ``("error", message)``, ``("timeout", None)`` or ``("died", None)``."""
        try:
            self.conn.send((fn, args))
            if not self.conn.poll(limit_s):
                return "timeout", None
            return self.conn.recv()
        except (EOFError, OSError):  # it died under this input (a crash, the OOM killer)
            return "died", None

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        with _POOL_LOCK:
            _WORKERS.discard(self)


def _run_on_this_thread(fn: Any, args: tuple[Any, ...], limit_s: float) -> tuple[str, Any]:
    worker = getattr(_LOCAL, "worker", None)
    if worker is None or not worker.process.is_alive():
        if worker is not None:
            worker.kill()
        _LOCAL.worker = None
        worker = _LOCAL.worker = _Worker()
    status, value = worker.run(fn, args, limit_s)
    if status in ("timeout", "died"):
        worker.kill()  # a computation stuck in C ignores the alarm; only SIGKILL ends it
        _LOCAL.worker = None
    return status, value


def _threads() -> ThreadPoolExecutor:
    global _THREADS
    with _POOL_LOCK:
        if _THREADS is None:
            _THREADS = ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="math-verify")
        return _THREADS


def _reset_pool() -> None:
    """Kill every worker process; each thread starts a fresh one for its next check."""
    with _POOL_LOCK:
        workers = list(_WORKERS)
    for worker in workers:
        worker.kill()


def _check_in_worker(prediction: str, reference: str, timeout: int) -> bool:
    return is_equivalent(prediction, reference, timeout=timeout)


async def check_async(prediction: str, reference: str, *, timeout: int = 5) -> bool:
    """:func:`is_equivalent` in a worker process; never blocks the event loop.

    False when the check raises, outlives its wall limit (its worker is killed) or kills its
    worker; raises only if no worker process can start.
    """
    loop = asyncio.get_running_loop()
    args = (prediction, reference, timeout)
    status, value = await loop.run_in_executor(
        _threads(), _run_on_this_thread, _check_in_worker, args, _wall_limit_s(timeout)
    )
    if status != "ok":
        log.warning("math-verify check scored 0: %s", value if status == "error" else f"worker {status}")
    return status == "ok" and bool(value)


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
    return 1.0 if ("\\boxed" in text or tagged(text, "answer", first_only=True)) else 0.0


def load_rubric(format_weight: float = 0.0) -> Rubric:
    """The plugin's rubric: ``math_equivalent`` (weight 1) and the ``has_answer`` format metric
    (``format_weight`` > 0 makes it a small shaping reward)."""
    from agentrl.rubrics import Rubric

    return Rubric([math_equivalent, has_answer], [1.0, float(format_weight)])
