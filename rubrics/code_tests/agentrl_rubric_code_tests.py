"""Code-tests rubric: run the model's Python function against hidden tests in a sandbox.

Task contract: ``task.info = {"entry_point": "name", "tests": [{"args": [...], "expected": v}, ...]}``.
The code is the last fenced ```python block of the final reply that defines the entry point
(``def <entry_point>(`` at the start of a line), else its last fenced block (else the whole
reply, if it defines a function): a usage example after the solution is not the solution.
Which block is picked gives no way around the tests: only that block runs, under them.  It
runs in a fresh-or-reset sandbox (``agentrl.sandbox``: bwrap or docker; never the host)
with the task's inputs only: the expected values never enter the sandbox, and the
comparison happens here on the host, so printing fake results, exiting early or tampering
with the harness cannot earn reward — only returning the right values can.  Values compare after a JSON round trip (tuples equal lists; ints exactly, floats
within 1e-6: see :func:`values_equal`).  Nothing the solution returns or writes can make
the rubric raise: an unreadable, oversized or malformed report scores its tests failed.

Reward ``tests_passed``: fraction of tests passed (weight 1).  Metrics (weight 0):
``all_tests_passed``, ``code_found``.  A sandbox that fails (infrastructure) raises, which
marks the episode errored; the code's own failures (exceptions, timeouts, OOM) score 0.

Entry point (group ``agentrl.rubrics``): ``code-tests = agentrl_rubric_code_tests:load_rubric``.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from agentrl.rubrics import Rubric
from agentrl.sandbox import SandboxLimits, SandboxPool

__all__ = ["CodeTestsRubric", "TestReport", "extract_code", "load_rubric", "report_cap", "run_tests", "values_equal"]

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S)

# Runs inside the sandbox.  Reads {"entry_point", "inputs", "out"} on stdin, writes one JSON
# report to the file named "out".  The solution's own prints are swallowed.
RUNNER = r"""
import io, json, sys
req = json.loads(sys.stdin.read())
report = {"results": [], "error": None}
real_stdout, sys.stdout = sys.stdout, io.StringIO()
try:
    ns = {"__name__": "solution"}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    fn = ns[req["entry_point"]]
except BaseException as e:
    report["error"] = "%s: %s" % (type(e).__name__, str(e)[:200])
    fn = None
if fn is not None:
    for args in req["inputs"]:
        try:
            value = json.loads(json.dumps(fn(*args)))
            report["results"].append({"ok": True, "value": value})
        except BaseException as e:
            report["results"].append({"ok": False, "error": "%s: %s" % (type(e).__name__, str(e)[:200])})
        sys.stdout = io.StringIO()
with open(req["out"], "w") as f:
    json.dump(report, f)
