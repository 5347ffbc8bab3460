"""The gateway's cost: the calc workload as a HarnessEnv (an OpenAI-SDK agent) vs the native ToolEnv.

Same tasks, same policy, the same prompts (the native env renders the agent's own tool
schema), one episode = call the calculator, then answer:

- ``native``: the built-in calc env driven by the episode loop;
- ``in-process``: ``examples/harness`` with ``form = "agent"``: the agent's ``AsyncOpenAI``
  client calls the episode's gateway in this process (no HTTP hop, the same routes and keys);
- ``subprocess``: ``examples/harness`` with ``form = "command"``: one Python process per
  episode (interpreter start and ``import openai`` included), talking HTTP to the gateway;
- ``in-process-raw`` (scripted policy only): the in-process agent loop speaking JSON over
  aiohttp instead of the SDK: the gateway's own cost, without the SDK's.

Two policies (``--policy``, default both):

- ``engine`` — the workload a user runs: the embedded engine serving the tiny model, started
  as ``agentrl run`` starts it (``open_engines``), on the warm start of
  ``examples/harness/harness.toml`` (built and cached like ``agentrl run`` does, under
  ``runs/models/`` of the current directory; or ``--model DIR``), sampling as that config's
  rollouts do but at ``--temperature`` (default 0: greedy, so every form gets the same
  episodes; the table says how many episodes' sampled ids equal the native form's).  The forms
  alternate for ``--rounds`` rounds on the same tasks (each round in a rotated order).  CPU per
  episode counts this process, the engine process and the subprocess agents (each reports its
  own at exit: bwrap reaps it inside its pid namespace, out of this process's sight; bwrap's own
  few milliseconds are not counted).
- ``scripted`` — overhead isolation: a scripted ChatML policy answering every call after
  ``--latency-ms``, so the engine costs no CPU and the difference between forms is agentrl's
  and the SDK's own work (HTTP, request building and parsing, rendering, joining sequences,
  process start).  Every episode must score 1.

Per form: episodes/s, model calls and sampled tokens per episode (equal work: a form whose
episodes ran longer shows it here; sampled tokens/s compares them anyway), CPU ms per episode
(``engine ms``: the engine's part), reward (the subprocess form runs only the first
``--subprocess-episodes`` tasks, so its mean is over fewer), and ``= native``: the share of its
episodes whose sampled ids equal the native form's on the same task.  Last line: JSON with both policies' numbers and the ratios to native measured in this
run (the goal: in-process ≥ 0.8× native episodes/s on the engine policy).  Wall-clock numbers
on a shared machine are noisy; the ratios are measured side by side in one run.

    python benchmarks/harness_overhead.py [--policy both|engine|scripted] [--rounds 3]
        [--episodes 128 --subprocess-episodes 32 --concurrency 32] [--model DIR --temperature 0]
        [--latency-ms 20]

What was looked at (scripted policy, a loaded 2-core machine): the in-process form cost about
4.4 ms of CPU per episode above native (5.5 vs 1.1).  cProfile of it: the ``openai`` SDK's own
work (request building in ``_transform``, its httpx client, response parsing) about two thirds
of the process's time, rendering and sampling (the policy's, which native does too) about a
fifth.  The gateway alone (``Gateway.call`` with a null tokenizer and policy: request checks,
joining, recording, the reply, both sides' JSON) costs about 0.2 ms of CPU per two-call
episode.  So the scripted ratio is the SDK's cost, the user's program; nothing on agentrl's
side of the hop would move it much, and nothing there was cut.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentrl.envs import ScriptedClient
from agentrl.plugins import load_environment
from agentrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "harness")
CONFIG = ROOT / "examples" / "harness" / "harness.toml"
sys.path.insert(0, EXAMPLE)
from calc_agent import MAX_CALLS, TOOLS, calculator  # noqa: E402


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


# ----------------------------------------------------------------------------- CPU accounting

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_self() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


# The subprocess form's agents report their own CPU: under bwrap's pid namespace the program is
# reaped inside the namespace and never reaches this process's RUSAGE_CHILDREN.  The wrapper runs
# calc_agent.py in its own interpreter (runpy: no second process) and writes its CPU at exit.
CPU_DIR_ENV = "HARNESS_BENCH_CPU_DIR"
AGENT_CPU = """
import os, resource, runpy, sys, tempfile
path = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(path, run_name="__main__")
finally:
    cpu = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    fd, _ = tempfile.mkstemp(dir=os.environ["HARNESS_BENCH_CPU_DIR"])
    os.write(fd, repr(cpu).encode())
    os.close(fd)
