"""The viewer's reader (agentrl.viewer.data) on a real run directory, and on the edge cases a
live run produces: truncation on --resume, fields that are missing or renamed (torn lines, malformed
records and files too large for one poll: test_hostile_files.py)."""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict

from agentrl.metrics import read_jsonl
from agentrl.viewer.data import RunView, detect_kind, episode_summary


def test_streams_match_the_run_files(real_run, steps):
    view = RunView(real_run)
    assert view.kind == "run"
    got = view.poll()
    assert [r["step"] for r in got["metrics"]] == list(range(steps))
    train = read_jsonl(real_run / "rollouts.jsonl")
    held_out = read_jsonl(real_run / "eval_rollouts.jsonl")
    assert {e["id"] for e in got["episodes"]} == {r["id"] for r in train + held_out}
    # held-out episodes are recorded at every eval version: the same tasks at 0, 2 and 4
    assert sorted({r["eval_version"] for r in held_out}) == [0, 2, 4]
    # every fate in the ledger reaches the page, counted as the metrics count them
    fates = defaultdict(int)
    for f in got["fates"]:
        fates[f["fate"]] += 1
    last = got["metrics"][-1]
    assert fates["trained"] == last["ledger/trained"] == steps * 2 * 4
    assert got["status"]["last_step"] == steps - 1 and got["status"]["finished"]
    # nothing new past the cursors
    again = view.poll(got["epoch"], **got["cursor"])
    assert again["metrics"] == again["episodes"] == again["fates"] == []


def test_advantages_of_trained_groups_are_the_trainers(real_run):
    view = RunView(real_run)
    got = view.poll()
    by_id = {e["id"]: e for e in got["episodes"]}
    groups = defaultdict(list)
    for f in got["fates"]:
        if f["fate"] == "trained":
            assert f["advantage"] is not None, f
            groups[by_id[f["id"]]["group"]].append((by_id[f["id"]]["reward"], f["advantage"]))
    assert groups
    for members in groups.values():  # reward − group mean: sums to 0, ordered like the rewards
        assert math.isclose(sum(a for _, a in members), 0.0, abs_tol=1e-9)
        mean = sum(r for r, _ in members) / len(members)
        assert all(math.isclose(a, r - mean, abs_tol=1e-9) for r, a in members)


def test_episode_detail_has_tool_calls_and_decoded_tokens(real_run):
    view = RunView(real_run)
    eps = view.poll()["episodes"]
    with_tools = [e for e in eps if e["tool_calls"] and e["source"] == "train"]
    assert with_tools, "the warm-started policy made no tool call"
    ep = view.episode(with_tools[0]["id"])
    assert any(m["role"] == "tool" for m in ep["messages"])
    (seq,) = ep["sequences"]
    n = len(seq["ids"])
    assert n and all(len(seq[k]) == n for k in ("text", "logprobs", "versions", "mask"))
    assert "".join(seq["text"]).count("calculator") >= 1  # token text comes from the run's tokenizer
    sampled = [i for i, m in enumerate(seq["mask"]) if m]
    assert sampled and len(sampled) < n  # prompt / tool tokens are not trained on
    assert all(seq["logprobs"][i] <= 0 and seq["versions"][i] >= 0 for i in sampled)
    assert view.episode("no-such-episode") is None


def test_resume_truncation_starts_a_new_epoch(real_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("final", "tensorboard"))
    view = RunView(run)
    first = view.poll()
    rows = read_jsonl(run / "metrics.jsonl")[:2]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = view.poll(first["epoch"], **first["cursor"])
    assert second["epoch"] != first["epoch"]
    assert [r["step"] for r in second["metrics"]] == [0, 1]  # everything again, from the new content
    assert len(second["episodes"]) == len(first["episodes"])


def test_fields_are_read_defensively(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[trainer]\nsteps = 3\n")
    # a rollout without sequences/messages; one without an id (skipped); a later field rename
    (run / "rollouts.jsonl").write_text(
        json.dumps({"id": "a", "group_id": "g", "reward": 1.0, "advantage": 0.25}) + "\n"
        + json.dumps({"reward": 0.5}) + "\n"
        + json.dumps({"id": "b", "group_id": "g", "reward": 0.0, "advantage": -0.25, "task": {"prompt": "x"},
                      "new_field": 1}) + "\n")
    # one ledger record per episode; unknown keys ignored; an old per-step row still reads
    (run / "ledger.jsonl").write_text(
        json.dumps({"id": "a", "group": "g", "task": "t", "fate": "trained", "step": 0, "future": 1}) + "\n"
        + json.dumps({"step": 0, "trained": ["b"], "interrupted": [], "some_future_list": ["zzz"]}) + "\n")
    view = RunView(run)
    got = view.poll()
    assert [e["id"] for e in got["episodes"]] == ["a", "b"]
    assert {(f["id"], f["fate"], f["advantage"], f["advantage_source"]) for f in got["fates"]} == {
        ("a", "trained", 0.25, "rollouts"), ("b", "trained", -0.25, "rollouts")}
    ep = view.episode("a")
    assert ep["messages"] == [] and ep["sequences"] == []
    assert view.meta()["charts"]  # no metrics yet: the layout is still there


def test_eval_directory_is_recognised(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps({
        "task_index": 3, "rollout": 1, "messages": [{"role": "user", "content": "q"}], "reward": 1.0,
        "error": None, "stop_reason": "done", "turns": 1}) + "\n")
    assert detect_kind(tmp_path) == "eval"
    view = RunView(tmp_path)
    (ep,) = view.poll()["episodes"]
    assert ep["id"] == "3.1" and ep["fate"] == "evaluated" and ep["question"] == "q"
    assert view.meta()["charts"] == []
    assert episode_summary({"no": "index"}, "results") is None
