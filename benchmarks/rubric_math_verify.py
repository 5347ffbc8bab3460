"""math-verify rubric: process-pool checks vs. inline checks on the event loop (same run).

The plugin (rubrics/math_verify) runs each math-verify check in a spawn-started process pool
so SIGALRM timeouts work and the rollout event loop never stalls.  This measures what that
costs and buys on N mixed checks (LaTeX fractions, radicals, polynomials, sets, wrong
answers), scored concurrently as a Rubric would:

* baseline: ``is_equivalent`` called inline in an async function (blocks the loop per check)
* pool:     ``math_equivalent`` (the plugin's reward function), 2 worker processes

Reported: checks/s, and the event loop's worst stall — the largest gap seen by a 1 ms ticker
task running alongside (what every other in-flight episode waits).  JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from agentrl_rubric_math_verify import _pool, is_equivalent, math_equivalent

CASES = [
    ("so \\boxed{0.5}", "1/2"),
    ("<answer>\\frac{2}{4}</answer>", "\\frac{1}{2}"),
    ("$\\boxed{\\frac{1}{\\sqrt{2}}}$", "$\\sqrt{2}/2$"),
    ("$(x+1)^2$", "x^2+2x+1"),
    ("The final answer is $\\{2, 1\\}$", "\\{1,2\\}"),
    ("The answer is 4", "3"),
    ("\\boxed{x^3 - 3x^2 + 3x - 1}", "(x-1)^3"),
    ("I am not sure", "7"),
]


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _run(mode: str, n: int) -> dict[str, float]:
    items = [CASES[i % len(CASES)] for i in range(n)]

    async def inline(pred: str, gold: str) -> float:
        return float(is_equivalent(pred, gold))

    check = inline if mode == "inline" else math_equivalent
    stop, gaps = asyncio.Event(), []
    ticker = asyncio.create_task(_ticker(stop, gaps))
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    rewards = await asyncio.gather(*(check(p, g) for p, g in items))
    elapsed = time.perf_counter() - t0
    stop.set()
    await ticker
    return {"checks_per_s": n / elapsed, "max_stall_ms": 1000 * max(gaps), "correct": sum(rewards)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=200, help="checks per mode")
    args = ap.parse_args()
    is_equivalent("1", "1")  # import sympy/latex2sympy once for both modes
    await math_equivalent("1", "1")  # start the pool's workers (not timed)
    for f in [_pool().submit(is_equivalent, "1", "1") for _ in range(4)]:
        f.result()
    base = await _run("inline", args.n)
    pool = await _run("pool", args.n)
    print(f"{'mode':<8} {'checks/s':>10} {'max loop stall ms':>18} {'correct':>8}")
    for name, r in (("inline", base), ("pool", pool)):
        print(f"{name:<8} {r['checks_per_s']:>10.1f} {r['max_stall_ms']:>18.1f} {r['correct']:>8.0f}")
    print(json.dumps({
        "n": args.n,
        "inline_checks_per_s": round(base["checks_per_s"], 1),
        "pool_checks_per_s": round(pool["checks_per_s"], 1),
        "throughput_ratio": round(pool["checks_per_s"] / base["checks_per_s"], 3),
        "inline_max_stall_ms": round(base["max_stall_ms"], 1),
        "pool_max_stall_ms": round(pool["max_stall_ms"], 1),
        "stall_ratio": round(base["max_stall_ms"] / max(pool["max_stall_ms"], 1e-3), 1),
    }))


if __name__ == "__main__":
    asyncio.run(main())
