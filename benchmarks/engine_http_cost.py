"""What the HTTP front end costs the embedded engine: tokens/s with the server in the engine's process vs none.

The embedded engine's HTTP server (uvicorn + FastAPI, :mod:`agentrl.inference.server`) runs in
the engine's process, so parsing requests and writing responses take the GIL from the engine's
step.  Moving the front end into a process of its own can at most win back what the front end
costs; this script measures that ceiling, and with ``--split`` the real thing:

- **http**: the engine as agentrl starts it (:func:`agentrl.inference.start_embedded_engine`),
  ``--requests`` concurrent ``/v1/completions`` over HTTP, each asking what agentrl's
  :class:`~agentrl.inference.PolicyClient` asks in a run (token-id prompt, μ logprobs, token ids);
- **split** (``--split``): the same, with ``server_process = "split"``: the HTTP front end and the
  engine core in two processes (:mod:`agentrl.inference.core`); its CPU is both processes', and
  the core's alone is printed too (the process whose one core bounds the model loop);
- **direct**: the same engine settings in a process of its own with no server at all, the same
  prompts handed to :meth:`Engine.submit` (what a front end in another process would do, at no
  cost for the transport).  ``--no-direct`` leaves it out.

All are up at once; ``--rounds`` rounds alternate between them (each side going first in turn),
each round ``--requests`` prompts of ``--prompt-tokens`` random ids, exactly ``--new-tokens`` new
tokens each (``ignore_eos``), the same prompts for every side.  ``--steady SECONDS``: instead of
one burst, each of ``--requests`` clients sends its next request as soon as its last one is
answered, for SECONDS (requests arrive while the engine decodes, as in a run).  Measures, median
over rounds: wall-clock tokens/s (noisy on a shared host), the CPU seconds the side's processes
spent per 1,000 tokens (``/proc``: user + system, every thread; steadier under load) and tokens
per engine step (how full the steps were).

    python benchmarks/engine_http_cost.py [--model DIR] [--rounds 5] [--threads 1] [--new-tokens 64]
    python benchmarks/engine_http_cost.py --split [--steady 15 --new-tokens 16]

``--new-tokens 8``: RL-sized turns, where a request's fixed cost weighs 8x more per token.

Prints a table and, last, a JSON line with ``direct_over_http`` (direct ÷ http tokens/s) and
``http_cpu_over_direct`` (http ÷ direct CPU seconds per token): the most a front end in a process
of its own could win back; near 1, it does not pay.  With ``--split``: ``split_over_http`` (the
median over rounds of split ÷ http tokens/s, both measured in the same round) and
``split_core_cpu_over_http`` (the core's CPU per token ÷ the one-process engine's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from completions_round import completions_round, workload

from agentrl.inference import start_embedded_engine

KEY = "arl-benchmark-key-not-secret"
RUN_BODY = {"logprobs": 0, "return_token_ids": True}  # what PolicyClient asks for in a run, besides the tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def direct_steady(engine, job: dict) -> int:
    """``--steady`` without a server: each client submits its next prompt from the previous one's
    done-callback, until the deadline; returns the tokens generated."""
    from agentrl.inference.sampling import EngineSampling

    deadline, left, lock, tokens = time.perf_counter() + job["steady"], threading.Semaphore(0), threading.Lock(), [0]

    def client(rng: random.Random, f=None) -> None:
        if f is not None:
            with lock:
                tokens[0] += len(f.result()[0].token_ids)
        if time.perf_counter() >= deadline:
            left.release()
            return
        prompt = [rng.randrange(3, job["vocab"]) for _ in range(job["prompt_tokens"])]
        nxt = engine.submit(prompt, EngineSampling(max_tokens=job["new_tokens"], temperature=1.0, ignore_eos=True))
        nxt.add_done_callback(lambda f: client(rng, f))

    for i in range(job["requests"]):
        client(random.Random(f"{job['seed']}-{i}"))
    for _ in range(job["requests"]):
        left.acquire()
    return tokens[0]


def direct_worker(model_dir: str, batch: int, max_len: int, dtype: str) -> None:
    """``--direct-worker``: an engine with no server; each stdin line is a round (JSON prompts + tokens)."""
    from agentrl.inference.engine import Engine
    from agentrl.inference.engine_args import EngineArgs
    from agentrl.inference.sampling import EngineSampling

    engine = Engine(model_dir, EngineArgs(max_batch_size=batch, max_model_len=max_len, device="cpu", dtype=dtype))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        if job.get("steady"):
            tokens = direct_steady(engine, job)
        else:
            futures = [engine.submit(p, EngineSampling(max_tokens=job["new_tokens"], temperature=1.0, ignore_eos=True))
                       for p in job["prompts"]]  # fmt: skip
            tokens = sum(len(r.token_ids) for f in futures for r in f.result())
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": tokens, "steps": engine.steps}), flush=True)
    engine.close()


async def http_steady(root_url: str, model: str, job: dict) -> tuple[float, int]:
    """``--steady``: ``requests`` clients, each sending its next prompt as soon as its last one
    is answered, until ``steady`` seconds have passed (then the ones in flight finish)."""
    limits = httpx.Limits(max_connections=job["requests"] + 1, max_keepalive_connections=job["requests"] + 1)
    async with httpx.AsyncClient(base_url=root_url, timeout=1800, limits=limits,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:  # fmt: skip
        t0 = time.perf_counter()
        deadline = t0 + job["steady"]

        async def client(i: int) -> int:
            rng, tokens = random.Random(f"{job['seed']}-{i}"), 0
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(3, job["vocab"]) for _ in range(job["prompt_tokens"])]
                r = await http.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": job["new_tokens"], "temperature": 1.0,
                    "ignore_eos": True, "logprobs": 0, "return_token_ids": True,
                })  # fmt: skip
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
            return tokens

        counts = await asyncio.gather(*(client(i) for i in range(job["requests"])))
        return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: build agentrl's default tiny model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--split", action="store_true",
                    help="also an engine with server_process=split (HTTP front end and engine core in two processes)")
    ap.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                    help="rounds of SECONDS with --requests clients each sending its next request when its last is "
                         "answered (arrivals while the engine decodes, as in a run), instead of one burst per round")
    ap.add_argument("--no-direct", action="store_true", help="leave out the direct side (with --split: split vs same only)")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds the engine may take to start")
    ap.add_argument("--direct-worker", nargs=4, metavar=("MODEL", "BATCH", "MAX_LEN", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    # a kill unwinds the with-blocks: no engine or vllm serve outlives this script
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.direct_worker:
        m, b, n, d = args.direct_worker
        return direct_worker(m, int(b), int(n), d)

    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    max_len = args.prompt_tokens + args.new_tokens + 16
    worker = None
    with tempfile.TemporaryDirectory(prefix="engine-http-cost-") as tmp, contextlib.ExitStack() as stack:
        if args.model:
            model_dir = Path(args.model)
        else:
            from agentrl.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny")
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if not args.no_direct:
            worker = subprocess.Popen(
                [sys.executable, __file__, "--direct-worker", str(model_dir), str(args.requests), str(max_len),
                 args.dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **threads},
            )  # fmt: skip

            @stack.callback
            def _end_worker() -> None:  # it ends at the end of its input, or now if a round is still running
                worker.stdin.close()
                if worker.poll() is None:
                    worker.terminate()
                worker.wait()

        def engine(mode: str):
            return stack.enter_context(start_embedded_engine(
                model_dir, api_key=KEY, max_batch_size=args.requests, max_model_len=max_len, device="cpu",
                dtype=args.dtype, env=threads, startup_timeout=args.startup_timeout, server_process=mode))  # fmt: skip

        def over_http(eng):
            def run(p: list[list[int]], n: int, steady: dict | None = None) -> tuple[float, int]:
                if steady:
                    seconds, tokens = asyncio.run(http_steady(eng.root_url, eng.model, steady))
                else:
                    seconds, tokens = asyncio.run(completions_round(eng.root_url, eng.model, KEY, p, n, RUN_BODY))
                metrics = httpx.get(f"{eng.root_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).json()
                steps[id(run)] = metrics["steps"]
                return seconds, tokens

            return run

        sides: dict = {}
        steps: dict[int, int] = {}  # engine steps so far, by side function (model forwards: fewer, fuller is cheaper)
        pids: dict[str, list[int]] = {}  # the processes whose CPU a side spends
        eng = engine("same")
        sides["http"], pids["http"] = over_http(eng), [eng.proc.pid]
        if args.split:
            eng = engine("split")
            sides["split"], pids["split"] = over_http(eng), [eng.proc.pid, *children(eng.proc.pid)]
            assert len(pids["split"]) == 2, f"the split engine should have one core process: {pids['split']}"
        if worker is not None:
            assert json.loads(worker.stdout.readline())["ready"]

            def direct(prompts: list[list[int]], new_tokens: int, steady: dict | None = None) -> tuple[float, int]:
                worker.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens, **(steady or {})}) + "\n")
                worker.stdin.flush()
                done = json.loads(worker.stdout.readline())
                steps[id(direct)] = done["steps"]
                return done["seconds"], done["tokens"]

            sides["direct"], pids["direct"] = direct, [worker.pid]
        warm = workload(vocab, min(8, args.requests), args.prompt_tokens, 10**6)
        for run in sides.values():  # warm-up
            run(warm, 8)
        tps: dict[str, list[float]] = {side: [] for side in sides}
        cpu_k: dict[str, list[float]] = {side: [] for side in sides}  # CPU s per 1k tokens, the side's processes
        core_k: list[float] = []  # of split's: its core process alone
        per_step: dict[str, list[float]] = {side: [] for side in sides}  # tokens per engine step
        order = list(sides)
        for k in range(args.rounds):
            prompts = workload(vocab, args.requests, args.prompt_tokens, seed=k)
            for side in order[k % len(order):] + order[: k % len(order)]:  # each side goes first in turn
                cpu0, steps0 = [cpu_seconds(p) for p in pids[side]], steps[id(sides[side])]
                steady = {"steady": args.steady, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens, "vocab": vocab, "seed": k} if args.steady else None
                seconds, tokens = sides[side](prompts, args.new_tokens, steady)
                spent = [cpu_seconds(p) - c for p, c in zip(pids[side], cpu0, strict=True)]
                cpu_k[side].append(1000 * sum(spent) / tokens)
                if side == "split":
                    core_k.append(1000 * spent[1] / tokens)
                assert args.steady or tokens == args.requests * args.new_tokens, (side, tokens)
                tps[side].append(tokens / seconds)
                per_step[side].append(tokens / max(1, steps[id(sides[side])] - steps0))
                print(f"round {k + 1}/{args.rounds} {side:>6}: {tokens / seconds:.1f} tok/s, "
                      f"{cpu_k[side][-1]:.3f} CPU s / 1k tokens, {per_step[side][-1]:.1f} tokens / step",
                      file=sys.stderr, flush=True)  # fmt: skip
    med = {side: statistics.median(v) for side, v in tps.items()}
    cpu = {side: statistics.median(v) for side, v in cpu_k.items()}
    print(f"{'':8}{'tok/s (median)':>16}{'CPU s / 1k tok':>16}   tok/s per round")
    for side, v in tps.items():
        print(f"{side:<8}{med[side]:>16.1f}{cpu[side]:>16.3f}   {' '.join(f'{x:.0f}' for x in v)}")
    if core_k:
        print(f"{'  core':<8}{'':>16}{statistics.median(core_k):>16.3f}   (split's engine core process alone)")
    print(f"({args.requests} concurrent, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), {args.dtype}, {model_dir.name}; wall-clock, noisy on a shared host)")
    out: dict = {"bench": "engine_http_cost", "model": model_dir.name, "requests": args.requests, "steady_s": args.steady,
                 "new_tokens": args.new_tokens, "rounds": args.rounds, "threads": args.threads,
                 "http_tok_s": round(med["http"], 1), "http_cpu_s_per_1k": round(cpu["http"], 4)}
    if "direct" in sides:
        out.update({"direct_tok_s": round(med["direct"], 1), "direct_over_http": round(med["direct"] / med["http"], 3),
                    "direct_cpu_s_per_1k": round(cpu["direct"], 4),
                    "http_cpu_over_direct": round(cpu["http"] / cpu["direct"], 3)})
    if "split" in sides:
        # per round, then the median: both sides of a round saw the same load
        ratios = [s / h for s, h in zip(tps["split"], tps["http"], strict=True)]
        out.update({"split_tok_s": round(med["split"], 1), "split_over_http": round(statistics.median(ratios), 3),
                    "split_over_http_rounds": [round(x, 3) for x in ratios],
                    "split_cpu_s_per_1k": round(cpu["split"], 4),
                    "split_core_cpu_s_per_1k": round(statistics.median(core_k), 4),
                    "split_core_cpu_over_http": round(statistics.median(core_k) / cpu["http"], 3)})
    out["tokens_per_step"] = {s: round(statistics.median(v), 2) for s, v in per_step.items()}
    out["rounds_tok_s"] = {s: [round(x, 1) for x in v] for s, v in tps.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
