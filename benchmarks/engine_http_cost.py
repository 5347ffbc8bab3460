"""What the HTTP front end costs the embedded engine: tokens/s with the server in the engine's process vs none.

The embedded engine's HTTP server (uvicorn + FastAPI, :mod:`agentrl.inference.server`) runs in
the engine's process, so parsing requests and writing responses take the GIL from the engine's
step.  Moving the front end into a process of its own can at most win back what the front end
costs; this script measures that ceiling:

- **http**: the engine as agentrl starts it (:func:`agentrl.inference.start_embedded_engine`),
  ``--requests`` concurrent ``/v1/completions`` over HTTP, each asking what agentrl's
  :class:`~agentrl.inference.PolicyClient` asks in a run (token-id prompt, μ logprobs, token ids);
- **direct**: the same engine settings in a process of its own with no server at all, the same
  prompts handed to :meth:`Engine.submit` (what a front end in another process would do, at no
  cost for the transport).

Both are up at once; ``--rounds`` rounds alternate between them (order alternating too), each
round ``--requests`` prompts of ``--prompt-tokens`` random ids, exactly ``--new-tokens`` new
tokens each (``ignore_eos``), the same prompts for both sides.  Two measures, median over rounds:
wall-clock tokens/s (noisy on a shared host), and the CPU seconds the engine's process spent per
1,000 tokens (``/proc``: user + system, every thread; steadier under load, and the direct figure
of what the front end takes from the engine's process).

    python benchmarks/engine_http_cost.py [--model DIR] [--rounds 5] [--threads 1] [--new-tokens 64]

``--new-tokens 8``: RL-sized turns, where a request's fixed cost weighs 8x more per token.

Prints a table and, last, a JSON line with ``direct_over_http`` (direct ÷ http tokens/s) and
``http_cpu_over_direct`` (http ÷ direct CPU seconds per token): the most a front end in a process
of its own could win back; near 1, it does not pay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from completions_round import completions_round, workload

from agentrl.inference import start_embedded_engine

KEY = "arl-benchmark-key-not-secret"
RUN_BODY = {"logprobs": 0, "return_token_ids": True}  # what PolicyClient asks for in a run, besides the tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        futures = [engine.submit(p, EngineSampling(max_tokens=job["new_tokens"], temperature=1.0, ignore_eos=True))
                   for p in job["prompts"]]  # fmt: skip
        tokens = sum(len(r.token_ids) for f in futures for r in f.result())
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": tokens}), flush=True)
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: build agentrl's default tiny model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    ap.add_argument("--dtype", default="float32")
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
    with tempfile.TemporaryDirectory(prefix="engine-http-cost-") as tmp:
        if args.model:
            model_dir = Path(args.model)
        else:
            from agentrl.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny")
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        worker = subprocess.Popen(
            [sys.executable, __file__, "--direct-worker", str(model_dir), str(args.requests), str(max_len), args.dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **threads},
        )  # fmt: skip
        try:
            with start_embedded_engine(model_dir, api_key=KEY, max_batch_size=args.requests, max_model_len=max_len,
                                       device="cpu", dtype=args.dtype, env=threads,
                                       startup_timeout=args.startup_timeout) as eng:  # fmt: skip
                assert json.loads(worker.stdout.readline())["ready"]

                def direct(prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
                    worker.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
                    worker.stdin.flush()
                    done = json.loads(worker.stdout.readline())
                    return done["seconds"], done["tokens"]

                sides = {"http": lambda p, n: asyncio.run(completions_round(eng.root_url, eng.model, KEY, p, n, RUN_BODY)), "direct": direct}
                pids = {"http": eng.proc.pid, "direct": worker.pid}
                warm = workload(vocab, min(8, args.requests), args.prompt_tokens, 10**6)
                for run in sides.values():  # warm-up
                    run(warm, 8)
                tps: dict[str, list[float]] = {side: [] for side in sides}
                cpu_k: dict[str, list[float]] = {side: [] for side in sides}  # CPU s per 1k tokens
                for k in range(args.rounds):
                    prompts = workload(vocab, args.requests, args.prompt_tokens, seed=k)
                    for side in list(sides) if k % 2 == 0 else list(sides)[::-1]:
                        cpu0 = cpu_seconds(pids[side])
                        seconds, tokens = sides[side](prompts, args.new_tokens)
                        cpu_k[side].append(1000 * (cpu_seconds(pids[side]) - cpu0) / tokens)
                        assert tokens == args.requests * args.new_tokens, (side, tokens)
                        tps[side].append(tokens / seconds)
                        print(f"round {k + 1}/{args.rounds} {side:>6}: {tokens / seconds:.1f} tok/s, "
                              f"{cpu_k[side][-1]:.3f} CPU s / 1k tokens", file=sys.stderr, flush=True)  # fmt: skip
        finally:  # the worker ends at the end of its input, or now if a round is still running
            worker.stdin.close()
            if worker.poll() is None:
                worker.terminate()
            worker.wait()
    med = {side: statistics.median(v) for side, v in tps.items()}
    cpu = {side: statistics.median(v) for side, v in cpu_k.items()}
    print(f"{'':8}{'tok/s (median)':>16}{'CPU s / 1k tok':>16}   tok/s per round")
    for side, v in tps.items():
        print(f"{side:<8}{med[side]:>16.1f}{cpu[side]:>16.3f}   {' '.join(f'{x:.0f}' for x in v)}")
    print(f"({args.requests} concurrent, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), {args.dtype}, {model_dir.name}; wall-clock, noisy on a shared host)")
    print(json.dumps({"bench": "engine_http_cost", "model": model_dir.name, "requests": args.requests,
                      "new_tokens": args.new_tokens, "rounds": args.rounds, "threads": args.threads,
                      "http_tok_s": round(med["http"], 1), "direct_tok_s": round(med["direct"], 1),
                      "direct_over_http": round(med["direct"] / med["http"], 3),
                      "http_cpu_s_per_1k": round(cpu["http"], 4), "direct_cpu_s_per_1k": round(cpu["direct"], 4),
                      "http_cpu_over_direct": round(cpu["http"] / cpu["direct"], 3),
                      "rounds_tok_s": {s: [round(x, 1) for x in v] for s, v in tps.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
