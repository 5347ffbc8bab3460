"""Sandbox throughput: execs/s for 64 concurrent short Python snippets, per backend.

For each available backend, 64 sandboxes are started (timed separately: "create/s"),
then 64 concurrent workers each run ``--rounds`` snippets (``python3 -c ...``) in their own
sandbox.  The baseline, measured in the same run, is a bare ``asyncio`` subprocess running
the same snippet with the same concurrency — no isolation, no limits.  The ratio
backend/bare says what the isolation costs per exec: for bwrap and docker, each exec's own
user + pid + IPC namespaces, the seccomp filter and the accounting; for docker, one message
on the container's attach stream (no runtime process per exec).  The local backend (no
isolation) warns when created; the warning is silenced here.

Prints a table and, last, a JSON line {"bare_execs_s", "<backend>_execs_s",
"<backend>_ratio", "<backend>_create_s", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import warnings

from agentrl.sandbox import SandboxLimits, available_backends, make_sandbox
from agentrl.sandbox.base import DEFAULT_PATH

SNIPPET = "import json; print(json.dumps({'sum': sum(range(1000))}))"
EXPECTED = '{"sum": 499500}\n'


async def bare(concurrency: int, rounds: int, python: str) -> float:
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": tempfile.gettempdir()}  # what a sandbox gets

    async def worker() -> None:
        for _ in range(rounds):
            p = await asyncio.create_subprocess_exec(
                python, "-c", SNIPPET, stdout=asyncio.subprocess.PIPE, env=env, cwd=tempfile.gettempdir()
            )
            out, _ = await p.communicate()
            assert out.decode() == EXPECTED

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return concurrency * rounds / (time.perf_counter() - t0)


async def sandboxed(backend: str, concurrency: int, rounds: int) -> tuple[float, float]:
    limits = SandboxLimits(timeout_s=60)
    boxes = [make_sandbox(backend, limits) for _ in range(concurrency)]
    t0 = time.perf_counter()
    await asyncio.gather(*(b.start() for b in boxes))
    create_s = concurrency / (time.perf_counter() - t0)
    try:

        async def worker(box) -> None:
            for _ in range(rounds):
                r = await box.exec(["python3", "-c", SNIPPET])
                assert r.stdout == EXPECTED, r

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(b) for b in boxes))
        execs_s = concurrency * rounds / (time.perf_counter() - t0)
    finally:
        await asyncio.gather(*(b.close() for b in boxes))
    return execs_s, create_s


async def main() -> None:
    warnings.filterwarnings("ignore", message=".*NOT a security boundary.*")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="snippets per worker")
    ap.add_argument("--backends", nargs="*", default=None, help="default: every available one")
    args = ap.parse_args()

    backends = args.backends or available_backends()
    result: dict[str, float | int | str] = {"concurrency": args.concurrency, "rounds": args.rounds}
    python = shutil.which("python3", path=DEFAULT_PATH) or "python3"  # the interpreter sandboxes run
    await bare(args.concurrency, 1, python)  # warm the page cache first
    base = await bare(args.concurrency, args.rounds, python)
    result["bare_execs_s"] = round(base, 1)
    rows = [("bare subprocess", base, None, 1.0)]
    for b in backends:
        execs_s, create_s = await sandboxed(b, args.concurrency, args.rounds)
        result[f"{b}_execs_s"] = round(execs_s, 1)
        result[f"{b}_create_s"] = round(create_s, 1)
        result[f"{b}_ratio"] = round(execs_s / base, 3)
        rows.append((b, execs_s, create_s, execs_s / base))

    print(f"{'backend':<16} {'execs/s':>9} {'create/s':>9} {'ratio':>7}")
    for name, execs_s, create_s, ratio in rows:
        print(f"{name:<16} {execs_s:>9.1f} {'-' if create_s is None else f'{create_s:.1f}':>9} {ratio:>7.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
