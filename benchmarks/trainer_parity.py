"""The sharded trainer against the one-process trainer: same weights, same batch, same seed.

For every registered loss and with the shared-prompt packing on and off, runs ``--steps``
optimizer steps on one fixed batch with ``trainer.world_size = --world-size`` ranks (FSDP2,
gloo on CPU) and with the one-process trainer, then compares every weight and every logged
statistic.  A sharded trainer that averaged per rank instead of using the global token and
trajectory weights would differ here (the batch's trajectories have different lengths, so the
ranks hold different token counts).

    python benchmarks/trainer_parity.py --world-size 2 [--steps 3 --losses icepop,gspo --device cuda]

Prints one line per case and, last, a JSON line with ``max_param_diff`` (the largest over all
cases; goal ≤ 1e-5 in float32), ``max_stat_diff`` and each case's numbers.

Each case also reports ``floor_param_diff``: the one-process trainer against itself with
``micro_batch_tokens`` halved, the same update in exact arithmetic, only summed in another
order.  That is how far float32 rounding alone moves these weights: AdamW's first update of an
element is about ``lr * g / (|g| + eps)``, so an element whose gradient is near ``eps`` turns a
rounding difference of 1e-10 into 1e-5 of weight.  A sharded trainer summing per rank and then
across ranks cannot be held closer than that (``max_floor_param_diff``: the largest floor).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

STATS = ("loss", "grad_norm", "entropy", "train_tokens", "mismatch_kl", "masked_frac", "clip_frac", "ess",
         "seq_rejected_frac", "outside_frac")  # fmt: skip


def fixed_batch(seed: int, vocab: int, n_groups: int = 3, group_size: int = 3) -> list:
    """Groups whose episodes share a prompt and have different lengths (so ranks get unequal token counts)."""
    from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

    rng = random.Random(seed)
    mu = -math.log(vocab)  # ≈ a random-init model's logprob: ratios near 1, every loss has gradient
    out = []
    for gi in range(n_groups):
        task = Task(prompt=[Message("user", f"q{gi}")])
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(6, 12))]
        g = Group(task=task)
        for k in range(group_size):
            s = TokenSequence()
            s.extend_forced(prompt)
            n = rng.randint(3, 14)
            s.extend_sampled([rng.randrange(3, vocab) for _ in range(n)], [mu + rng.uniform(-0.3, 0.3) for _ in range(n)],
                             [0] * n)  # fmt: skip
            g.trajectories.append(Trajectory(task=task, sequences=[s], reward=float(k % 2 == gi % 2)))
        g.assign_advantages()
        out.append(g)
    return out


def run_case(model_dir: Path, loss: str, share_prompt: bool, world: int, steps: int, seed: int = 0,
             vocab: int = 512, device: str = "cpu", start=None) -> dict:  # fmt: skip
    """Max |Δ| of the weights and of the logged statistics after ``steps`` steps on one batch.

    ``start(trainer_cfg, sampling, seed)``: how the sharded trainer is started (default: rank processes on this
    host, ``ShardedTrainer``; the Ray-placed ranks' test passes its own)."""
    from agentrl.config import TrainerConfig
    from agentrl.trainer.sharded import ShardedTrainer
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import SamplingParams

    kw = {"lr": 1e-3, "share_prompt": share_prompt, "device": device, "micro_batch_tokens": 64,
          "loss": {"name": loss}}  # fmt: skip
    sampling = SamplingParams(temperature=1.0)
    batch = fixed_batch(seed, vocab)
    one = Trainer(model_dir, TrainerConfig(**kw), sampling, seed=seed)
    t0 = time.perf_counter()
    one_stats = [one.step(batch) for _ in range(steps)]
    t_one = time.perf_counter() - t0
    ref = one.named_tensors()
    floor_trainer = Trainer(model_dir, TrainerConfig(**(kw | {"micro_batch_tokens": kw["micro_batch_tokens"] // 2})),
                            sampling, seed=seed)  # fmt: skip
    for _ in range(steps):
        floor_trainer.step(batch)
    floor = max(float((t - ref[k]).abs().max()) for k, t in floor_trainer.named_tensors().items())
    del floor_trainer
    start = start or (lambda cfg, sampling, seed: ShardedTrainer(model_dir, cfg, sampling, seed=seed))
    sharded = start(TrainerConfig(**kw, world_size=world), sampling, seed)
    try:
        t0 = time.perf_counter()
        sh_stats = [sharded.step(batch) for _ in range(steps)]
        t_sh = time.perf_counter() - t0
        got = sharded.named_tensors()
    finally:
        sharded.close()
    if set(got) != set(ref):
        raise SystemExit(f"{loss}: the sharded trainer's tensors differ in names: {sorted(set(got) ^ set(ref))[:4]}")
    param = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    moved = max(float((ref[k] - v).abs().max()) for k, v in one_start(model_dir).items() if k in ref)
    stat = max(abs(a[k] - b[k]) for a, b in zip(one_stats, sh_stats, strict=True) for k in STATS)
    return {"loss": loss, "share_prompt": share_prompt, "max_param_diff": param, "max_stat_diff": stat,
            "floor_param_diff": floor, "max_param_moved": moved, "one_process_s": round(t_one, 3), "sharded_s": round(t_sh, 3)}  # fmt: skip


def one_start(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--losses", default="", help="comma-separated (default: every registered loss)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (one GPU per rank: nccl)")
    args = p.parse_args()
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.losses import LOSSES

    torch.set_num_threads(1)
    losses = [x for x in args.losses.split(",") if x] or list(LOSSES)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, heads=4, vocab_size=512)
        for loss in losses:
            for share in (False, True):
                c = run_case(model, loss, share, args.world_size, args.steps, device=args.device)
                print(f"{loss:14s} packing={'on ' if share else 'off'} max_param_diff={c['max_param_diff']:.2e} "
                      f"max_stat_diff={c['max_stat_diff']:.2e} float32 floor={c['floor_param_diff']:.2e} "
                      f"(weights moved {c['max_param_moved']:.2e})", flush=True)
                cases.append(c)
    print(json.dumps({"world_size": args.world_size, "steps": args.steps,
                      "max_param_diff": max(c["max_param_diff"] for c in cases),
                      "max_stat_diff": max(c["max_stat_diff"] for c in cases),
                      "max_floor_param_diff": max(c["floor_param_diff"] for c in cases), "cases": cases}))  # fmt: skip


if __name__ == "__main__":
    main()