"""


def extract_code(completion: str, entry_point: str | None = None) -> str | None:
    """The last fenced python block defining ``entry_point`` (any block if none does, or no
    ``entry_point`` is given), else the reply itself when it contains a ``def``."""
    blocks = _FENCE.findall(completion or "")
    if blocks and entry_point:
        defines = re.compile(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\(", re.M)
        blocks = [b for b in blocks if defines.search(b)] or blocks
    if blocks:
        return blocks[-1]
    return completion if completion and re.search(r"^\s*def \w+\(", completion, re.M) else None


def values_equal(got: Any, expected: Any) -> bool:
    """JSON-shaped equality of a returned value with an expected one; never raises.

    - A bool equals only the same bool (``True`` is not ``1``).
    - An int expected: a number exactly equal to it, as Python's ``==`` compares them (what
      an ``assert f(x) == expected`` test accepts): ``3.0`` is ``3``, but no tolerance, so
      near misses (``1307674368001`` for ``15!``) and float approximations of a large
      integer do not pass.
    - A float expected: an int or float within 1e-6 relative (1e-9 absolute), so
      ``0.1 + 0.2`` equals ``0.3`` and ``3`` equals ``3.0``; an int too large for a float
      is unequal.
    - Lists element by element (a tuple comes back as a list), dicts by keys then values,
      anything else with ``==``.
    """
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int):
        return isinstance(got, int | float) and got == expected  # exact, and never raises (10**400 == 1e308)
    if isinstance(expected, float) and isinstance(got, int | float):
        try:
            return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
        except OverflowError:  # an int beyond float range (10**400)
            return False
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(values_equal(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in expected)
    return got == expected


@dataclass
class TestReport:
    passed: int = 0
    total: int = 0
    error: str | None = None
    """Why nothing could be checked: no code, did not compile, timed out, ..."""
    failures: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


async def run_tests(code: str, entry_point: str, tests: list[dict[str, Any]], sandbox: Any,
                    timeout_s: float | None = None) -> TestReport:  # fmt: skip
    """Run ``tests`` against ``code`` in ``sandbox`` (a started :mod:`agentrl.sandbox` sandbox)."""
    _check_tests(tests)
    report = TestReport(total=len(tests))
    # both live in the work dir (the only place file I/O reaches); random names so code
    # written earlier in the episode cannot plant a runner or a report in advance
    tag = secrets.token_hex(8)
    out, runner = f".report-{tag}.json", f".runner-{tag}.py"
    await sandbox.write_file("solution.py", code)
    await sandbox.write_file(runner, RUNNER)
    req = {"entry_point": entry_point, "inputs": [t["args"] for t in tests], "out": out}
    r = await sandbox.exec(["python3", runner], stdin=json.dumps(req), timeout=timeout_s)
    if r.timed_out or r.cpu_exceeded or r.oom:
        report.error = "timed out" if r.timed_out else ("CPU limit" if r.cpu_exceeded else "out of memory")
        return report
    # the solution runs in the runner's interpreter, so the report is model-written: bounded
    # in size, and any way it fails to read, parse or validate is a failed run, not an error
    try:
        raw = await _read_capped(sandbox, out, report_cap(tests))
    except OSError as e:  # missing, too large, not a regular file (SandboxError is not caught)
        why = "report too large" if e.errno == errno.EFBIG else "no report"
        report.error = f"{why} (exit {r.exit_code}): {r.stderr[-300:]}"
        return report
    if len(raw) > _PARSE_INLINE_BYTES:  # a big report parses off the event loop
        return await asyncio.to_thread(_check_report, raw, entry_point, tests, report)
    return _check_report(raw, entry_point, tests, report)


def _check_tests(tests: Any) -> None:
    """The task's tests, before any model output is looked at: a dataset bug raises (the episode
    errors, naming it) instead of hiding as a 0 behind the report's checks."""
    if not isinstance(tests, list) or not all(isinstance(t, dict) and isinstance(t.get("args"), list)
                                              and "expected" in t for t in tests):  # fmt: skip
        raise ValueError('code-tests: task.info["tests"] must be a list of {"args": [...], "expected": value}')


async def _read_capped(sandbox: Any, path: str, cap: int) -> bytes:
    """``read_file`` with a size cap; a sandbox written to the older protocol (no ``max_bytes``)
    is read whole and the cap applied after."""
    if "max_bytes" in inspect.signature(sandbox.read_file).parameters:
        return await sandbox.read_file(path, max_bytes=cap)
    data = await sandbox.read_file(path)
    if len(data) > cap:
        raise OSError(errno.EFBIG, f"{path} is over {cap} bytes")
    return data


# What an honest runner writes per test beyond the value: the ok flag and, on failure, an
# error of at most ~200 characters (plus the exception's type name).
_REPORT_SLACK_BYTES = 1 << 20
_REPORT_PER_TEST_BYTES = 512
_PARSE_INLINE_BYTES = 64 << 10


def report_cap(tests: list[dict[str, Any]]) -> int:
    """The largest report an honest run of ``tests`` needs, in bytes.

    1 MiB, plus 512 bytes a test, plus 8x the expected values as JSON: a right value is
    about as long as the expected one (a float's repr at most ~8x a short literal like
    ``0.3``), and a wrong value may be shorter or be an error message.  The sandbox caps
    any read at 64 MiB.
    """
    try:
        expected = len(json.dumps([t.get("expected") for t in tests], default=str))
    except (TypeError, ValueError, RecursionError):
        expected = 0
    return _REPORT_SLACK_BYTES + _REPORT_PER_TEST_BYTES * len(tests) + 8 * expected


