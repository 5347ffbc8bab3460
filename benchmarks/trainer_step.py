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

``--dtype-compare`` times bf16 autocast against float32 instead (``trainer.dtype``; both packed):
one trainer, its autocast switched between steps (the two trainers a run would build differ in
that flag only, and a second copy of a 135M model's AdamW state would cost 2 GB), each batch
stepped once in each dtype, alternating which goes first.  ``--model smollm2-135m`` (imported by
``agentrl model init`` into ``runs/models/smollm2-135m`` if missing) or ``--model DIR`` trains a
real model instead of the random tiny one; prompt and reply ids are drawn from its vocabulary.

    python benchmarks/trainer_step.py --model smollm2-135m --dtype-compare --groups 2 --group-size 4

prints ``trainer_bf16_speedup`` (bf16 tokens/s ÷ float32 tokens/s on the same batches; wall
time, so noisy on a shared host: it is a ratio measured in one run).  Step time only: whether
bf16 leaves the held-out curve where float32 puts it is not measured here.
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


def model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    """The model to train: the random tiny Llama (``--hidden``/``--layers``), a known model, or a dir."""
    from agentrl.tiny_model import build_tiny_model

    if args.model == "tiny":
        return build_tiny_model(tmp / "m", layers=args.layers, hidden=args.hidden, heads=max(1, args.hidden // 32),
                                intermediate=4 * args.hidden, vocab_size=args.vocab, max_position=4096)  # fmt: skip
    from agentrl.models import KNOWN, init_known

    if args.model in KNOWN:
        path = Path("runs/models") / args.model
        if not (path / "config.json").is_file():
            init_known(args.model, path)
        return path
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"trainer_step: error: --model {args.model!r} is not tiny, {', '.join(KNOWN)} or a HF model dir")
    return Path(args.model)


def dtype_config(dtype: str, lr: float = 1e-6):
    """``--dtype-compare``'s trainer settings: every token inside the trust band, so each one's gradient
    is computed (this script's μ is made up: the default band would mask them all)."""
    from agentrl.config import LossConfig, TrainerConfig

    return TrainerConfig(lr=lr, dtype=dtype, loss=LossConfig(trust_low=1e-30, trust_high=1e30))


def dtype_switch(path: Path, sampling, lr: float = 1e-6):
    """One trainer and ``set_up(name)``, which makes its next step a ``float32`` or ``bf16`` trainer's
    (``trainer.dtype``; ``tests/rl/test_trainer_step_bench.py`` checks each equals a trainer built so)."""
    from agentrl.trainer.trainer import Trainer

    trainer = Trainer(path, dtype_config("bfloat16", lr), sampling)
    if trainer.bf16 is not True:
        raise SystemExit("trainer_step: error: the trainer no longer exposes its autocast switch (Trainer.bf16)")

    def set_up(name: str) -> None:
        trainer.bf16 = name == "bf16"

    return trainer, set_up


def timed_steps(trainers: dict, batches: list, set_up=lambda name: None) -> dict[str, list[float]]:
    """Each batch stepped by every trainer, alternating who goes first; the first batch is warm-up."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for k, batch in enumerate(batches):
        order = list(trainers.items())
        for name, tr in order if k % 2 else order[::-1]:
            set_up(name)
            sync()
            t0 = time.perf_counter()
            tr.step(batch)
            sync()
            if k:  # the first step warms up allocators and kernels
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (random, --hidden/--layers/--vocab), smollm2-135m, or a HF dir")
    p.add_argument("--dtype-compare", action="store_true", help="bf16 autocast vs float32 instead of packed vs plain")
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
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import SamplingParams

    torch.set_num_threads(args.threads)
    sampling = SamplingParams(temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args, Path(tmp))
        config = json.loads((path / "config.json").read_text())
        args.vocab = config["vocab_size"]
        if args.dtype_compare:
            trainer, set_up = dtype_switch(path, sampling)
            trainers = {"float32": trainer, "bf16": trainer}
        else:
            trainers = {name: Trainer(path, TrainerConfig(lr=1e-4, share_prompt=share), sampling)
                        for name, share in (("plain", False), ("packed", True))}  # fmt: skip

            def set_up(name: str) -> None:
                pass

        batches = [groups(args, random.Random(k)) for k in range(args.steps + 1)]
        times = timed_steps(trainers, batches, set_up)
    rows = sum(len(g.trajectories) for g in batches[0])
    tokens = sum(len(s.token_ids) for g in batches[0] for t in g.trajectories for s in t.sequences)
    med = {name: statistics.median(v) for name, v in times.items()}
    shape = (f"Llama d={args.hidden} x{args.layers}" if args.model == "tiny"
             else f"{args.model} (d={config['hidden_size']} x{config['num_hidden_layers']})")  # fmt: skip
    print(f"{shape}, {args.groups} groups x {args.group_size}, prompt {args.prompt}, "
          f"{rows} rows / {tokens} tokens per step, {args.threads} thread(s), {args.steps} steps each")
    for name, v in times.items():
        print(f"  {name:>7}: median {med[name]:.3f} s/step = {tokens / med[name]:.0f} tok/s "
              f"(min {min(v):.3f}, max {max(v):.3f})")  # fmt: skip
    out = {"benchmark": "trainer_step", "model": args.model, "prompt": args.prompt, "group_size": args.group_size,
           "tokens_per_step": tokens, "threads": args.threads, "steps": args.steps}  # fmt: skip
    if args.model == "tiny":
        out |= {"hidden": args.hidden, "layers": args.layers}
    if args.dtype_compare:
        out |= {"float32_s": med["float32"], "bf16_s": med["bf16"], "float32_tok_s": tokens / med["float32"],
                "bf16_tok_s": tokens / med["bf16"], "trainer_bf16_speedup": med["float32"] / med["bf16"],
                "heldout_curve": "not measured by this script"}  # fmt: skip
    else:
        out |= {"plain_s": med["plain"], "packed_s": med["packed"], "speedup": med["plain"] / med["packed"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
