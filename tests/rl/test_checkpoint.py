"""Checkpoints: renamed into place whole, retention as a setting, every RNG state, and a disk that
fills mid-write (a real ENOSPC on a small tmpfs, or a real EFBIG under RLIMIT_FSIZE) leaves the
previous checkpoint intact with a one-line error."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.errors import CheckpointError
from agentrl.trainer.checkpoint import (
    MARKER,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

ROOT = Path(__file__).resolve().parents[2]


def _state(step: int, numel: int = 16) -> dict:
    return {"w": torch.full((numel,), float(step))}


def _steps(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in complete_checkpoints(run_dir)]


def test_retention_keeps_the_newest_k_and_zero_keeps_all(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path / "two", step, _state(step), {"step": step}, keep=2)
        save_checkpoint(tmp_path / "all", step, _state(step), {"step": step}, keep=0)
    assert _steps(tmp_path / "two") == [4, 5]
    assert _steps(tmp_path / "all") == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "two/checkpoints").iterdir()) == ["step_00000004", "step_00000005"]
    ts, state = load_checkpoint(latest_checkpoint(tmp_path / "two"))
    assert torch.equal(ts["w"], _state(5)["w"]) and state == {"step": 5}
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path / "x", 1, _state(1), {}, keep=-1)


def test_keep_checkpoints_is_a_config_setting_passed_to_the_save(tmp_path):
    import asyncio

    from agentrl.config import load_config
    from agentrl.recipes.rl import make_buffer
    from agentrl.recipes.rl_steps import checkpoint
    from agentrl.rollout import TaskSampler
    from agentrl.types import Message, Task

    assert load_config([]).trainer.keep_checkpoints == 2
    cfg = load_config([], ["--trainer.keep_checkpoints=3"])

    class Weights:
        def state_dict(self):
            return _state(0)

    buffer = make_buffer(cfg.buffer, cfg.trainer.batch_groups)
    sampler = TaskSampler([Task([Message("user", "q")])])
    for version in range(1, 6):
        asyncio.run(checkpoint(tmp_path, Weights(), buffer, sampler, version, keep=cfg.trainer.keep_checkpoints))
    assert _steps(tmp_path) == [3, 4, 5]


KILLED_MID_WRITE = textwrap.dedent("""\
    import os, signal, sys
    import torch
    from agentrl.trainer.checkpoint import save_checkpoint

    class DieWhilePickled:  # SIGKILL with trainer.pt half written
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    run_dir, step = sys.argv[1], int(sys.argv[2])
    save_checkpoint(run_dir, step, {"w": torch.zeros(100_000), "boom": DieWhilePickled()}, {"step": step}, keep=1)