"""


def agents_cpu(folder: Path) -> float:
    """CPU seconds the subprocess agents reported (and forget them)."""
    total = 0.0
    for f in folder.iterdir():
        total += float(f.read_text() or 0)
        f.unlink()
    return total


def _proc_cpu(pid: int) -> float:
    """CPU seconds of a live process (and its reaped children), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = stat[stat.rfind(")") + 2 :].split()  # fields from 3 on: utime is field 14, cstime 17
    return sum(int(x) for x in f[11:15]) / TICK


def _descendants(pids: list[int]) -> list[int]:
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    out, todo = list(pids), list(pids)
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


class Clock:
    """Wall and CPU seconds of one measurement: this process, the agents it started, the engines."""

    def __init__(self, engine_pids: list[int], agents: Path | None) -> None:
        self.engine_pids = _descendants(engine_pids) if engine_pids else []
        self.agents = agents

    def engine_cpu(self) -> float:
        return sum(_proc_cpu(p) for p in self.engine_pids)

    def __enter__(self) -> Clock:
        if self.agents is not None:
            agents_cpu(self.agents)
        self.t0, self.c0, self.e0 = time.perf_counter(), _cpu_self(), self.engine_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu_here = _cpu_self() - self.c0 + (agents_cpu(self.agents) if self.agents is not None else 0.0)
        self.cpu_engine = self.engine_cpu() - self.e0


# ----------------------------------------------------------------------------- one form, one round


async def measure(env, client, tasks, sampling: SamplingParams, max_turns: int, concurrency: int,
                  engine_pids: list[int]) -> dict:  # fmt: skip
    gate = asyncio.Semaphore(concurrency)

    async def one(task):
        async with gate:
            traj = await env.rollout(client, task, sampling, max_turns=max_turns)
            await env.rubric.score(traj)
            return traj

    with Clock(engine_pids, getattr(env, "cpu_dir", None)) as clock:
        trajs = await asyncio.gather(*(one(t) for t in tasks))
    sampled = [[i for turn in t.turns for i in turn.completion_ids] for t in trajs]
    return {
        "episodes": len(trajs), "wall_s": clock.wall, "cpu_here_s": clock.cpu_here, "cpu_engine_s": clock.cpu_engine,
        "calls": sum(len(t.turns) for t in trajs), "sampled_tokens": sum(map(len, sampled)),
        "prompt_tokens": sum(turn.prompt_len for t in trajs for turn in t.turns),
        "reward": sum(t.reward or 0.0 for t in trajs), "errors": [t.error for t in trajs if t.error],
        "episode_s": [t.timing["total_s"] for t in trajs],
        "ids": {t.task.id: sampled[k] for k, t in enumerate(trajs)},
    }  # fmt: skip


def summarize(runs: list[dict], native_ids: dict | None) -> dict:
    """One form over its rounds: totals, per-episode means, and how many episodes equal native's."""
    n, wall = sum(r["episodes"] for r in runs), sum(r["wall_s"] for r in runs)
    cpu_here, cpu_engine = sum(r["cpu_here_s"] for r in runs), sum(r["cpu_engine_s"] for r in runs)
    sampled = sum(r["sampled_tokens"] for r in runs)
    out = {
        "episodes": n, "episodes_per_s": n / wall, "episode_s": statistics.mean(s for r in runs for s in r["episode_s"]),
        "calls_per_episode": sum(r["calls"] for r in runs) / n, "sampled_tokens_per_episode": sampled / n,
        "prompt_tokens_per_episode": sum(r["prompt_tokens"] for r in runs) / n, "sampled_tokens_per_s": sampled / wall,
        "cpu_ms_per_episode": 1e3 * (cpu_here + cpu_engine) / n, "engine_cpu_ms_per_episode": 1e3 * cpu_engine / n,
        "reward_mean": sum(r["reward"] for r in runs) / n, "errors": sum(len(r["errors"]) for r in runs),
    }  # fmt: skip
    if native_ids is not None:
        ids = runs[-1]["ids"]
        out["same_as_native"] = sum(ids[k] == native_ids.get(k) for k in ids) / len(ids)
    return out


