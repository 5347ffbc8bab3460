"""The C heap of CPU processes (agentrl.heap): freed buffers reused, resident memory bounded.

Issue 25: SmolLM2-135M on the CPU grew ~600 MB per RL step until the OOM killer ended the run
(glibc kept the micro-batches' freed activations).  Trimming the heap after every step fixed
that but made every step fault its whole working set in again; the trainer now trims only
past a bound (HeapBudget)."""

from __future__ import annotations

import random
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl import heap
from agentrl.config import TrainerConfig
from agentrl.heap import HeapBudget, _libc
from agentrl.tiny_model import build_family_model
from agentrl.trainer.trainer import Trainer
from agentrl.types import Group, Message, Task, TokenSequence, Trajectory

glibc = pytest.mark.skipif(_libc() is None, reason="mallopt and malloc_trim are glibc's")


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


@glibc
def test_an_engine_process_reuses_freed_memory_instead_of_faulting_it_in_every_step():
    """``keep_freed_memory`` (the server, its core and the CPU trainer call it): a step's worth of logits- and
    prefill-sized tensors, allocated and freed 20 times, page-faults nothing once the process
    keeps freed memory; glibc's defaults map the tensor over 32 MiB afresh every step (the
    smaller ones only in some address-space layouts: glibc raises its threshold for them, so a
    total over all sizes failed this test both ways, in about half the runs).  Per step, the
    median: the heap can still settle in a step after the warm-up (a one-time first touch)."""
    step = ("import resource, sys, torch\n"
            "from agentrl.heap import keep_freed_memory\n"
            "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
            "def step():\n"
            "    a, c = torch.ones(64, 49152), torch.ones(2048, 1536)\n"
            "    b, d = a.double(), torch.ones(2048, 3072)\n"
            "    del b, d\n"
            "    return a, c, torch.ones(4096, 3072)\n"
            "for _ in range(3): step()\n"
            "faults = []\n"
            "for _ in range(20):\n"
            "    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    step()\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n"
            "print(*faults)\n")
    faults = {mode: sorted(map(int, subprocess.run([sys.executable, "-c", step, mode], capture_output=True, text=True,
                                                   check=True, timeout=120).stdout.split()))
              for mode in ("default", "keep")}  # fmt: skip
    median = {mode: f[len(f) // 2] for mode, f in faults.items()}
    assert median["default"] > 10_000, faults  # 48 MiB a step at least: the cost this removes
    assert median["keep"] < median["default"] / 100, faults


@pytest.mark.parametrize("glibc_max", [None, 32 << 20, 0])
def test_keep_freed_memory_never_freezes_glibcs_threshold_low(monkeypatch, glibc_max):
    """Older glibc (2.34 at least) refuses an mmap threshold over 32 MiB, and any of these mallopt calls
    switches off the threshold glibc raises by itself: the trim and pad settings alone would
    leave every tensor over 128 KiB a fresh mmap for good.  So: 256 MiB, else 32 MiB, else
    nothing at all (a C library that refuses both)."""
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        ok = glibc_max is None or param != heap._M_MMAP_THRESHOLD or value <= glibc_max
        calls.append((param, value))
        return int(ok)

    monkeypatch.setattr(heap, "_libc", lambda: type("Libc", (), {"mallopt": staticmethod(mallopt)})())
    done = heap.keep_freed_memory()
    thresholds = [v for p, v in calls if p == heap._M_MMAP_THRESHOLD]
    others = [p for p, _ in calls if p != heap._M_MMAP_THRESHOLD]
    if glibc_max == 0:
        assert not done and not others, calls
    else:
        assert done and thresholds[-1] == min(256 << 20, glibc_max or 256 << 20), calls
        assert sorted(others) == [heap._M_TOP_PAD, heap._M_TRIM_THRESHOLD], calls


def _trainer(tmp_path) -> Trainer:
    path = build_family_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=1024,
                              num_attention_heads=4, max_position_embeddings=1024)  # fmt: skip
    return Trainer(path, TrainerConfig.model_validate({"micro_batch_tokens": 4096, "lr": 1e-4, "dtype": "float32"}))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@glibc
def test_trainer_steps_of_seen_shapes_fault_no_pages_in(tmp_path, one_thread):
    """The same batch stepped again reuses the freed buffers: trimming after every step (the
    fix for issue 25 before HeapBudget) faulted ~50,000 pages back in on every step here."""
    trainer = _trainer(tmp_path)
    batch = _groups(random.Random(0), trainer.vocab_size)
    faults = []
    for _ in range(7):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        trainer.step(batch)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    later = sorted(faults[3:])
    assert faults[0] > 10_000, faults  # the first step touches its working set: what this saves
    assert later[len(later) // 2] < faults[0] / 10, faults  # measured: 0 to 2,100 against 55,000


@glibc
def test_freed_memory_piling_up_between_steps_is_returned_at_the_next_step(tmp_path, one_thread):
    """Fragmentation made deterministic: 600 MiB allocated, touched and freed between steps stays
    resident (glibc keeps it for reuse); the step after it ends over the budget's limit, so it
    trims, and the process ends that step within the limit again."""
    trainer = _trainer(tmp_path)
    rng = random.Random(0)
    for _ in range(3):
        trainer.step(_groups(rng, trainer.vocab_size))
    limit, trims = trainer._heap.limit, trainer._heap.trims
    assert limit is not None and heap.resident_bytes() <= limit
    pile = [torch.ones(150 << 18) for _ in range(4)]  # 4 x 150 MiB of float32, every page touched
    del pile
    assert heap.resident_bytes() > limit, "the freed pile was returned at once: the test shows nothing"
    trainer.step(_groups(rng, trainer.vocab_size))
    assert trainer._heap.trims == trims + 1
    assert heap.resident_bytes() <= limit, f"{heap.resident_bytes() >> 20} MiB resident, limit {limit >> 20} MiB"


def test_heap_budget_trims_past_live_plus_twice_the_first_working_set(monkeypatch):
    """The bound's arithmetic on a scripted resident size (MiB): live 100 after a trim, the next
    step leaves 150 (working set 50), so the limit is 200; 190 and 200 keep, 201 trims."""
    readings = iter([r << 20 for r in (100, 150, 190, 200, 201, 120, 130, 185, 125)])
    trims = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda **_: True)
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(readings))
    monkeypatch.setattr(heap, "release_free_memory", lambda: trims.append(len(trims)) or True)
    budget = HeapBudget()
    assert budget.after_step() is True  # nothing measured yet: trim, and the live set is what remains
    assert budget.live == 100 << 20 and budget.limit is None
    assert [budget.after_step() for _ in range(3)] == [False, False, False]  # 150 sets the limit; 190, 200 keep
    assert budget.limit == 200 << 20
    assert budget.after_step() is True and budget.live == 120 << 20  # 201 > 200: trimmed down to 120
    # 130: a working set of 10 MiB, so the floor keeps 64 MiB (a limit of 121 would trim on noise)
    assert budget.after_step() is False and budget.limit == (120 << 20) + heap.MIN_KEPT
    assert budget.after_step() is True and budget.live == 125 << 20  # 185 > 184
    assert len(trims) == 3


