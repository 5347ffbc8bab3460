"""Code-tests rubric: run the model's Python function against hidden tests in a sandbox.

Task contract: ``task.info = {"entry_point": "name", "tests": [{"args": [...], "expected": v}, ...]}``.
The code is the last fenced ```python block of the final reply (else the whole reply, if it
defines the entry point).  It runs in a fresh-or-reset sandbox (``agentrl.sandbox``: bwrap
or docker; never the host) with the task's inputs only: the expected values never enter the
sandbox, and the comparison happens here on the host, so printing fake results, exiting
early or tampering with the harness cannot earn reward — only returning the right values
can.  Values compare after a JSON round trip (tuples equal lists; floats within 1e-6).

Reward ``tests_passed``: fraction of tests passed (weight 1).  Metrics (weight 0):
``all_tests_passed``, ``code_found``.  A sandbox that fails (infrastructure) raises, which
marks the episode errored; the code's own failures (exceptions, timeouts, OOM) score 0.

Entry point (group ``agentrl.rubrics``): ``code-tests = agentrl_rubric_code_tests:load_rubric``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from agentrl.rubrics import Rubric
from agentrl.sandbox import SandboxLimits, SandboxPool

__all__ = ["CodeTestsRubric", "TestReport", "extract_code", "load_rubric", "run_tests", "values_equal"]

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


def extract_code(completion: str) -> str | None:
    """The last fenced python block, else the reply itself when it contains a ``def``."""
    blocks = _FENCE.findall(completion or "")
    if blocks:
        return blocks[-1]
    return completion if completion and re.search(r"^\s*def \w+\(", completion, re.M) else None


def values_equal(got: Any, expected: Any) -> bool:
    """JSON-shaped equality; floats within 1e-6 (relative) so 0.1+0.2 == 0.3."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int | float) and isinstance(got, int | float):
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
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
    try:
        data = json.loads(await sandbox.read_file(out))
    except (OSError, ValueError):
        report.error = f"no report (exit {r.exit_code}): {r.stderr[-300:]}"
        return report
    if not isinstance(data, dict) or data.get("error"):
        report.error = str(data.get("error") if isinstance(data, dict) else "malformed report")
        return report
    results = data.get("results")
    if not isinstance(results, list) or len(results) != len(tests):
        report.error = "malformed report"
        return report
    for test, res in zip(tests, results, strict=True):
        if isinstance(res, dict) and res.get("ok") and values_equal(res.get("value"), test["expected"]):
            report.passed += 1
        else:
            report.failures.append(f"{entry_point}(*{test['args']!r}): {res.get('error') if isinstance(res, dict) else res}")
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
        code = extract_code(completion)
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
