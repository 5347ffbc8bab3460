"""`agentrl view --serve` as a user starts it, the text view of an eval directory, and the
progress lines (ETA on the run's status line; plain lines when not a terminal)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from agentrl.metrics import LiveProgress, StepProgress, format_seconds


def test_view_serve_prints_its_url_and_serves_the_run(real_run):
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "view", str(real_run), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        url, _, token = line.strip().split(": ")[-1].split()[0].partition("?token=")
        assert url.startswith("http://127.0.0.1:") and len(token) > 40, line  # a key made here, Jupyter-style
        assert httpx.get(url + "api/meta", timeout=30).status_code == 401
        http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)
        meta = http.get(url + "api/meta").json()
        assert meta["kind"] == "run" and meta["config"]["env"] == "calc"
        page = http.get(url).text
        assert "static/app.js" in page and "cdn" not in page.lower()  # the page ships with the package
        assert http.get(url + "static/app.js").status_code == 200
        assert http.get(url + "static/../config.toml").status_code == 404
        assert http.get(url + "api/episode/nope").status_code == 404
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_view_of_a_missing_dir_is_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(tmp_path), "--serve"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


def test_text_view_of_an_eval_directory(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"env": "calc", "model": "m"}))
    rec = {"task_index": 0, "rollout": 0, "messages": [], "reward": 1.0, "error": None, "stop_reason": "done",
           "turns": 2, "metrics": {}}
    (tmp_path / "results.jsonl").write_text(json.dumps(rec) + "\n")
    res = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "mean reward" in res.stdout and "1.0000" in res.stdout


def test_run_status_line_has_an_eta(capsys):
    live = LiveProgress(total_steps=10)
    live.update({"step": 0, "time/rl_wall_s": 2.0})
    live.update({"step": 1, "time/rl_wall_s": 4.0})  # 2 s a step, 8 steps left
    err = capsys.readouterr().err
    assert "step 1/10 (18s left)" in err and "step 2/10 (16s left)" in err
    assert format_seconds(75) == "1m15s" and format_seconds(3700) == "1h01m"


def test_step_progress_is_plain_lines_off_a_terminal(capsys):
    with StepProgress("sft", 45, every=20) as bar:
        for _ in range(45):
            bar.step("loss 0.1")
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/45", "21/45", "41/45", "45/45"]
    assert "\x1b" not in "".join(lines)  # no control codes in logs
