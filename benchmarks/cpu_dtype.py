"""bf16 vs fp32 on this CPU, for the trainer's step and the engine's decode (one torch thread).

Loads a model dir (default: SmolLM2-135M, imported by ``agentrl model init smollm2-135m`` into
``runs/models/smollm2-135m`` if missing), then times, in alternation so machine noise hits both
alike:

- *train*: forward + backward of ``--batch`` x ``--tokens`` tokens (the trainer's work;
  bf16 = bf16 autocast over fp32 weights, as mixed-precision trainers run);
- *decode*: one batched decode step of ``--batch`` sequences over a ``--tokens`` K/V cache (the
  engine's work; bf16 = bf16 weights and cache).

Times are CPU seconds of this process (``time.process_time``), so a busy machine that lends
this process less of a core stretches both sides less than wall time would.

    python benchmarks/cpu_dtype.py [--model DIR] [--batch 8] [--tokens 192] [--reps 5] [--fp32-gemm torch]

Float32 runs its linear layers through oneDNN, as the engine and the trainer do on a CPU
(``agentrl.cpu_gemm``); ``--fp32-gemm torch`` measures torch's default (MKL) instead.

Prints a table and, last, a JSON line with ``bf16_speedup_train`` and ``bf16_speedup_decode``
(fp32 median / bf16 median: above 1 means bf16 is faster) and the CPU flags that matter.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2"))


def cpu_seconds(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/models/smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fp32-gemm", default="onednn", choices=["onednn", "torch"],
                   help="float32 products: oneDNN, as agentrl runs them (agentrl.cpu_gemm), or torch's default (MKL)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run(["agentrl", "model", "init", "smollm2-135m", args.model], check=True)
    from transformers import AutoModelForCausalLM, DynamicCache

    fp32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    if args.fp32_gemm == "onednn":  # as the engine and the trainer run float32 on a CPU
        from agentrl.cpu_gemm import route_linears

        route_linears(fp32)
    vocab = fp32.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.tokens))

    def train(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = fp32(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        fp32.zero_grad(set_to_none=True)

    def prefilled(model):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        return cache

    caches = {torch.float32: prefilled(fp32.eval()), torch.bfloat16: prefilled(bf16)}
    fp32.train()
    step = torch.randint(0, vocab, (args.batch, 1))

    def decode(model) -> None:
        cache = copy.deepcopy(caches[model.dtype])
        with torch.no_grad():
            for _ in range(4):
                model(step, cache=cache, use_cache=True)

    times: dict[str, list[float]] = {k: [] for k in ("train fp32", "train bf16", "decode fp32", "decode bf16")}
    train(False), train(True), decode(fp32), decode(bf16)  # warm-up
    for _ in range(args.reps):
        times["train fp32"].append(cpu_seconds(lambda: train(False)))
        times["train bf16"].append(cpu_seconds(lambda: train(True)))
        times["decode fp32"].append(cpu_seconds(lambda: decode(fp32)) / 4)
        times["decode bf16"].append(cpu_seconds(lambda: decode(bf16)) / 4)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'what':<12} {'median CPU s':>12}   all")
    for k, v in times.items():
        print(f"{k:<12} {med[k]:>12.3f}   {' '.join(f'{x:.3f}' for x in v)}")
    print(json.dumps({
        "model": args.model, "fp32_gemm": args.fp32_gemm, "batch": args.batch, "tokens": args.tokens, "reps": args.reps, "cpu_flags": cpu_flags(),
        "torch": torch.__version__, "median_cpu_s": {k: round(v, 4) for k, v in med.items()},
        "bf16_speedup_train": round(med["train fp32"] / med["train bf16"], 3),
        "bf16_speedup_decode": round(med["decode fp32"] / med["decode bf16"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
