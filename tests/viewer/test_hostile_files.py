"""The viewer on files a long or broken run leaves: a malformed record between good ones, token
arrays that are not token ids, a rollouts file far larger than one poll should read, a ledger
with more fates than one response should carry.  The page must keep every good row, say what
it skipped and how far it still has to read, and never answer 500."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

import agentrl.viewer.data as data
from agentrl.viewer.data import PAGE, RunView, Tail
from agentrl.viewer.server import ViewerServer


def _rollout(i: int, **fields) -> dict:
    return {"id": f"ep{i}", "group_id": "g0", "task": {"prompt": f"q{i}", "answer": "a"}, "reward": 1.0,
            "advantage": 0.5, "trainer_version": 0, "stop_reason": "done", "turns": [{"finish_reason": "stop"}],
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}],
            "sequences": [{"token_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "logprobs": [None, -0.1, -0.2],
                           "versions": [-1, 0, 0]}], **fields}


def _run(tmp_path: Path, rollouts: list, ledger: list, evals: list = ()) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[trainer]\nsteps = 3\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 1.0}) + "\n")
    for name, rows in (("rollouts", rollouts), ("ledger", ledger), ("eval_rollouts", evals)):
        (run / f"{name}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return run


def _trained(*ids: str) -> list[dict]:
    return [{"id": i, "group": "g0", "task": "t", "fate": "trained", "step": 0} for i in ids]


# ----------------------------------------------------------------------------- a malformed record


def test_a_malformed_row_between_good_ones_keeps_every_good_row(tmp_path):
    odd = _rollout(1, task="a string", sequences=["x", {"loss_mask": 3, "versions": "v"}], messages="hello",
                   turns={"a": 1}, group_id=7)
    run = _run(tmp_path, [_rollout(0), odd, "not json", "[1, 2]", _rollout(2, messages=[
        {"role": "assistant", "content": "x", "tool_calls": "abc"}])],
        _trained("ep0", "ep1", "ep2"), [_rollout(9, id="ev0", eval_version=0)])
    view = RunView(run)
    got = view.poll()
    # the odd-shaped record is read as far as it can be; the two lines that are no record are counted
    assert [e["id"] for e in got["episodes"]] == ["ep0", "ep1", "ep2", "ev0"]
    assert {f["id"] for f in got["fates"]} == {"ep0", "ep1", "ep2"}
    assert got["status"]["skipped_rows"] == 2
    assert got["status"]["skipped_first"].startswith("rollouts.jsonl")
    ep1 = next(e for e in got["episodes"] if e["id"] == "ep1")
    assert ep1["tool_calls"] == 0 and ep1["turns"] is None and ep1["tokens"] == 0 and ep1["group"] == "7"
    assert next(e for e in got["episodes"] if e["id"] == "ep2")["tool_calls"] == 0
    again = view.poll(got["epoch"], **got["cursor"])  # nothing lost, nothing counted twice
    assert again["episodes"] == again["fates"] == [] and again["status"]["skipped_rows"] == 2
    assert len(view.poll()["fates"]) == 3


def test_a_row_the_reader_cannot_summarise_is_skipped_and_counted(tmp_path, monkeypatch):
    run = _run(tmp_path, [_rollout(i) for i in range(3)], _trained("ep0", "ep1", "ep2"))
    summary = data.episode_summary

    def breaks_on_ep1(rec, source):
        if rec.get("id") == "ep1":
            raise KeyError("a field no one expected")
        return summary(rec, source)

    monkeypatch.setattr(data, "episode_summary", breaks_on_ep1)
    view = RunView(run)
    got = view.poll()
    assert [e["id"] for e in got["episodes"]] == ["ep0", "ep2"]
    assert {f["id"] for f in got["fates"]} == {"ep0", "ep1", "ep2"}  # the ledger was not given up
    assert got["status"]["skipped_rows"] == 1 and "a field no one expected" in got["status"]["skipped_first"]
    assert view.poll(got["epoch"], **got["cursor"])["status"]["skipped_rows"] == 1  # the tail moved past it


def test_a_tail_moves_past_a_line_only_once_it_was_taken(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    tail, seen = Tail(path), []

    def take(offset: int, row: dict | None) -> None:
        if row == {"a": 2} and not seen.count(row):
            seen.append(row)
            raise RuntimeError("the caller failed on this row")
        seen.append(row)

    try:
        tail.read(take)
    except RuntimeError:
        pass
    tail.read(take)  # the failed row again, then the rest
    assert seen == [{"a": 1}, {"a": 2}, {"a": 2}, {"a": 3}]


def test_tail_skips_torn_lines_and_restarts_after_truncation(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = Tail(path)

    def rows() -> list:
        out: list = []
        tail.read(lambda offset, row: out.append(row))
        return out

    assert not tail.replaced() and rows() == []
    path.write_text('{"a": 1}\n{"a": 2')  # the writer is mid-line
    assert rows() == [{"a": 1}]
    with open(path, "a") as f:
        f.write('}\nnot json\n{"a": 3}\n')
    assert rows() == [{"a": 2}, None, {"a": 3}]  # None: a line that is no JSON object
    path.write_text('{"a": 9}\n')  # truncated (resume rewrites the file)
    assert tail.replaced()
    tail = Tail(path)
    assert rows() == [{"a": 9}]


def test_the_server_answers_every_route_on_broken_records(tmp_path):
    seq = _rollout(0)["sequences"][0]
    broken = {"ids": _rollout(1, sequences=[{**seq, "token_ids": ["abc", 5, 6]}]),
              "huge": _rollout(2, sequences=[{**seq, "token_ids": [10**30, 5, 6]}]),
              "columns": _rollout(3, sequences=[{**seq, "versions": 5, "loss_mask": None, "logprobs": "x"}],
                                  messages=[{"role": "assistant", "content": "hi", "tool_calls": 5}],
                                  metrics=[1], timing="slow", task={"answer": "42", "info": 1}),
              "task": _rollout(4, task="a string", turns=[{"completion_ids": 3}, "x"])}
    run = _run(tmp_path, [_rollout(0), *broken.values(), "{", _rollout(5)], _trained("ep0", "ep5"))
    with ViewerServer(run) as srv, httpx.Client(base_url=srv.url, timeout=30,
                                                headers={"Authorization": f"Bearer {srv.key}"}) as http:
        for _ in range(3):
            r = http.get("/api/poll")
            assert r.status_code == 200
            got = r.json()
            assert len(got["episodes"]) == 6 and len(got["fates"]) == 2 and got["status"]["skipped_rows"] == 1
        assert http.get("/api/meta").status_code == 200
        for name, rec in broken.items():
            r = http.get(f"/api/episode/{rec['id']}")
            assert r.status_code == 200, (name, r.text)
            ep = r.json()
            assert ep["summary"]["id"] == rec["id"] and ep["messages"], name
            (tokens,) = ep["sequences"]
            n = len(tokens["ids"])
            assert n == 3 and all(len(tokens[k]) == n for k in ("text", "logprobs", "versions", "mask")), name
        ids = http.get(f"/api/episode/{broken['ids']['id']}").json()
        assert ids["problems"] and "token ids" in ids["problems"][0]
        cols = http.get(f"/api/episode/{broken['columns']['id']}").json()
        assert cols["messages"][0]["tool_calls"] == [] and cols["metrics"] == {} and cols["answer"] == "42"
        assert http.get("/api/episode/ep0").json()["problems"] == []


def test_a_huge_token_id_is_shown_as_a_number_with_the_runs_tokenizer(real_run, tmp_path):
    run = _run(tmp_path, [_rollout(0, sequences=[{"token_ids": [10**30, 5], "loss_mask": [1, 1]}])], [])
    ep = RunView(run, tokenizer=real_run / "final").episode("ep0")
    assert ep["sequences"][0]["text"][0] == f"⟨{10**30}⟩" and ep["problems"]


# ----------------------------------------------------------------------------- a long run


def test_a_large_file_is_read_over_several_polls_in_bounded_steps(tmp_path):
    pad = "x" * 2000  # each rollout line ~2.5 KB; the cap below is ~16 of them
    n, cap = 300, 40_000
    rollouts = [_rollout(i, advantage=i / n, messages=[{"role": "user", "content": pad}]) for i in range(n)]
    run = _run(tmp_path, rollouts, _trained(*(f"ep{i}" for i in range(n))))
    line = max(len(json.dumps(r)) + 1 for r in rollouts)
    size = sum((run / f).stat().st_size for f in ("rollouts.jsonl", "ledger.jsonl", "metrics.jsonl",
                                                  "eval_rollouts.jsonl"))
    view = RunView(run, read_bytes=cap)
    got = view.poll()
    episodes, fates, polls, left = list(got["episodes"]), list(got["fates"]), 1, got["status"]["behind_bytes"]
    assert got["more"] and left > 0
    assert size - left <= 2 * (cap + line)  # the first poll read at most a cap (and a line) of each big file
    assert len(got["episodes"]) <= cap // line + 1
    assert got["fates"] == []  # the ledger waits for the episodes its fates name
    while got["more"]:
        got = view.poll(got["epoch"], **got["cursor"])
        polls += 1
        assert left - got["status"]["behind_bytes"] <= 2 * (cap + line) or got["status"]["behind_bytes"] == 0
        left = got["status"]["behind_bytes"]
        assert len(got["episodes"]) <= cap // line + 1
        episodes += got["episodes"]
        fates += got["fates"]
        assert polls < 100
    assert polls >= n * line // (2 * (cap + line))
    assert [e["id"] for e in episodes] == [f"ep{i}" for i in range(n)]
    assert [f["advantage"] for f in fates] == [i / n for i in range(n)]  # every fate found its episode
    assert got["status"]["behind_bytes"] == 0 and got["status"]["skipped_rows"] == 0


def test_a_poll_returns_a_bounded_page_of_each_stream(tmp_path):
    n_fates, n_metrics = 2 * PAGE["fates"] + 17, 2 * PAGE["metrics"] + 5
    run = _run(tmp_path, [_rollout(0)], [{"id": f"e{i}", "fate": "filtered", "step": i // 100, "reason": "r"}
                                         for i in range(n_fates)])
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.5}) + "\n"
                                               for s in range(n_metrics)))
    view = RunView(run)
    got = view.poll()
    fates, metrics, polls = list(got["fates"]), list(got["metrics"]), 1
    assert len(got["fates"]) == PAGE["fates"] and len(got["metrics"]) == PAGE["metrics"] and got["more"]
    while got["more"]:
        got = view.poll(got["epoch"], **got["cursor"])
        assert len(got["fates"]) <= PAGE["fates"] and len(got["metrics"]) <= PAGE["metrics"]
        fates += got["fates"]
        metrics += got["metrics"]
        polls += 1
    assert polls == 3
    assert [f["id"] for f in fates] == [f"e{i}" for i in range(n_fates)]
    assert [m["step"] for m in metrics] == list(range(n_metrics))
    assert got["status"]["last_step"] == n_metrics - 1


# ----------------------------------------------------------------------------- the page


def test_the_page_says_what_it_skipped_and_shows_a_broken_episode(tmp_path, page):
    seq = _rollout(0)["sequences"][0]
    run = _run(tmp_path, [_rollout(0), "not json", _rollout(1, sequences=[{**seq, "token_ids": ["abc", 5, 6]}],
                                                            messages=[{"role": "assistant", "content": "hi",
                                                                       "tool_calls": 5}])], _trained("ep0"))
    with ViewerServer(run) as srv:
        page.goto(srv.login_url)
        page.wait_for_function("document.querySelector('#status').textContent.includes('1 unreadable row skipped')")
        assert "rollouts.jsonl" in page.locator("#status").get_attribute("title")
        page.click("nav button[data-tab=episodes]")
        page.click("#episodes tbody tr[data-id='ep1']")
        page.wait_for_selector("#detail .tokens")
        assert "token ids" in page.locator("#detail .error").first.text_content()
        assert page.locator("#detail .tok").count() == 3