""")


@pytest.mark.parametrize("step", [3, 2], ids=["a new step", "the same step again (resume)"])
def test_a_save_killed_mid_write_leaves_the_last_complete_checkpoint(tmp_path, step):
    save_checkpoint(tmp_path, 1, _state(1), {"step": 1}, keep=1)
    save_checkpoint(tmp_path, 2, _state(2), {"step": 2}, keep=1)
    script = tmp_path / "die.py"
    script.write_text(KILLED_MID_WRITE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path), str(step)], capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    assert _steps(tmp_path) == [2]  # step 1 went by retention; step 2 is whole
    ts, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(ts["w"], _state(2)["w"]) and state == {"step": 2}
    save_checkpoint(tmp_path, 4, _state(4), {"step": 4}, keep=1)  # the next save clears the leftovers
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]


def test_a_swap_cut_between_its_two_renames_is_finished_by_the_next_listing(tmp_path):
    ckpt = save_checkpoint(tmp_path, 2, _state(2), {"step": 2})
    os.rename(ckpt, ckpt.with_name(".old-" + ckpt.name))  # killed after moving the old one aside
    assert latest_checkpoint(tmp_path) == ckpt and (ckpt / MARKER).is_file()
    new = save_checkpoint(tmp_path, 2, _state(7), {"step": 2})
    shutil.copytree(new, new.with_name(".old-" + new.name))  # killed after the new one landed
    assert latest_checkpoint(tmp_path) == new and not new.with_name(".old-" + new.name).exists()
    assert torch.equal(load_checkpoint(new)[0]["w"], _state(7)["w"])


def test_a_damaged_checkpoint_is_refused_with_what_to_do(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, _state(1, numel=4096), {"step": 1})
    data = (ckpt / "trainer.pt").read_bytes()
    (ckpt / "trainer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"damaged: trainer.pt has \d+ bytes, \d+ were written"):
        load_checkpoint(ckpt)


def _draws() -> list:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def test_every_rng_state_is_saved_and_restored_through_a_checkpoint(tmp_path):
    from agentrl.config import TrainerConfig
    from agentrl.tiny_model import build_tiny_model
    from agentrl.trainer.trainer import Trainer

    tr = Trainer(build_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2), TrainerConfig(), seed=3)
    np.random.seed(11)
    _draws()  # move every generator away from its seed
    ckpt = save_checkpoint(tmp_path / "run", 1, tr.state_dict(), {"step": 1})
    expected = _draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # a fresh process starts elsewhere
    ts, _ = load_checkpoint(ckpt)
    assert set(ts["rng"]) >= {"python", "numpy", "torch"}
    tr.load_state_dict(ts)
    assert _draws() == expected


class _OpensAFile:
    """Pickles as a call to ``open(path, "w")``: unpickling it creates ``path`` (any code could run there)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """Attack: a checkpoint directory is a file any program of the user can write (a harness program
    runs as the same user), and trainer.pt (and a sharded rank's rank_K.pt) were unpickled with
    weights_only=False: loading ran whatever the file named.  Now they load weights-only: the file is
    refused in one line and the marker its pickle would create never appears."""
    marker = tmp_path / "pwned"
    ckpt = save_checkpoint(tmp_path / "run", 1, {"w": torch.zeros(4), "rng": _OpensAFile(marker)}, {"step": 1})
    with pytest.raises(CheckpointError, match=r"trainer.pt holds an object other than tensors and numbers "
                                              r"\(io.open\): not loaded"):  # fmt: skip
        load_checkpoint(ckpt)
    assert not marker.exists()
    from agentrl.trainer.checkpoint import load_tensors  # what a sharded rank reads its rank_K.pt with

    torch.save({"scheduler": {}, "rng": _OpensAFile(marker)}, tmp_path / "rank_0.pt")
    with pytest.raises(CheckpointError, match="rank_0.pt holds an object other than tensors"):
        load_tensors(tmp_path / "rank_0.pt")
    assert not marker.exists()
    # nothing in the package loads a pickle with weights_only=False any more
    assert not [p for p in (ROOT / "agentrl").rglob("*.py") if "weights_only=False" in p.read_text()]


