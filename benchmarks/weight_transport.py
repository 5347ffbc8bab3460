"""Network weight push (HTTP chunks) vs shared-memory push into a running embedded engine.

Builds a tiny-architecture model of ~100M parameters (default: 6 layers, hidden 1024,
intermediate 4096: 101M parameters, 386 MiB fp32), starts the embedded engine on it and
times, interleaved in the same run so machine noise hits both alike:

- baseline: ``weight_transport = "shm"`` (one copy into a /dev/shm segment the engine made →
  pause → the engine's parameters alias it → resume), the same-host path;
- ``weight_transport = "http"``: pack into a flat buffer, an HMAC-SHA256 per bucket, stream
  the buckets over loopback HTTP, the engine checks and stages them while generating, then one
  commit between decode steps (what an engine on another host gets).

Medians over ``--reps`` pushes after one warm-up push each.  After the last push a greedy
completion is checked against the pushed weights.  Prints a table, the ratio http / shm,
and a JSON line last.  On loopback the http path pays packing, signatures and two copies
through the socket that shm avoids; across hosts it is bounded by the network instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from agentrl.auth import KEY_ENV, auth_headers, new_key
from agentrl.inference import start_embedded_engine
from agentrl.tiny_model import build_tiny_model
from agentrl.weights import make_weight_sync


async def _greedy(eng, prompt: list[int]) -> tuple[list[int], list[int]]:
    body = {"model": eng.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120, headers=auth_headers(os.environ[KEY_ENV])) as http:
        ch = (await http.post(eng.base_url + "/completions", json=body)).json()["choices"][0]
    return ch["token_ids"], ch["token_versions"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    args = ap.parse_args()
    os.environ.setdefault(KEY_ENV, new_key())  # the engine's key; the weight syncs sign with it

    tmp = tempfile.TemporaryDirectory()
    model_dir = build_tiny_model(Path(tmp.name) / "m", layers=args.layers, hidden=args.hidden, heads=16,
                                 intermediate=args.intermediate)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    n_params = sum(p.numel() for p in model.parameters())
    mbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    base = {k: v.clone() for k, v in model.state_dict().items()}
    states = [{k: v + 0.001 * (i + 1) for k, v in base.items()} for i in range(2)]
    del base
    prompt = [1, 20, 30]

    # float32, as the reference the greedy check compares with (auto may serve bf16 on a CPU with native bf16)
    with start_embedded_engine(model_dir, max_batch_size=2, max_model_len=64, device="cpu", dtype="float32") as eng:

        async def run():
            shm = make_weight_sync(eng.base_url, "shm")
            net = make_weight_sync(eng.base_url, "http", local_urls=[], bucket_mb=args.bucket_mb)
            await shm.push(states[0], 1)  # warm-up: maps the shm buffer
            await net.push(states[1], 2)  # warm-up: allocates the pack buffer
            shm_t, net_t, version = [], [], 2
            for i in range(args.reps):
                version += 1
                shm_t.append(await shm.push(states[i % 2], version))
                version += 1
                net_t.append(await net.push(states[(i + 1) % 2], version))
            stats = dict(net.last_stats)
            out = await _greedy(eng, prompt)
            await shm.close()
            await net.close()
            return shm_t, net_t, stats, out, version, states[(args.reps) % 2]

        shm_t, net_t, stats, (ids, versions), last, final = asyncio.run(run())

    model.load_state_dict(final)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
    verified = ref == ids and set(versions) == {last}
    s, n = statistics.median(shm_t), statistics.median(net_t)
    print(f"model: {n_params / 1e6:.1f}M params, {mbytes:.0f} MiB fp32; median of {args.reps}; "
          f"http buckets {args.bucket_mb:g} MiB ({stats['chunks']:.0f} chunks)")
    print(f"{'push, shm (same host)':30}{s * 1000:>9.1f} ms")
    print(f"{'push, http (network)':30}{n * 1000:>9.1f} ms   (chunks built, signed and sent as the tensors come)")
    print(f"ratio http / shm = {n / s:.2f}x; throughput http {mbytes / n:.0f} MiB/s; verified: {verified}")
    print(json.dumps({
        "benchmark": "weight_transport", "params": n_params, "mib": round(mbytes, 1), "reps": args.reps,
        "bucket_mb": args.bucket_mb, "shm_s": s, "http_s": n, "ratio_http_over_shm": n / s,
        "http_mib_per_s": mbytes / n, "verified": verified, "time": time.time(),
    }))


if __name__ == "__main__":
    main()
