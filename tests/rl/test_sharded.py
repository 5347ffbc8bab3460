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


@pytest.mark.slow
def test_two_ranks_take_the_one_process_step(small_model):
    # trajectories of different lengths land on different ranks: per-rank means would move the weights differently
    case = load_benchmark("trainer_parity").run_case(small_model, "icepop", False, world=2, steps=2)
    assert case["max_param_moved"] > 1e-3  # the steps did train
    assert case["max_stat_diff"] < 1e-5, case  # loss, grad norm, entropy, KL, ... are the global ones
    assert case["max_param_diff"] < 2e-5, case


@pytest.mark.slow
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


def _listening(pid: int) -> list[str]:
    """The addresses (hex, as /proc/net/tcp* writes them) that sockets of process ``pid`` listen on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.append(cols[1])
    return out


def _loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return ip.endswith("7F")
    return ip == "0" * 31 + "1" or (ip.startswith("0000000000000000FFFF0000") and ip.endswith("7F"))  # ::1, ::ffff:127.*


@pytest.mark.slow
def test_the_ranks_listen_on_no_network_address(small_model):
    """torch.distributed's store and collectives carry no key: a TCP store listened on every interface
    (``*:port``), so anyone on the network could join or disrupt the group.  The ranks meet through a
    file in a private directory and gloo stays on loopback: no socket of theirs listens beyond it."""
    parity = load_benchmark("trainer_parity")
    trainer = ShardedTrainer(small_model, TrainerConfig(device="cpu", world_size=2), SamplingParams())
    try:
        trainer.step(parity.fixed_batch(0, 512))  # the collectives' connections are up
        exposed = {pid: [a for a in _listening(pid) if not _loopback(a)] for pid in trainer.pids}
        assert exposed == {pid: [] for pid in trainer.pids}, exposed
        store = trainer.ranks._store
        assert oct(os.stat(store).st_mode & 0o777) == "0o700"
    finally:
        trainer.close()
    assert not os.path.exists(store)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_the_same_run_and_exports(small_model, tmp_path):
    # each rank writes its own shards (torch.distributed.checkpoint); weights, AdamW moments and step counts, the LR
    # schedule and every rank's RNG come back, so the next step is the uninterrupted run's; export puts the shards
    # together into one HF dir whose logits are the trained model's
    from agentrl.errors import CheckpointError
    from agentrl.recipes.export import export_checkpoint
    from agentrl.trainer.checkpoint import SHARDED, latest_checkpoint, load_checkpoint, save_checkpoint
    from agentrl.trainer.trainer import Trainer

    batch = load_benchmark("trainer_parity").fixed_batch(0, 512)
    cfg = TrainerConfig(device="cpu", world_size=2, lr=1e-3, warmup_steps=2, steps=4)
    first = ShardedTrainer(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        first.step(batch)
        ckpt = save_checkpoint(tmp_path, 1, first.write_state, {"step": 1})
        trained = first.merged_model()
        expected = first.step(batch), first.named_tensors()
    finally:
        first.close()
    # nothing gathered: no trainer.pt, one shard file per rank, each holding about half of the state
    shards = sorted((ckpt / SHARDED).glob("*.distcp"))
    sizes = [f.stat().st_size for f in shards]
    assert not (ckpt / "trainer.pt").exists() and len(shards) == 2 and max(sizes) < 0.7 * sum(sizes), sizes
    assert sorted(f.name for f in (ckpt / SHARDED).glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    saved = load_checkpoint(latest_checkpoint(tmp_path))[0]
    second = ShardedTrainer(small_model, cfg, SamplingParams(), seed=1, run_dir=tmp_path)
    try:
        second.load_state_dict(saved)
        got = second.step(batch), second.named_tensors()
    finally:
        second.close()
    assert got[0]["lr"] == expected[0]["lr"] and abs(got[0]["loss"] - expected[0]["loss"]) < 1e-7
    # the step after the resume is the one the first trainer took (AdamW's step count and moments included)
    assert max(float((got[1][k] - v).abs().max()) for k, v in expected[1].items()) < 1e-7
    # another world size is refused with one line
    with pytest.raises(CheckpointError, match=r"written by 2 trainer ranks.*--trainer.world_size=2") as e:
        Trainer(small_model, TrainerConfig(device="cpu")).load_state_dict(saved)
    assert "\n" not in str(e.value)
    (tmp_path / "config.toml").write_text(f'[model]\npath = "{small_model}"\n')
    out = export_checkpoint(tmp_path, tmp_path / "exported").out
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)


@pytest.mark.slow
def test_a_rank_killed_during_a_save_leaves_the_last_checkpoint(small_model, tmp_path):
    # the save is cut with rank 1 dead: one line naming the newest checkpoint, which stays the newest complete one
    # and resumes; the next save clears the leftovers and applies retention
    from agentrl.trainer.checkpoint import (
        complete_checkpoints,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    batch = load_benchmark("trainer_parity").fixed_batch(0, 512)
    cfg = TrainerConfig(device="cpu", world_size=2, collective_timeout_s=60)
    trainer = ShardedTrainer(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        trainer.step(batch)
        save_checkpoint(tmp_path, 1, trainer.write_state, {"step": 1}, keep=1)
        os.kill(trainer.pids[1], signal.SIGKILL)
        with pytest.raises(TrainerDied, match=r"rank 1 of 2 was killed by signal 9; newest checkpoint: \S+step_00000001"):
            save_checkpoint(tmp_path, 2, trainer.write_state, {"step": 2}, keep=1)
    finally:
        trainer.close()
    assert [c.name for c in complete_checkpoints(tmp_path)] == ["step_00000001"]
    resumed = ShardedTrainer(small_model, cfg, SamplingParams(), run_dir=tmp_path)
    try:
        resumed.load_state_dict(load_checkpoint(latest_checkpoint(tmp_path))[0])
        resumed.step(batch)
        save_checkpoint(tmp_path, 2, resumed.write_state, {"step": 2}, keep=1)
    finally:
        resumed.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]


@pytest.mark.slow
def test_weights_out_leave_rank_0_in_buckets_and_lora_sends_only_adapters(small_model):
    # rank 0 sends a bucket at a time (it never holds the whole gathered model); a LoRA trainer's weights out are the
    # whole plain model with the adapters merged (an engine refuses a partial push), its adapter push only A and s·B
    from agentrl.trainer.trainer import Trainer

    one = Trainer(small_model, TrainerConfig(device="cpu", lora_rank=4), SamplingParams(), seed=0)
    cfg = TrainerConfig(device="cpu", world_size=2, lora_rank=4, push_bucket_mb=0.01)  # 10 KiB
    sharded = ShardedTrainer(small_model, cfg, SamplingParams(), seed=0)
    try:
        buckets: list[dict] = []
        sharded._call("named_tensors", on_part=buckets.append)
        weights, adapters = sharded.named_tensors(), sharded.adapter_tensors()
    finally:
        sharded.close()
    expected = one.named_tensors()
    assert len(buckets) > 2 and sum(len(b) for b in buckets) == len(expected)
    assert all(sum(t.numel() * t.element_size() for t in b.values()) < 10240 + max(t.numel() * 4 for t in b.values())
               for b in buckets)  # a bucket closes once it holds 10 KiB
    assert set(weights) == set(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
    assert set(adapters) == set(one.adapter_tensors()) and all(".lora_" in k for k in adapters)


def _big_checkpoint(root, vocab: int = 65536, hidden: int = 512):
    """A Llama with tied embeddings (SmolLM2's shape, one layer) whose weights are mostly one big embedding, saved
    in bfloat16 across several safetensors files (an index), and the same weights as one pytorch_model.bin."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(root / "st", max_shard_size="20MB")
    (root / "bin").mkdir()
    cfg.save_pretrained(root / "bin")
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    return root / "st", root / "bin", sum(p.numel() for p in model.parameters()) * 4  # bytes in float32


@pytest.mark.slow
def test_no_rank_loads_the_whole_model(tmp_path):
    # each rank builds the model on the meta device and reads only its rows of each tensor from the safetensors files,
    # where the pytorch_model.bin copy still loads whole, then shards; the weights are the same, bfloat16 files read
    # into float32
    st, whole, model_bytes = _big_checkpoint(tmp_path)
    assert (st / "model.safetensors.index.json").exists() and len(list(st.glob("*.safetensors"))) >= 2
    batch = load_benchmark("trainer_parity").fixed_batch(0, 512)
    peaks, weights, losses, loaded_whole = {}, {}, {}, {}
    for label, path in (("sharded", st), ("whole", whole)):
        trainer = ShardedTrainer(path, TrainerConfig(device="cpu", world_size=2), SamplingParams())
        try:
            mem = trainer.memory_by_rank()
            peaks[label] = max(r["setup_peak_rss_bytes"] - r["setup_rss_bytes"] for r in mem)
            loaded_whole[label] = [r["whole_model_loaded"] for r in mem]
            weights[label] = trainer.named_tensors()
            losses[label] = trainer.step(batch)["loss"]
        finally:
            trainer.close()
    # how far the start-up peak rose above what the rank holds once set up (its shard): a read chunk, where loading the
    # whole model and then sharding it peaks at least half the float32 model higher
    assert peaks["sharded"] < 0.25 * model_bytes and peaks["whole"] > 0.5 * model_bytes, (peaks, model_bytes)
    assert loaded_whole == {"sharded": [False, False], "whole": [True, True]}
    assert set(weights["sharded"]) == set(weights["whole"])
    assert all(torch.equal(weights["sharded"][k], v) for k, v in weights["whole"].items())
    # the rotary inv_freq, which the meta model leaves empty, was recomputed: the same step from the same weights
    assert abs(losses["sharded"] - losses["whole"]) < 1e-6, losses


@pytest.mark.slow
def test_a_failing_reader_of_weights_out_leaves_the_pipes_in_step(small_model):
    # on_part raises at the first bucket: the call still reads every rank's reply, so the next call gets its own
    # replies, not the rest of this one's (rank 0's remaining buckets and its reply to named_tensors)
    parity = load_benchmark("trainer_parity")
    cfg = TrainerConfig(device="cpu", world_size=2, push_bucket_mb=0.001)  # ~1 KiB: many buckets
    trainer = ShardedTrainer(small_model, cfg, SamplingParams())
    try:
        def refuse(bucket):
            raise ValueError("the receiver is full")

        with pytest.raises(ValueError, match="the receiver is full"):
            trainer._call("named_tensors", on_part=refuse)
        stats = trainer.step(parity.fixed_batch(0, 512))
        assert "loss" in stats and stats["updates"] >= 1, stats
        mem = trainer.memory_by_rank()
        assert [r["rank"] for r in mem] == [0, 1]
        assert len(trainer.named_tensors()) > 3

        def interrupt(bucket):
            raise KeyboardInterrupt

        # a wait cut short by Ctrl-C cannot drain: the next call refuses in one line instead of reading leftovers
        with pytest.raises(KeyboardInterrupt):
            trainer._call("named_tensors", on_part=interrupt)
        with pytest.raises(TrainerDied, match="interrupted before every rank replied") as e:
            trainer.step(parity.fixed_batch(0, 512))
        assert "\n" not in str(e.value)
    finally:
        trainer.close()


@pytest.mark.slow
def test_calls_from_two_threads_take_turns(small_model):
    # the recipe steps in a worker thread while the supervisor may push to an engine that came back: two calls at
    # once interleaved their collectives and read each other's replies (a hang, or a step answered with weights)
    import threading

    parity = load_benchmark("trainer_parity")
    cfg = TrainerConfig(device="cpu", world_size=2, collective_timeout_s=120, push_bucket_mb=0.001)
    trainer = ShardedTrainer(small_model, cfg, SamplingParams())
    try:
        out: dict[str, object] = {}
        barrier = threading.Barrier(2)

        def run(name, fn):
            barrier.wait()
            try:
                out[name] = fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                out[name] = e

        threads = [threading.Thread(target=run, args=("step", lambda: trainer.step(parity.fixed_batch(0, 512)))),
                   threading.Thread(target=run, args=("weights", trainer.named_tensors))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "two calls at once hung"
        assert isinstance(out["step"], dict) and "loss" in out["step"], out["step"]
        assert isinstance(out["weights"], dict) and len(out["weights"]) > 3, type(out["weights"])
    finally:
        trainer.close()