def test_a_sharded_checkpoint_whose_dcp_pickles_would_run_code_is_refused(tmp_path, monkeypatch):
    """torch.distributed.checkpoint unpickles its .metadata with pickle.load and its non-tensor items
    (the optimizer's hyperparameters) with weights_only=False: a sharded checkpoint is read only when
    they name nothing but DCP's records and plain values; export and a rank's resume both refuse."""
    import copy
    import io
    import pickle
    import types
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from agentrl.trainer.checkpoint import load_sharded_weights, weights_only_planner

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "trainer", no_dist=True)
        # what a rank's resume reads, optimizer hyperparameters (non-tensor items) included, through the planner
        back = copy.deepcopy({"model": msd, "optimizer": osd})
        back["optimizer"]["param_groups"][0]["lr"], back["model"]["weight"] = 0.5, torch.zeros(3, 4)
        real_load, unpickled = torch.load, []
        monkeypatch.setattr(torch, "load", lambda *a, **kw: unpickled.append(kw.get("weights_only")) or real_load(*a, **kw))
        dcp.load(back, checkpoint_id=tmp_path / "trainer", no_dist=True, planner=weights_only_planner())
        monkeypatch.setattr(torch, "load", real_load)
    # the bytes that passed the weights-only load are not parsed again unrestricted (DCP's own load_bytes does)
    assert unpickled and False not in unpickled, unpickled
    assert back["optimizer"]["param_groups"][0]["lr"] == 1e-3 and torch.equal(back["model"]["weight"], model.weight)
    assert torch.equal(load_sharded_weights(tmp_path / "trainer")["weight"], model.weight.detach())
    marker = tmp_path / "pwned"
    (tmp_path / "trainer" / ".metadata").write_bytes(pickle.dumps(_OpensAFile(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata names an object other than torch.distributed.checkpoint's"):
        load_sharded_weights(tmp_path / "trainer")
    item = types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="optimizer.param_groups.0.lr"))
    with pytest.raises(CheckpointError, match="optimizer.param_groups.0.lr holds an object other than tensors"):
        weights_only_planner().load_bytes(item, io.BytesIO(pickle.dumps(_OpensAFile(marker))))
    assert not marker.exists()


def test_a_dcp_metadata_swapped_between_a_check_and_the_load_still_runs_nothing(tmp_path, monkeypatch):
    """Time of check, time of use: another program of the user swaps ``.metadata`` for a pickle that
    runs code after any check of it and before torch.distributed.checkpoint opens it (DCP's reader
    runs plain ``pickle.load``).  The load's own read is the restricted one, so neither export nor a
    rank's resume runs it."""
    import io
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from agentrl.trainer import checkpoint as ckpt_mod
    from agentrl.trainer.checkpoint import load_sharded_weights

    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        msd, _ = get_state_dict(model, torch.optim.AdamW(model.parameters()))
        dcp.save({"model": msd}, checkpoint_id=tmp_path / "trainer", no_dist=True)
    meta = tmp_path / "trainer" / ".metadata"
    good, marker = meta.read_bytes(), tmp_path / "pwned"
    bad, real_open, swaps = pickle.dumps(_OpensAFile(marker)), io.open, []

    def swapped_for_the_load(file, mode="r", *a, **kw):  # pathlib's open, which DCP's file system uses
        if str(file).endswith(".metadata") and "r" in mode:
            with real_open(meta, "wb") as f:
                f.write(bad)
            swaps.append(file)
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(io, "open", swapped_for_the_load)
    loads = [lambda: load_sharded_weights(tmp_path / "trainer")]  # agentrl export
    if hasattr(ckpt_mod, "load_dcp"):  # a rank's resume
        loads.append(lambda: ckpt_mod.load_dcp({"model": dict(msd)}, tmp_path / "trainer", no_dist=True))
    for load in loads:
        meta.write_bytes(good)
        swaps.clear()
        with warnings.catch_warnings(), pytest.raises(CheckpointError, match=r"\.metadata names an object other"):
            warnings.simplefilter("ignore", UserWarning)
            load()
        assert swaps and not marker.exists()


def test_a_cut_off_or_corrupt_checkpoint_file_is_one_line_naming_it(tmp_path):
    """A trainer.pt whose bytes were damaged (same size, so the COMPLETE sizes match) or cut off, and a
    cut-off DCP .metadata: each is the one-line "unreadable" CheckpointError naming the file, not a
    torch traceback, and a cut-off .metadata is not blamed as code that would run."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from agentrl.trainer.checkpoint import load_sharded_weights, load_tensors

    ckpt = save_checkpoint(tmp_path / "run", 1, _state(1), {"step": 1})
    pt = ckpt / "trainer.pt"
    data = pt.read_bytes()
    pt.write_bytes(data[:-300] + bytes(300))  # the zip's central directory zeroed
    with pytest.raises(CheckpointError, match=r"trainer\.pt is unreadable \(truncated or corrupt\): .*without --resume"):
        load_checkpoint(ckpt)
    for cut in (data[: len(data) // 2], b""):
        pt.write_bytes(cut)
        with pytest.raises(CheckpointError, match=r"trainer\.pt is unreadable \(truncated or corrupt\)"):
            load_tensors(pt)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=tmp_path / "trainer", no_dist=True)
    meta = tmp_path / "trainer" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with warnings.catch_warnings(), pytest.raises(CheckpointError) as e:
        warnings.simplefilter("ignore", UserWarning)
        load_sharded_weights(tmp_path / "trainer")
    assert ".metadata is unreadable (truncated or corrupt)" in str(e.value) and "run code" not in str(e.value), e.value


def test_rng_states_are_tensors_and_numbers_and_older_checkpoints_still_resume(tmp_path):
    """What agentrl writes now loads with a plain weights-only load (no allowlist); a checkpoint from
    before (python's state a tuple, numpy's a pickled array) still restores every generator."""
    ckpt = save_checkpoint(tmp_path / "new", 1, {"rng": rng_state()}, {"step": 1})
    torch.load(ckpt / "trainer.pt", weights_only=True)  # raises on any pickled object
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    _draws()
    older = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    ckpt = save_checkpoint(tmp_path / "old", 1, {"rng": older}, {"step": 1})
    expected = _draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    set_rng_state(load_checkpoint(ckpt)[0]["rng"])
    assert _draws() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_state_is_saved_and_restored():
    torch.cuda.manual_seed_all(5)
    torch.rand(3, device="cuda")
    state = rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(3, device="cuda").cpu()
    torch.cuda.manual_seed_all(99)
    set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda").cpu(), expected)


DISK_FULL_CHILD = textwrap.dedent("""\
    import json, os, sys
    import torch
    from agentrl.errors import CheckpointError
    from agentrl.trainer.checkpoint import complete_checkpoints, load_checkpoint, save_checkpoint

    run_dir = sys.argv[1]
    save_checkpoint(run_dir, 1, {"w": torch.ones(1000)}, {"step": 1}, keep=2)  # fits
    try:  # 4 MB into a 1 MiB filesystem (or file-size limit)
        save_checkpoint(run_dir, 2, {"w": torch.ones(1_000_000)}, {"step": 2}, keep=2)
        raised = None
    except CheckpointError as e:
        raised = str(e)
    # what is left: reported from here, since a private tmpfs vanishes with this process
    ckpts = complete_checkpoints(run_dir)
    ts, state = load_checkpoint(ckpts[-1])
    print(json.dumps({"raised": raised, "steps": [p.name for p in ckpts], "w_sum": float(ts["w"].sum()),
                      "state": state, "entries": sorted(os.listdir(os.path.join(run_dir, "checkpoints")))}))
""")


def _run_disk_full_child(tmp_path: Path) -> tuple[dict, Path, str]:
    """Run the child where writes really fail: (its report, run dir, how).  ENOSPC from a 1 MiB
    tmpfs in a private mount namespace where this host allows one, else EFBIG under RLIMIT_FSIZE."""
    script = tmp_path / "child.py"
    script.write_text(DISK_FULL_CHILD)
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    unshare = shutil.which("unshare")
    if unshare:
        flags = ["--mount", "--propagation", "private"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
        inner = f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} {script} {mnt / 'run'}"
        r = subprocess.run([unshare, *flags, "sh", "-c", inner], capture_output=True, text=True, timeout=120, env=env)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1]), mnt / "run", "tmpfs"
    import resource
    import signal

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = subprocess.run([sys.executable, str(script), str(mnt / "run")], capture_output=True, text=True, timeout=120,
                       env=env, preexec_fn=limit_file_size)
    if r.returncode != 0:
        pytest.skip(f"cannot make writes fail here (no private tmpfs, no RLIMIT_FSIZE): {r.stderr[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), mnt / "run", "rlimit"


def test_a_disk_that_fills_mid_checkpoint_is_one_line_and_keeps_the_previous(tmp_path):
    report, run_dir, how = _run_disk_full_child(tmp_path)
    msg = report["raised"]
    assert msg is not None, f"no CheckpointError ({how})"
    cause = "No space left on device" if how == "tmpfs" else "File too large"
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_00000002'} not written: {cause}" in msg, msg
    assert "free there now" in msg and "the last complete checkpoint step_00000001 is intact" in msg
    assert "--resume" in msg and "\n" not in msg
    assert report["steps"] == ["step_00000001"]
    assert report["entries"] == ["step_00000001"]  # the partial step 2 was removed
    assert report["w_sum"] == 1000.0 and report["state"] == {"step": 1}
