"""Trainer step time with a group's shared prompt packed (``trainer.share_prompt``) vs one row per episode.

Builds a random-weight Llama (agentrl.tiny_model, no hub), and groups shaped like agentic RL batches: ``--groups``
groups of ``--group-size`` episodes; each group's episodes share a ``--prompt``-token prompt
and continue with ``--turns`` turns of ``--sampled`` sampled then ``--forced`` forced (tool
reply) tokens.  Both trainers start from the same weights and take the same steps, in
alternation (so machine noise hits both alike); the median step time of each is compared.
Both run the same loss on the same rows; ``tests/rl/test_packing.py`` checks that their
logprobs and gradients agree.

    python benchmarks/trainer_step.py [--hidden 128 --layers 4 --prompt 45 --sampled 15 ...]

Prints a table and, last, a JSON line with ``speedup`` (plain median / packed median).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():  # queued kernels belong to the step that launched them
        torch.cuda.synchronize()


def groups(args: argparse.Namespace, rng: random.Random) -> list:
    from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

    out = []
    for _ in range(args.groups):
        task = Task(prompt=[Message("user", "q")])
        prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt)]
        g = Group(task=task)
        for _ in range(args.group_size):
            s = TokenSequence()
            s.extend_forced(prompt)
            for turn in range(args.turns):
                n = rng.randint(args.sampled // 2, args.sampled)
                s.extend_sampled([rng.randrange(3, args.vocab) for _ in range(n)], [-1.0] * n, [0] * n)
                if turn < args.turns - 1:
                    s.extend_forced([rng.randrange(3, args.vocab) for _ in range(args.forced)])
            g.trajectories.append(Trajectory(task=task, sequences=[s], reward=float(rng.random() < 0.5)))
        g.assign_advantages()
        out.append(g)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=45, help="shared prompt tokens per group")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--sampled", type=int, default=15, help="most sampled tokens per turn (drawn from half..all)")
    p.add_argument("--forced", type=int, default=10, help="forced (tool reply) tokens between turns")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from agentrl.config import TrainerConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "m", layers=args.layers, hidden=args.hidden, heads=max(1, args.hidden // 32),
                                 intermediate=4 * args.hidden, vocab_size=args.vocab, max_position=4096)
        trainers = {name: Trainer(model, TrainerConfig(lr=1e-4, share_prompt=share), SamplingParams(temperature=1.0))
                    for name, share in (("plain", False), ("packed", True))}
        batches = [groups(args, random.Random(k)) for k in range(args.steps + 1)]
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for k, batch in enumerate(batches):
            order = list(trainers.items())
            for name, tr in order if k % 2 else order[::-1]:  # alternate who goes first
                sync()
                t0 = time.perf_counter()
                tr.step(batch)
                sync()
                if k:  # the first step warms up allocators and kernels
                    times[name].append(time.perf_counter() - t0)
    rows = sum(len(g.trajectories) for g in batches[0])
    tokens = sum(len(s.token_ids) for g in batches[0] for t in g.trajectories for s in t.sequences)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"Llama d={args.hidden} x{args.layers}, {args.groups} groups x {args.group_size}, prompt {args.prompt}, "
          f"{rows} rows / {tokens} tokens per step, {args.threads} thread(s), {args.steps} steps each")
    for name, v in times.items():
        print(f"  {name:>6}: median {med[name]:.3f} s/step (min {min(v):.3f}, max {max(v):.3f})")
    print(json.dumps({"benchmark": "trainer_step", "hidden": args.hidden, "layers": args.layers,
                      "prompt": args.prompt, "group_size": args.group_size, "tokens_per_step": tokens,
                      "plain_s": med["plain"], "packed_s": med["packed"], "speedup": med["plain"] / med["packed"]}))


if __name__ == "__main__":
    main()
