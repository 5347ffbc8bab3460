"""The gateway's cost: the calc workload as a HarnessEnv (an OpenAI-SDK agent) vs the native ToolEnv.

Same tasks, same policy, same two model calls per episode (call the calculator, then answer):

- ``native``: the built-in calc env (``show_tools = true``: the tools are rendered, as the
  agent sends them), driven by the episode loop;
- ``in-process``: ``examples/harness`` with ``form = "agent"``: the agent's ``AsyncOpenAI``
  client calls the episode's gateway over loopback HTTP, in the same event loop;
- ``subprocess``: ``examples/harness`` with ``form = "command"``: one Python process per
  episode (interpreter start and ``import openai`` included);
- ``in-process-raw``: the same agent loop speaking JSON over aiohttp instead of the SDK: the
  gateway's own cost, without the SDK's request building and parsing.

The policy is a scripted ChatML client (agentrl's checker client) that answers every call
after a fixed latency (``--latency-ms``, an engine's), so the difference is agentrl's own
work: HTTP, the SDK, rendering, joining sequences, process start.  Every episode must score 1.
Prints episodes/s per form, the mean wall time per episode and the CPU time per episode
(this process and the agents it started: steadier than wall time on a shared machine);
last line: JSON with the ratios to native (goal: in-process ≥ 0.8×) and the overheads.

    python benchmarks/harness_overhead.py [--episodes 128 --concurrency 32 --latency-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import statistics
import time
from pathlib import Path

from agentrl.envs import ScriptedClient
from agentrl.plugins import load_environment
from agentrl.types import SamplingParams

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "harness")


def solver(prompt: str) -> str:
    if "<|im_start|>tool\n" in prompt:
        return "It is " + prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    a, op, b = re.findall(r"What is (\d+)([-+*])(\d+)\?", prompt)[-1]
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}})}\n</tool_call>'


class LatencyClient(ScriptedClient):
    """The scripted policy, answering each call after ``latency`` seconds (an engine's)."""

    def __init__(self, latency: float) -> None:
        super().__init__(solver)
        self.latency = latency

    async def complete(self, prompt_ids, sampling, n=1):
        await asyncio.sleep(self.latency)
        self.prompts.clear()  # keep memory flat
        return await super().complete(prompt_ids, sampling, n)


_HTTP: dict = {}


async def raw_agent(client, task: dict) -> str:
    """calc_agent.asolve over plain aiohttp (one session per loop), for the gateway's own cost."""
    import aiohttp
    from calc_agent import MAX_CALLS, TOOLS, calculator

    loop = asyncio.get_running_loop()
    if _HTTP.get("loop") is not loop:
        _HTTP.update(loop=loop, session=aiohttp.ClientSession())
    url, headers = str(client.base_url).rstrip("/") + "/chat/completions", {"Authorization": f"Bearer {client.api_key}"}
    messages = list(task["prompt"])
    for _ in range(MAX_CALLS):
        body = {"model": "policy", "messages": messages, "tools": TOOLS}
        async with _HTTP["session"].post(url, json=body, headers=headers) as r:
            message = (await r.json())["choices"][0]["message"]
        if not message.get("tool_calls"):
            return message["content"]
        messages.append(message)
        for call in message["tool_calls"]:
            result = calculator(json.loads(call["function"]["arguments"])["expression"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": result})
    return ""


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the subprocess form's agents):
    on a shared machine a steadier measure than wall time."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def measure(env, tasks, concurrency: int, latency: float) -> dict:
    client, gate = LatencyClient(latency), asyncio.Semaphore(concurrency)
    sampling = SamplingParams(max_tokens=200)

    async def one(task):
        async with gate:
            traj = await env.rollout(client, task, sampling)
            await env.rubric.score(traj)
            return traj

    try:
        await one(tasks[0])  # warm-up, untimed: imports (openai: ~3 s), the gateway's server, caches
        t0, c0 = time.perf_counter(), _cpu()
        trajs = await asyncio.gather(*(one(t) for t in tasks))
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    finally:
        await env.close()
    bad = [t.error or f"reward {t.reward}" for t in trajs if t.error or t.reward != 1.0]
    if bad:
        raise SystemExit(f"{env.name}: {len(bad)} episodes failed, e.g. {bad[0]}")
    return {"episodes_per_s": len(tasks) / wall, "cpu_ms": 1e3 * cpu / len(tasks), "episode_s": statistics.mean(t.timing["total_s"] for t in trajs),
            "episodes": len(tasks)}  # fmt: skip


async def main(args) -> None:
    calc = dict(num_train=16, num_eval=max(args.episodes, args.subprocess_episodes))
    native_env = load_environment("calc", show_tools=True, max_turns=2, **calc)
    tasks = list(native_env.eval_dataset())
    forms = {
        "native": (native_env, tasks[: args.episodes]),
        "in-process": (load_environment(EXAMPLE, form="agent", **calc), tasks[: args.episodes]),
        "subprocess": (load_environment(EXAMPLE, form="command", **calc), tasks[: args.subprocess_episodes]),
        "in-process-raw": (load_environment(EXAMPLE, form="agent", **calc), tasks[: args.episodes]),
    }
    if not args.subprocess_episodes:
        del forms["subprocess"]
    forms["in-process-raw"][0].agent = raw_agent
    results = {}
    for name, (env, ts) in forms.items():
        results[name] = await measure(env, ts, args.concurrency, args.latency_ms / 1000)
    if "session" in _HTTP:
        await _HTTP["session"].close()
    print(f"{'form':<15} {'episodes':>8} {'episodes/s':>11} {'s/episode':>10} {'CPU ms/episode':>15}")
    for name, r in results.items():
        print(f"{name:<15} {r['episodes']:>8} {r['episodes_per_s']:>11.2f} {r['episode_s']:>10.3f} {r['cpu_ms']:>15.1f}")
    native = results["native"]
    out = {
        "latency_ms": args.latency_ms, "concurrency": args.concurrency,
        **{f"{k.replace('-', '_')}_episodes_per_s": round(r["episodes_per_s"], 3) for k, r in results.items()},
        "in_process_ratio": round(results["in-process"]["episodes_per_s"] / native["episodes_per_s"], 3),
        "in_process_raw_ratio": round(results["in-process-raw"]["episodes_per_s"] / native["episodes_per_s"], 3),
        **{f"{k.replace('-', '_')}_cpu_ms_per_episode": round(r["cpu_ms"], 2) for k, r in results.items()},
        "in_process_overhead_s_per_episode": round(results["in-process"]["episode_s"] - native["episode_s"], 3),
    }  # fmt: skip
    if "subprocess" in results:
        sub = results["subprocess"]
        out["subprocess_ratio"] = round(sub["episodes_per_s"] / native["episodes_per_s"], 3)
        out["subprocess_overhead_s_per_episode"] = round(sub["episode_s"] - native["episode_s"], 3)
        out["subprocess_overhead_cpu_ms_per_episode"] = round(sub["cpu_ms"] - native["cpu_ms"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=128, help="episodes of the native and in-process forms")
    p.add_argument("--subprocess-episodes", type=int, default=32, help="episodes of the subprocess form (0: skip it)")
    p.add_argument("--concurrency", type=int, default=32, help="episodes in flight")
    p.add_argument("--latency-ms", type=float, default=20.0, help="the policy's latency per call")
    asyncio.run(main(p.parse_args()))