async def compare(forms: dict, client, sampling: SamplingParams, max_turns: int, args, engine_pids: list[int],
                  scripted: bool) -> dict[str, dict]:  # fmt: skip
    """Every form on the same tasks, alternating for ``args.rounds`` rounds (rotated order)."""
    runs: dict[str, list[dict]] = {name: [] for name in forms}
    try:
        for env, tasks in forms.values():  # warm-up, untimed: imports (openai: ~3 s), servers, caches
            await measure(env, client, tasks[:1], sampling, max_turns, 1, [])
        names = list(forms)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                env, tasks = forms[name]
                got = await measure(env, client, tasks, sampling, max_turns, args.concurrency, engine_pids)
                bad = got["errors"] or ([] if not scripted else [f"reward {got['reward']}"] * (got["reward"] != len(tasks)))
                if bad and (scripted or len(bad) > len(tasks) // 10):
                    raise SystemExit(f"{name}: {len(bad)} of {len(tasks)} episodes failed, e.g. {bad[0]}")
                runs[name].append(got)
                print(f"  round {r + 1}/{args.rounds} {name:<15} {got['episodes'] / got['wall_s']:8.2f} episodes/s",
                      flush=True)  # fmt: skip
    finally:
        for env, _ in forms.values():
            await env.close()
            if getattr(env, "cpu_dir", None) is not None:
                shutil.rmtree(env.cpu_dir, ignore_errors=True)
        if "session" in _HTTP:
            await _HTTP.pop("session").close()
            _HTTP.clear()
    native = runs["native"][-1]["ids"]
    return {name: summarize(rs, None if name == "native" else native) for name, rs in runs.items()}


def report(title: str, results: dict[str, dict]) -> dict:
    """Print one policy's table; return its JSON part with the ratios to native."""
    print(f"\n{title}")
    print(f"{'form':<15} {'episodes':>8} {'episodes/s':>11} {'calls/ep':>9} {'tokens/ep':>10} {'tokens/s':>9} "
          f"{'CPU ms/ep':>10} {'engine ms':>10} {'reward':>7} {'= native':>9}")  # fmt: skip
    for name, r in results.items():
        same = f"{r['same_as_native']:.0%}" if "same_as_native" in r else "-"
        print(f"{name:<15} {r['episodes']:>8} {r['episodes_per_s']:>11.2f} {r['calls_per_episode']:>9.2f} "
              f"{r['sampled_tokens_per_episode']:>10.1f} {r['sampled_tokens_per_s']:>9.0f} {r['cpu_ms_per_episode']:>10.1f} "
              f"{r['engine_cpu_ms_per_episode']:>10.1f} {r['reward_mean']:>7.3f} {same:>9}")  # fmt: skip
    native = results["native"]
    out: dict = {}
    for name, r in results.items():
        key = name.replace("-", "_")
        out[key] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
        if name == "native":
            continue
        out[f"{key}_ratio"] = round(r["episodes_per_s"] / native["episodes_per_s"], 3)
        out[f"{key}_tokens_per_s_ratio"] = round(r["sampled_tokens_per_s"] / native["sampled_tokens_per_s"], 3)
        out[f"{key}_cpu_ratio"] = round(r["cpu_ms_per_episode"] / native["cpu_ms_per_episode"], 3)
        out[f"{key}_overhead_cpu_ms_per_episode"] = round(r["cpu_ms_per_episode"] - native["cpu_ms_per_episode"], 2)
        out[f"{key}_overhead_s_per_episode"] = round(r["episode_s"] - native["episode_s"], 4)
    return out


# ----------------------------------------------------------------------------- the two policies


def make_forms(calc: dict, episodes: int, subprocess_episodes: int, raw: bool) -> dict:
    native = load_environment("calc", show_tools=True, **calc)
    native.tool_schemas = lambda: TOOLS  # the prompt the agent sends, token for token
    tasks = list(native.eval_dataset())
    forms = {
        "native": (native, tasks[:episodes]),
        "in-process": (load_environment(EXAMPLE, form="agent", **calc), tasks[:episodes]),
        "subprocess": (load_environment(EXAMPLE, form="command", **calc), tasks[:subprocess_episodes]),
    }
    sub = forms["subprocess"][0]
    sub.cpu_dir = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    sub.command = [sub.command[0], "-c", AGENT_CPU, *sub.command[1:]]
    sub.extra_env[CPU_DIR_ENV] = str(sub.cpu_dir)
    if not subprocess_episodes:
        del forms["subprocess"]
    if raw:
        forms["in-process-raw"] = (load_environment(EXAMPLE, form="agent", **calc), tasks[:episodes])
        forms["in-process-raw"][0].agent = raw_agent
    return forms


async def scripted(args) -> dict:
    calc = dict(num_train=16, num_eval=max(args.episodes, args.subprocess_episodes))
    forms = make_forms(calc, args.episodes, args.subprocess_episodes, raw=True)
    sampling = SamplingParams(max_tokens=200)
    print(f"scripted policy ({args.latency_ms:g} ms per call): {args.rounds} rounds", flush=True)
    results = await compare(forms, LatencyClient(args.latency_ms / 1000), sampling, MAX_CALLS, args, [], True)
    out = report(f"scripted policy, {args.latency_ms:g} ms per call (overhead isolation: the engine costs no CPU)",
                 results)  # fmt: skip
    return {"latency_ms": args.latency_ms, **out}


def engine_model(args, cfg) -> Path:
    if args.model:
        return Path(args.model)
    from agentrl.recipes.sft import warm_start

    print(f"warm start of {CONFIG.relative_to(ROOT)} (cached under {cfg.model.path}-sft-*; built on first use)", flush=True)
    return warm_start(cfg)


async def engine(args) -> dict:
    from agentrl.config import load_config
    from agentrl.recipes.engines import open_engines
    from agentrl.recipes.rl import torch_threads

    cfg = load_config([CONFIG], {"env": {"name": EXAMPLE}})
    model = await asyncio.to_thread(engine_model, args, cfg)
    calc = {k: v for k, v in cfg.env.args.items() if k != "form"}
    calc.update(num_train=16, num_eval=max(args.episodes, args.subprocess_episodes))
    forms = make_forms(calc, args.episodes, args.subprocess_episodes, raw=False)
    sampling = dataclasses.replace(cfg.rollout.sampling(), temperature=args.temperature, seed=0)
    max_turns = cfg.rollout.max_turns or MAX_CALLS
    print(f"engine policy: {model} on the embedded engine, temperature {args.temperature:g}, "
          f"{args.rounds} rounds", flush=True)  # fmt: skip
    engines = await asyncio.to_thread(open_engines, cfg, model, torch_threads(cfg))
    try:
        pids = [e.proc.pid for e in engines.policy.engines]
        results = await compare(forms, engines.client, sampling, max_turns, args, pids, False)
    finally:
        await engines.close()
    out = report(f"engine policy ({model.name}, temperature {args.temperature:g}; CPU includes the engine's)", results)
    return {"model": str(model), "temperature": args.temperature, "rounds": args.rounds, **out}


async def main(args) -> None:
    out: dict = {"goal": "engine.in_process_ratio >= 0.8", "concurrency": args.concurrency}
    if args.policy in ("scripted", "both"):
        out["scripted"] = await scripted(args)
    if args.policy in ("engine", "both"):
        out["engine"] = await engine(args)
        out["in_process_ratio"] = out["engine"]["in_process_ratio"]
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=["both", "engine", "scripted"], default="both", help="which policy drives the forms")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all forms, alternating")
    p.add_argument("--episodes", type=int, default=128, help="episodes of the native and in-process forms per round")
    p.add_argument("--subprocess-episodes", type=int, default=32, help="episodes of the subprocess form per round (0: skip it)")
    p.add_argument("--concurrency", type=int, default=32, help="episodes in flight")
    p.add_argument("--latency-ms", type=float, default=20.0, help="scripted policy: its latency per call")
    p.add_argument("--model", default=None, help="engine policy: a model dir (default: the harness example's warm start)")
    p.add_argument("--temperature", type=float, default=0.0, help="engine policy: sampling temperature (0: greedy)")
    asyncio.run(main(p.parse_args()))
