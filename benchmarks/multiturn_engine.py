"""Multi-turn tool workload on the embedded engine: prefix cache on vs off (same model, same run).

Each task has a system prompt (tool schemas, ``--system-tokens``) and a task prompt; a group
of ``--group`` episodes runs on it.  An episode makes ``--turns`` model calls; after each call
but the last, a ``--tool-tokens``-token tool output is appended, so turn k's prompt is turn
k−1's prompt + its completion + the tool output (what the episode loop sends).  All episodes
run concurrently against one in-process :class:`~agentrl.inference.engine.Engine`, once with
``enable_prefix_caching=False`` (what every turn cost before: the whole conversation is
prefilled) and once with the prefix cache, alternating ``--repeats`` times (the cache is
reset before each run; the median run is reported).

Counted per run: prompt tokens served, tokens actually prefilled (the engine's counter),
completion tokens, wall time.  Throughput is served (prompt + completion) tokens per second;
both runs serve the same tokens, so the throughput ratio is the wall-time ratio.

Prints a table and, last, a JSON line.  Goals (issue 10): throughput ratio ≥ 2, prefill
tokens with the cache ≤ 0.35 × without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentrl.inference.engine import Engine
from agentrl.inference.sampling import EngineSampling
from agentrl.tiny_model import build_family_model


def workload(args) -> list[tuple[list[int], list[list[int]]]]:
    """Per episode: (first prompt, the tool outputs appended after each turn but the last)."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    system = draw(args.system_tokens)
    episodes = []
    for _ in range(args.tasks):
        prompt = system + draw(args.task_tokens)
        for _ in range(args.group):
            # the tool output is framed by template tokens (end of assistant turn, tool role, ...)
            episodes.append((prompt, [draw(4) + draw(args.tool_tokens) + draw(4) for _ in range(args.turns - 1)]))
    return episodes


async def episode(engine: Engine, prompt: list[int], tools: list[list[int]], args, seed: int) -> tuple[int, int]:
    served = completed = 0
    for turn in range(args.turns):
        sp = EngineSampling(max_tokens=args.completion_tokens, temperature=1.0, seed=seed * 10 + turn, ignore_eos=True)
        result = (await asyncio.wrap_future(engine.submit(prompt, sp)))[0]
        served += len(prompt)
        completed += len(result.token_ids)
        if turn < args.turns - 1:
            prompt = prompt + result.token_ids + tools[turn]
    return served, completed


def run(engine: Engine, episodes, args) -> dict[str, float]:
    if engine.prefix is not None:
        engine.reset_prefix_cache()
    prefill0, hit0 = engine.prefill_tokens, engine.prefix_hit_tokens

    async def all_episodes():
        return await asyncio.gather(*(episode(engine, p, t, args, i) for i, (p, t) in enumerate(episodes)))

    t0 = time.perf_counter()
    counts = asyncio.run(all_episodes())
    seconds = time.perf_counter() - t0
    prompt = sum(c[0] for c in counts)
    completion = sum(c[1] for c in counts)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt,
        "prefill_tokens": engine.prefill_tokens - prefill0,
        "prefix_hit_tokens": engine.prefix_hit_tokens - hit0,
        "completion_tokens": completion,
        "tok_s": (prompt + completion) / seconds,
        "completion_tok_s": completion / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="HF model dir (default: build a small random Llama)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1, help="grouped-query attention, as Llama 3 / Qwen2.5 / Mistral")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group", type=int, default=8, help="episodes per task (G)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=200, help="shared system prompt (tool schemas)")
    ap.add_argument("--task-tokens", type=int, default=40)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--completion-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model_dir or build_family_model(
        Path(tmp.name) / "m", "llama", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        initializer_range=0.02, max_position_embeddings=4096,
    )  # fmt: skip
    episodes = workload(args)
    longest = max(len(p) + sum(map(len, t)) for p, t in episodes) + args.turns * args.completion_tokens
    common = {"device": args.device, "max_batch_size": len(episodes), "max_model_len": longest + 8}
    engines = {
        "without cache": Engine(model_dir, enable_prefix_caching=False, **common),
        "with cache": Engine(model_dir, enable_prefix_caching=True, **common),
    }
    try:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        run(engines["with cache"], episodes[: args.group], args)  # warm-up both (first-call allocations)
        run(engines["without cache"], episodes[: args.group], args)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(run(engine, episodes, args))
    finally:
        for engine in engines.values():
            engine.close()

    med = {name: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for name, rs in runs.items()}
    off, on = med["without cache"], med["with cache"]
    print(f"{len(episodes)} episodes ({args.tasks} tasks x G={args.group}), {args.turns} turns, "
          f"{args.tool_tokens}-token tool outputs, {args.completion_tokens}-token completions")  # fmt: skip
    print(f"{'':16}{'seconds':>9}{'prompt':>9}{'prefilled':>11}{'cache hits':>12}{'tok/s':>9}{'compl tok/s':>13}")
    for name, r in med.items():
        print(f"{name:16}{r['seconds']:>9.2f}{r['prompt_tokens']:>9}{r['prefill_tokens']:>11}"
              f"{r['prefix_hit_tokens']:>12}{r['tok_s']:>9.0f}{r['completion_tok_s']:>13.0f}")  # fmt: skip
    speedup = on["tok_s"] / off["tok_s"]
    prefill_ratio = on["prefill_tokens"] / off["prefill_tokens"]
    spread = {name: statistics.pstdev(r["seconds"] for r in rs) for name, rs in runs.items()}
    print(f"throughput with / without cache = {speedup:.2f}x (goal >= 2x); "
          f"prefill tokens with / without = {prefill_ratio:.3f} (goal <= 0.35)")  # fmt: skip
    print(json.dumps({
        "speedup": round(speedup, 3), "prefill_ratio": round(prefill_ratio, 4),
        "tok_s_with_cache": round(on["tok_s"], 1), "tok_s_without_cache": round(off["tok_s"], 1),
        "prefill_tokens_with_cache": on["prefill_tokens"], "prefill_tokens_without_cache": off["prefill_tokens"],
        "prompt_tokens": off["prompt_tokens"], "completion_tokens": off["completion_tokens"],
        "seconds_stdev": {k: round(v, 3) for k, v in spread.items()}, "episodes": len(episodes),
        "turns": args.turns, "tool_tokens": args.tool_tokens, "device": args.device, "threads": args.threads,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
