"""Memory per rank of the sharded trainer vs the one-process trainer, after one step on the same batch.

Counts the bytes each process holds of weights and AdamW state (a rank: its FSDP2 shards), and
each process's peak RSS (which includes torch itself, the same in every process, and is noisy).

    python benchmarks/sharded_memory.py --world-size 2 [--hidden 256 --layers 4]

Prints a table and, last, a JSON line with ``optimizer_ratio`` (the largest rank's optimizer
state / the one-process trainer's; goal ≈ 1/N) and ``param_ratio``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from trainer_parity import fixed_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    from agentrl.config import TrainerConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.sharded import ShardedTrainer, _max_rss, tensor_bytes
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import SamplingParams

    torch.set_num_threads(1)
    batch = fixed_batch(0, 512)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, heads=4, vocab_size=512,
                                 intermediate=4 * args.hidden)  # fmt: skip
        one = Trainer(model, TrainerConfig(device="cpu"), SamplingParams(), seed=0)
        one.step(batch)
        base = {**tensor_bytes(one.model, one.optimizer), "max_rss_bytes": _max_rss()}
        del one
        sharded = ShardedTrainer(model, TrainerConfig(device="cpu", world_size=args.world_size), SamplingParams())
        try:
            sharded.step(batch)
            ranks = sharded.memory_by_rank()
        finally:
            sharded.close()
    mib = 1 / 2**20
    print(f"{'':12s} {'weights MiB':>12s} {'AdamW MiB':>10s} {'peak RSS MiB':>13s}")
    print(f"{'one process':12s} {base['param_bytes'] * mib:12.2f} {base['optimizer_bytes'] * mib:10.2f} "
          f"{base['max_rss_bytes'] * mib:13.0f}")  # fmt: skip
    for r in ranks:
        print(f"{'rank ' + str(r['rank']):12s} {r['param_bytes'] * mib:12.2f} {r['optimizer_bytes'] * mib:10.2f} "
              f"{r['max_rss_bytes'] * mib:13.0f}")  # fmt: skip
    print(json.dumps({
        "world_size": args.world_size, "one_process": base, "ranks": ranks,
        "optimizer_ratio": max(r["optimizer_bytes"] for r in ranks) / base["optimizer_bytes"],
        "param_ratio": max(r["param_bytes"] for r in ranks) / base["param_bytes"],
        "rss_ratio": max(r["max_rss_bytes"] for r in ranks) / base["max_rss_bytes"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
