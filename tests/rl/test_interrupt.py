"""A newcomer's Ctrl-C, resume and wall budget through the real CLI (issue 23, frictions 5, 6, 11)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentrl_cli import agentrl

pytestmark = pytest.mark.slow


def run_args(model: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 24, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "buffer.filter_zero_variance": "false", "eval.every": 0,
        "trainer.num_threads": 1, "inference.max_batch_size": 16,
    } | extra
    return ["run", *(f"--{k}={v}" for k, v in base.items())]


def seconds(text: str) -> float:
    """'1h02m' / '2m05s' / '7s' -> seconds."""
    h, m, s = (re.search(rf"(\d+){u}", text) for u in ("h", "m", "s"))
    return sum(int(x.group(1)) * k for x, k in ((h, 3600), (m, 60), (s, 1)) if x)


def test_ctrl_c_says_where_the_checkpoint_is_and_the_eta_respects_the_wall_budget(tiny_model, tmp_path):
    """Ctrl-C printed nothing (rc 130); the ETA said 2h32m with a 180 s budget."""
    run_dir = tmp_path / "run"
    args = run_args(tiny_model, run_dir, **{"trainer.steps": 100000, "run.max_wall_s": 900,
                                            "trainer.checkpoint_every": 2})
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists():
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert re.search(r"interrupted: the last complete checkpoint is step \d+ \(.*step_\d+\); run the same command "
                     r"with --resume", err), err[-2000:]
    lefts = re.findall(r"step \d+/100000 \(([^)]*) left\)", err)
    assert lefts, err[-2000:]
    assert all("of run.max_wall_s" in x and seconds(x) <= 900 for x in lefts), lefts


def test_resume_without_a_checkpoint_says_so_before_starting_anything(tiny_model, tmp_path):
    """`--resume` with no checkpoint printed nothing for 25 s, and granted a fresh wall budget silently."""
    run_dir = tmp_path / "run"
    r = agentrl(*run_args(tiny_model, run_dir, **{"trainer.steps": 1, "run.max_wall_s": 300}), "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    note = f"--resume: no complete checkpoint in {run_dir}; starting from step 0; run.max_wall_s (300s) starts again now"
    assert note in r.stderr, r.stderr[-2000:]
    assert r.stderr.index(note) < r.stderr.index("starting the inference engine"), r.stderr[-2000:]


def test_ctrl_c_during_the_warm_start_says_sft_starts_again(tiny_model, tmp_path):
    """Interrupted during SFT, two minutes were lost silently."""
    import shutil

    base = tmp_path / "base"  # the SFT cache is written beside the model: a copy of its own
    shutil.copytree(tiny_model, base)
    args = run_args(base, tmp_path / "run", **{"sft.enabled": "true", "sft.steps": 100000, "sft.batch_size": 4,
                                               "sft.num_demos": 64, "trainer.steps": 1})
    returncode, _, err = _ctrl_c_once_sft_trains(args, stdout=subprocess.DEVNULL)
    assert returncode == 130, err[-2000:]
    assert "interrupted during the SFT warm start: it is saved only when it finishes, so the next run starts it again" \
        in err, err[-2000:]


def test_ctrl_c_during_agentrl_sft_says_what_was_saved_and_what_to_run(tiny_model, tmp_path):
    """`agentrl sft` alone printed nothing on Ctrl-C (`agentrl run` named its checkpoint)."""
    import shutil

    base = tmp_path / "base"  # the SFT cache is written beside the model: a copy of its own
    shutil.copytree(tiny_model, base)
    args = ["sft", f"--model.path={base}", "--env.name=calc", "--sft.steps=100000", "--sft.batch_size=4",
            "--sft.num_demos=64", "--trainer.num_threads=1"]
    returncode, out, err = _ctrl_c_once_sft_trains(args)
    assert returncode == 130 and out == "", err[-2000:]
    note = (f"interrupted during SFT: nothing of it was saved (the warm start is written only when it finishes; "
            f"the base model {base} is kept); run the same command again to start SFT over")
    assert note in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no half-written cache entry was kept


def _ctrl_c_once_sft_trains(args: list[str], stdout: int = subprocess.PIPE) -> tuple[int, str | None, str]:
    """Run `agentrl ARGS`, send Ctrl-C to its process group at the first SFT progress line;
    returns (exit code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", *args], stdout=stdout,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    try:
        for line in proc.stderr:  # the first progress line: SFT is training
            seen.append(line)
            if line.startswith("sft 1/"):
                break
        assert proc.poll() is None, "".join(seen)[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, "".join(seen) + rest