def _check_report(raw: bytes, entry_point: str, tests: list[dict[str, Any]], report: TestReport) -> TestReport:
    """Score the runner's report into ``report``; any malformed report scores every test failed."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("error"):
            report.error = str(data.get("error") if isinstance(data, dict) else "malformed report")[:300]
            return report
        results = data.get("results")
        if not isinstance(results, list) or len(results) != len(tests):
            report.error = "malformed report"
            return report
        passed, failures = 0, []
        for test, res in zip(tests, results, strict=True):
            if isinstance(res, dict) and res.get("ok") is True and values_equal(res.get("value"), test["expected"]):
                passed += 1
            else:
                why = res.get("error") if isinstance(res, dict) else res
                failures.append(f"{entry_point}(*{test['args']!r}): {str(why)[:300]}")
    except Exception as e:  # RecursionError ('[' * 10**5), MemoryError, bad UTF-8, ...
        report.error = f"malformed report ({type(e).__name__})"
        return report
    report.passed, report.failures = passed, failures
    return report


class CodeTestsRubric(Rubric):
    """``tests_passed`` (weight 1) + ``all_tests_passed`` and ``code_found`` metrics."""

    def __init__(self, *, backend: str = "auto", limits: SandboxLimits | None = None, max_sandboxes: int = 16) -> None:
        self.backend = backend
        self.limits = limits or SandboxLimits(timeout_s=10.0, cpu_s=10)
        self.max_sandboxes = max_sandboxes
        self._pools: dict[asyncio.AbstractEventLoop, SandboxPool] = {}
        self._reports: dict[str, asyncio.Future[TestReport]] = {}
        super().__init__([self.tests_passed, self.all_tests_passed, self.code_found], weights=[1.0, 0.0, 0.0])

    def _pool(self) -> SandboxPool:
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            self._pools[loop] = SandboxPool(self.backend, self.limits, max_live=self.max_sandboxes)
        return self._pools[loop]

    async def report(self, completion: str, info: dict[str, Any]) -> TestReport:
        """Test report for one reply (computed once, shared by the three functions)."""
        entry_point = info.get("entry_point")
        code = extract_code(completion, entry_point if isinstance(entry_point, str) else None)
        if code is None:
            return TestReport(total=len(info.get("tests", [])), error="no code found")
        key = json.dumps([code, info.get("entry_point"), info.get("tests")], sort_keys=True, default=str)
        fut = self._reports.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._reports[key] = fut
            try:
                async with self._pool().acquire() as sb:
                    fut.set_result(await run_tests(code, info["entry_point"], info["tests"], sb))
            except BaseException as e:
                self._reports.pop(key, None)
                fut.set_exception(e)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
                raise
        result = await fut
        if len(self._reports) > 4096:  # bounded memo: drop the oldest half
            for k in list(self._reports)[:2048]:
                self._reports.pop(k, None)
        return result

    async def tests_passed(self, completion: str, info: dict[str, Any]) -> float:
        return (await self.report(completion, info)).fraction

    async def all_tests_passed(self, completion: str, info: dict[str, Any]) -> float:
        r = await self.report(completion, info)
        return float(r.total > 0 and r.passed == r.total)

    def code_found(self, completion: str) -> float:
        return float(extract_code(completion) is not None)

    async def close(self) -> None:
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()


def load_rubric(backend: str = "auto", timeout_s: float = 10.0, max_sandboxes: int = 16) -> CodeTestsRubric:
    """The plugin's rubric; ``backend`` picks the sandbox (auto: bwrap, else docker)."""
    return CodeTestsRubric(backend=backend, limits=SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s))),
                           max_sandboxes=max_sandboxes)  # fmt: skip
