"""Weight push into a running embedded engine vs an in-process ``load_state_dict``.

Builds a tiny-architecture model of a chosen size (default ~34M parameters, 134 MB fp32),
starts the embedded engine on it, and times, in the same run:

- baseline: ``model.load_state_dict(new_state)`` inside the trainer process;
- ``shm`` push: copy into the engine's /dev/shm segment → pause → signed commit → resume;
- ``disk`` push: a safetensors file in the engine's weights dir (for context);
- LoRA (``--lora-rank``, 0 = skip): an adapter-only push (A and B of every adapted
  matrix, merged by the engine) vs pushing the merged weights, both over shm.

Medians over ``--reps`` pushes (the first shm push maps the buffer and is reported
separately).  A greedy completion after the last push is checked against the pushed
weights.  Prints a table and a JSON line last.  Goal (issue #2): shm / baseline <= 1.5.
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

import openai
import torch
from transformers import AutoModelForCausalLM

from agentrl.auth import KEY_ENV, new_key
from agentrl.inference import start_embedded_engine
from agentrl.tiny_model import build_tiny_model
from agentrl.weights import make_weight_sync


def new_states(model, reps: int) -> list[dict[str, torch.Tensor]]:
    base = model.state_dict()
    return [{k: v + 0.01 * (i + 1) for k, v in base.items()} for i in range(reps)]


def lora_factors(model, rank: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random factors for every matrix a LoRA trainer adapts, and the merged weights (every tensor:
    an engine refuses a push of only some)."""
    from agentrl.trainer.trainer import LORA_TARGETS

    g = torch.Generator().manual_seed(seed)
    factors, merged = {}, dict(model.state_dict())
    for name, w in model.state_dict().items():
        module = name.removesuffix(".weight")
        if w.dim() == 2 and module.rsplit(".", 1)[-1] in LORA_TARGETS:
            a = 0.01 * torch.randn(rank, w.shape[1], generator=g)
            b = 0.01 * torch.randn(w.shape[0], rank, generator=g)
            factors[module + ".lora_A"], factors[module + ".lora_B"] = a, b
            merged[name] = w + b @ a
    return factors, merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault(KEY_ENV, new_key())  # the engine's key; the weight syncs sign with it

    tmp = tempfile.TemporaryDirectory()
    model_dir = build_tiny_model(Path(tmp.name) / "m", layers=args.layers, hidden=args.hidden, heads=args.heads)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    n_params = sum(p.numel() for p in model.parameters())
    mbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    states = new_states(model, args.reps)

    # float32 as the reference below (auto serves a model this wide in bf16 on a CPU with native bf16, and
    # greedy tokens of a bf16 engine need not equal float32 ones): the check is of the weights pushed
    with start_embedded_engine(model_dir, max_batch_size=4, max_model_len=128, device="cpu", dtype="float32") as eng:

        async def run():
            shm = make_weight_sync(eng.base_url, "shm")
            first = await shm.push(states[0], 1)
            disk = make_weight_sync(eng.base_url, "disk", work_dir=tmp.name)
            base, shm_t, disk_t = [], [], []
            for i, sd in enumerate(states):  # interleaved, so machine noise hits all three alike
                t0 = time.perf_counter()
                model.load_state_dict(sd)
                base.append(time.perf_counter() - t0)
                shm_t.append(await shm.push(sd, 2 + 2 * i))  # versions only increase
                disk_t.append(await disk.push(sd, 3 + 2 * i))
            last = 2 + 2 * args.reps
            await shm.push(states[-1], last)
            stats = dict(shm.last_stats)
            lora = {}
            if args.lora_rank:  # base W0 = states[-1]; merged pushes first so adapters apply last
                base_model = AutoModelForCausalLM.from_pretrained(model_dir)
                base_model.load_state_dict(states[-1])
                merged_sync, adapter_sync = make_weight_sync(eng.base_url, "shm"), make_weight_sync(eng.base_url, "shm")
                pairs = [lora_factors(base_model, args.lora_rank, seed) for seed in range(args.reps + 1)]
                await merged_sync.push(pairs[0][1], last + 1)
                await adapter_sync.push(pairs[0][0], last + 2, lora=True)  # maps its buffer
                await shm.push(states[-1], last + 3)  # back to W0 (resets the engine's adapters)
                m_t, a_t = [], []
                for i, (factors, merged) in enumerate(pairs[1:]):
                    m_t.append(await merged_sync.push(merged, last + 4 + 2 * i))
                    a_t.append(await adapter_sync.push(factors, last + 5 + 2 * i, lora=True))
                last = last + 3 + 2 * args.reps
                lora = {"merged_s": m_t, "adapter_s": a_t, "merged_bytes": merged_sync.last_stats["bytes"],
                        "adapter_bytes": adapter_sync.last_stats["bytes"], "final": pairs[-1][1], "version": last}
                await merged_sync.close()
                await adapter_sync.close()
            await shm.close()
            await disk.close()
            async with openai.AsyncOpenAI(base_url=eng.base_url, api_key=os.environ[KEY_ENV]) as ac:
                r = await ac.completions.create(
                    model=eng.model, prompt=[1, 20, 30], max_tokens=8, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True},
                )  # fmt: skip
            return first, base, shm_t, disk_t, stats, r.choices[0], lora

        first, base, shm_t, disk_t, stats, choice, lora = asyncio.run(run())

    model.load_state_dict(states[-1])
    if lora:  # the engine now serves W0 + B·A of the last adapter push
        model.load_state_dict({**states[-1], **lora["final"]})
        last = lora["version"]
    else:
        last = 2 + 2 * args.reps
    ref = model.generate(
        torch.tensor([[1, 20, 30]]), max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None
    )[0, 3:].tolist()
    verified = ref == choice.token_ids and set(choice.token_versions) == {last}

    b, s, d = statistics.median(base), statistics.median(shm_t), statistics.median(disk_t)
    print(f"model: {n_params / 1e6:.1f}M params, {mbytes:.0f} MiB fp32; median of {args.reps}")
    print(f"{'in-process load_state_dict':30}{b * 1000:>9.1f} ms")
    print(f"{'engine push, shm':30}{s * 1000:>9.1f} ms   (first push, maps buffer: {first * 1000:.1f} ms)")
    print(f"{'  of which':30} pause {stats['pause_s'] * 1000:.1f} / write {stats['write_s'] * 1000:.1f} / "
          f"load+resume {stats['load_s'] * 1000:.1f} ms")  # fmt: skip
    print(f"{'engine push, disk':30}{d * 1000:>9.1f} ms")
    print(f"ratio shm / load_state_dict = {s / b:.2f}x  (goal <= 1.5x); disk: {d / b:.2f}x; verified: {verified}")
    extra = {}
    if lora:
        lm, la = statistics.median(lora["merged_s"]), statistics.median(lora["adapter_s"])
        print(f"LoRA rank {args.lora_rank}: merged-matrix push {lm * 1000:.1f} ms ({lora['merged_bytes'] / 2**20:.0f} MiB) vs "
              f"adapter-only push {la * 1000:.1f} ms ({lora['adapter_bytes'] / 2**20:.1f} MiB): {lm / la:.2f}x faster")
        extra = {"lora_rank": args.lora_rank, "lora_merged_push_ms": round(lm * 1000, 2),
                 "lora_adapter_push_ms": round(la * 1000, 2), "lora_merged_mib": round(lora["merged_bytes"] / 2**20, 2),
                 "lora_adapter_mib": round(lora["adapter_bytes"] / 2**20, 2), "lora_speedup": round(lm / la, 3)}
    print(
        json.dumps(
            {
                "bench": "weight_push",
                "params_m": round(n_params / 1e6, 2),
                "mib": round(mbytes, 1),
                "load_state_dict_ms": round(b * 1000, 2),
                "shm_push_ms": round(s * 1000, 2),
                "disk_push_ms": round(d * 1000, 2),
                "ratio": round(s / b, 3),
                "disk_ratio": round(d / b, 3),
                "verified": verified,
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
