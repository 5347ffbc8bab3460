"""A CPU trainer's resident memory stays at what is live, step after step (issue 25).

SmolLM2-135M on the CPU grew ~600 MB per RL step until the OOM killer ended the run: the
micro-batches' freed activations stayed in glibc's arenas (agentrl.trainer.heap)."""

from __future__ import annotations

import random

import pytest
import torch

from agentrl.config import TrainerConfig
from agentrl.tiny_model import build_family_model
from agentrl.trainer.heap import _libc
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

pytestmark = pytest.mark.skipif(_libc() is None, reason="malloc_trim is glibc's")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _groups(rng: random.Random, vocab: int) -> list[Group]:
    """Two groups of 8, every batch of other lengths (the micro-batches' shapes change each step)."""
    groups = []
    task = Task(prompt=[Message("user", "q")])
    for _ in range(2):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(100, 400))]
        trajs = []
        for _ in range(8):
            s = TokenSequence()
            s.extend_forced(prompt)
            n = rng.randint(20, 200)
            s.extend_sampled([rng.randrange(10, vocab) for _ in range(n)], [-rng.random() * 3] * n, [0] * n)
            trajs.append(Trajectory(task=task, sequences=[s], reward=rng.random()))
        g = Group(task=task, trajectories=trajs)
        g.assign_advantages()
        groups.append(g)
    return groups


def test_resident_memory_does_not_grow_step_over_step(tmp_path):
    path = build_family_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=1024,
                              num_attention_heads=4, max_position_embeddings=1024)
    trainer = Trainer(path, TrainerConfig.model_validate({"micro_batch_tokens": 4096, "lr": 1e-4, "dtype": "float32"}))
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    vocab = trainer.vocab_size
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.step(_groups(rng, vocab))  # the first step allocates AdamW's state: 2 × the parameters
        after_first = _rss_anon()
        rss = [after_first]
        for _ in range(6):
            trainer.step(_groups(rng, vocab))
            rss.append(_rss_anon())
    finally:
        torch.set_num_threads(threads)
    # nothing new is live after the first step (the optimizer state exists, gradients are freed):
    # what the later steps add may not exceed one copy of the parameters
    growth = max(rss) - after_first
    assert growth <= param_bytes, (
        f"resident memory grew {growth / 2**20:.0f} MiB over 6 steps (model: {param_bytes / 2**20:.0f} MiB of "
        f"parameters); per step: {[round(r / 2**20) for r in rss]} MiB"
    )
