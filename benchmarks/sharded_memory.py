"""Memory per rank of the sharded trainer vs the one-process trainer, after one step on the same batch.

Counts the bytes each process holds of weights and AdamW state (a rank: its FSDP2 shards), each
rank's resident memory after setup and its peak during setup (built on the meta device, each rank
reading only its shards; baseline in the same run: the same weights as a pytorch_model.bin, which a
rank loads whole and then shards, as every rank did before), and each rank's resident
memory during the weights out for a push (``named_tensors``): with ``trainer.push_bucket_mb``
buckets (rank 0 sends a bucket to the driver, then drops it) and, as the baseline in the same run,
with one bucket as large as the model (rank 0 holds the whole gathered model, as before buckets).

    python benchmarks/sharded_memory.py --world-size 2 [--hidden 512 --layers 8 --vocab 32000]

Prints a table and, last, a JSON line with ``optimizer_ratio`` (the largest rank's optimizer
state / the one-process trainer's; goal ≈ 1/N), ``param_ratio`` and ``push_extra_ratio`` (rank 0's RSS growth during the
weights out, buckets / whole model), ``startup_peak_ratio`` (the largest rank's start-up peak RSS,
meta-device build / whole model loaded) and ``startup_extra_ratio`` (the same for the peak above the
RSS after setup).  RSS includes torch itself (~0.4 GiB, the same in every
process) and is noisy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from trainer_parity import fixed_batch

MIB = 1 / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    args = p.parse_args()
    from agentrl.config import TrainerConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.sharded import ShardedTrainer, _max_rss, peak_rss, reset_peak_rss, rss, tensor_bytes
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import SamplingParams

    torch.set_num_threads(1)
    batch = fixed_batch(0, 512)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, heads=4,
                                 vocab_size=args.vocab, intermediate=4 * args.hidden)  # fmt: skip
        one = Trainer(model, TrainerConfig(device="cpu"), SamplingParams(), seed=0)
        one.step(batch)
        n_params = sum(p.numel() for p in one.model.parameters())
        base = {**tensor_bytes(one.model, one.optimizer), "max_rss_bytes": _max_rss()}
        del one
        # the start-up baseline, same run: the same weights as one pytorch_model.bin, which a rank still loads whole
        # (then shards), as every rank did before the meta-device build
        whole_dir = Path(tmp) / "bin"
        shutil.copytree(model, whole_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
        torch.save(load_file(Path(model) / "model.safetensors"), whole_dir / "pytorch_model.bin")
        start = ShardedTrainer(whole_dir, TrainerConfig(device="cpu", world_size=args.world_size), SamplingParams())
        try:
            start_whole = start.memory_by_rank()
        finally:
            start.close()
        runs = {}
        for label, bucket in (("buckets", args.bucket_mb), ("whole", 1e9)):
            cfg = TrainerConfig(device="cpu", world_size=args.world_size, push_bucket_mb=bucket)
            sharded = ShardedTrainer(model, cfg, SamplingParams())
            try:
                sharded.step(batch)
                reset_peak_rss()
                before = rss()
                sharded.named_tensors()
                driver = peak_rss() - before
                runs[label] = {"ranks": sharded.memory_by_rank(), "driver_push_extra_bytes": driver}
            finally:
                sharded.close()
    ranks = runs["buckets"]["ranks"]

    def push_extra(r: dict) -> int:
        return r["push_rss_peak_bytes"] - r["push_rss_before_bytes"]

    def start_extra(r: dict) -> int:  # the start-up peak above what the rank holds once set up
        return r["setup_peak_rss_bytes"] - r["setup_rss_bytes"]

    print(f"model: {n_params / 1e6:.1f}M parameters (d {args.hidden} x {args.layers} layers, vocab {args.vocab})")
    print(f"{'':12s} {'weights MiB':>12s} {'AdamW MiB':>10s} {'RSS after setup':>16s} "
          f"{'push +RSS buckets':>18s} {'push +RSS whole':>16s}")  # fmt: skip
    print(f"{'one process':12s} {base['param_bytes'] * MIB:12.1f} {base['optimizer_bytes'] * MIB:10.1f}")
    for r, w in zip(ranks, runs["whole"]["ranks"], strict=True):
        print(f"{'rank ' + str(r['rank']):12s} {r['param_bytes'] * MIB:12.1f} {r['optimizer_bytes'] * MIB:10.1f} "
              f"{r['setup_rss_bytes'] * MIB:16.0f} {push_extra(r) * MIB:18.0f} {push_extra(w) * MIB:16.0f}")  # fmt: skip
    def startup(rs: list[dict]) -> str:
        return ", ".join(f"{r['setup_peak_rss_bytes'] * MIB:.0f} (+{start_extra(r) * MIB:.0f})" for r in rs)

    print(f"start-up peak RSS per rank, MiB (+ above its RSS after setup): meta-device build {startup(ranks)}; "
          f"whole model loaded {startup(start_whole)}")
    print(f"{'driver':12s} {'':12s} {'':10s} {'':16s} {runs['buckets']['driver_push_extra_bytes'] * MIB:18.0f} "
          f"{runs['whole']['driver_push_extra_bytes'] * MIB:16.0f}")  # fmt: skip
    print(json.dumps({
        "world_size": args.world_size, "params": n_params, "bucket_mb": args.bucket_mb, "one_process": base,
        "ranks": ranks, "ranks_whole": runs["whole"]["ranks"],
        "driver_push_extra_bytes": {k: v["driver_push_extra_bytes"] for k, v in runs.items()},
        "optimizer_ratio": max(r["optimizer_bytes"] for r in ranks) / base["optimizer_bytes"],
        "param_ratio": max(r["param_bytes"] for r in ranks) / base["param_bytes"],
        "rss_ratio": max(r["max_rss_bytes"] for r in ranks) / base["max_rss_bytes"],
        "push_extra_ratio": push_extra(ranks[0]) / max(1, push_extra(runs["whole"]["ranks"][0])),
        "start_whole": start_whole,
        "startup_peak_ratio": max(r["setup_peak_rss_bytes"] for r in ranks)
        / max(r["setup_peak_rss_bytes"] for r in start_whole),
        "startup_extra_ratio": max(start_extra(r) for r in ranks) / max(1, max(start_extra(r) for r in start_whole)),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