_THREADED_STEPS = """
import asyncio, random, resource, sys, torch
from pathlib import Path
from agentrl import heap
if sys.argv[1] == "cli":
    assert heap.keep_freed_memory(single_arena=True)  # what `agentrl run` and `agentrl sft` do first
sys.path.insert(0, sys.argv[3])
from test_heap import _groups, _trainer

async def main():
    torch.set_num_threads(1)
    # the worker threads allocate before the trainer exists (engines start, tasks load)
    await asyncio.gather(*(asyncio.to_thread(lambda: torch.ones(1 << 22).sum()) for _ in range(4)))
    trainer = _trainer(Path(sys.argv[2]))
    batch = _groups(random.Random(0), trainer.vocab_size)
    faults = []
    for _ in range(9):
        await asyncio.gather(*(asyncio.to_thread(lambda: torch.ones(1 << 16).sum()) for _ in range(3)))
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        await asyncio.to_thread(trainer.step, batch)  # as the run loop steps (recipes/rl_steps.py)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(*faults)
    sys.stdout.flush()
    heap._libc().malloc_stats()  # one "Arena N:" block per arena, on stderr

asyncio.run(main())
"""


@glibc
def test_steps_in_worker_threads_share_one_arena_when_set_first(tmp_path):
    """The run loop steps in ``asyncio.to_thread`` workers, a different one each time: with an
    arena per thread the next step's thread finds none of the freed buffers (and a chunk over
    64 MiB is always a fresh mapping there).  Set before the threads allocate, as the CLI does,
    one shared arena lets every step reuse them; set only when the trainer is built, it is too late.

    What is checked cannot come out by luck: the arenas glibc made (``malloc_stats``), and the
    page faults of later steps against the same process's first step (nothing freed to reuse
    yet).  The late side's faults are not compared: a step that lands on the thread that ran the
    last one reuses its arena's buffers, and whole runs of late steps did."""
    here = str(Path(__file__).parent)
    faults, arenas = {}, {}
    for mode in ("cli", "late"):
        out = subprocess.run([sys.executable, "-c", _THREADED_STEPS, mode, str(tmp_path / mode), here],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = list(map(int, out.stdout.split()))
        arenas[mode] = len(re.findall(r"^Arena \d+:", out.stderr, re.M))
    assert arenas["cli"] == 1 and arenas["late"] > 1, (arenas, faults)  # late: the workers kept their own
    cold, later = faults["cli"][0], faults["cli"][3:]
    assert cold > 5_000, faults  # a step's working set faults in when nothing is kept: or the test shows nothing
    assert sum(later) / len(later) < cold / 10, faults  # measured: ~1,000 against ~55,000
