"""The sharded trainer (trainer.world_size = 2, FSDP2 on gloo): the one-process step, and a dead rank never hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from benchmark_module import load_benchmark

from agentrl.config import TrainerConfig
from agentrl.errors import TrainerDied
from agentrl.trainer.sharded import ShardedTrainer
from agentrl.types import SamplingParams


def test_two_ranks_take_the_one_process_step(small_model):
    # trajectories of different lengths land on different ranks: per-rank means would move the weights differently
    case = load_benchmark("trainer_parity").run_case(small_model, "icepop", False, world=2, steps=2)
    assert case["max_param_moved"] > 1e-3  # the steps did train
    assert case["max_stat_diff"] < 1e-5, case  # loss, grad norm, entropy, KL, ... are the global ones
    assert case["max_param_diff"] < 2e-5, case


def test_a_killed_rank_ends_the_call_with_one_line(small_model, tmp_path):
    parity = load_benchmark("trainer_parity")
    cfg = TrainerConfig(device="cpu", world_size=2, collective_timeout_s=60)
    trainer = ShardedTrainer(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        os.kill(trainer.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TrainerDied) as e:
            trainer.step(parity.fixed_batch(0, 512))
        assert time.monotonic() - t0 < 30  # not the 60 s collective timeout: the death is seen directly
        msg = str(e.value)
        assert "\n" not in msg and "rank 1 of 2 was killed by signal 9" in msg and "newest checkpoint: none yet" in msg
    finally:
        trainer.close()
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in trainer.pids)


@pytest.mark.slow
def test_a_stuck_rank_times_out_the_collective(small_model):
    parity = load_benchmark("trainer_parity")
    cfg = TrainerConfig(device="cpu", world_size=2, collective_timeout_s=3)
    trainer = ShardedTrainer(small_model, cfg, SamplingParams())
    try:
        os.kill(trainer.pids[1], signal.SIGSTOP)  # alive but silent: only the collective timeout can tell
        with pytest.raises(TrainerDied, match="rank 0 of 2 failed") as e:
            trainer.step(parity.fixed_batch(0, 512))
        assert "\n" not in str(e.value)
    finally:
        trainer.close()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_the_same_run(small_model, tmp_path):
    # weights, AdamW moments and step counts and the LR schedule come back through the checkpoint files: the
    # state after loading is the saved one, and the next step is the uninterrupted run's
    from agentrl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    batch = load_benchmark("trainer_parity").fixed_batch(0, 512)
    cfg = TrainerConfig(device="cpu", world_size=2, lr=1e-3, warmup_steps=2, steps=4)
    first = ShardedTrainer(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        first.step(batch)
        save_checkpoint(tmp_path, 1, first.state_dict(), {"step": 1})
        expected = first.step(batch), first.named_tensors()
    finally:
        first.close()
    saved = load_checkpoint(latest_checkpoint(tmp_path))[0]
    second = ShardedTrainer(small_model, cfg, SamplingParams(), seed=1, run_dir=tmp_path)
    try:
        second.load_state_dict(saved)
        loaded = second.state_dict()
        got = second.step(batch), second.named_tensors()
    finally:
        second.close()
    assert saved["optimizer"]["state"] and loaded["scheduler"] == saved["scheduler"]
    for name, moments in saved["optimizer"]["state"].items():
        for k, v in moments.items():
            assert torch.equal(loaded["optimizer"]["state"][name][k], v), (name, k)
    for k, v in saved["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    assert got[0]["lr"] == expected[0]["lr"] and abs(got[0]["loss"] - expected[0]["loss"]) < 1e-7
    # the step after the resume is the one the first trainer took (AdamW's step count included)
    assert max(float((got[1][k] - v).abs().max()) for k, v in expected[1].items()) < 1e-7
