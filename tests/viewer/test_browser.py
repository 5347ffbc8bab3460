"""The viewer page in a real headless Chromium (Debian's, driven by playwright), served on a
real run directory: curves, episode browser, transcript with tool calls, coloured tokens,
the diff view, following a live run, and an eval directory.  Screenshots land in the test's
tmp dir (CI keeps them as artifacts)."""

from __future__ import annotations

import json
import shutil

from agentrl.metrics import read_jsonl
from agentrl.viewer.data import CHARTS, RunView
from agentrl.viewer.server import ViewerServer


def _chart_paths(page) -> dict[str, int]:
    """Per chart: how many drawn series have a real path (more than one point)."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('svg.chart')].map(svg =>
        [svg.dataset.chart, [...svg.querySelectorAll('path.series')].filter(p => p.getAttribute('d').includes('L')).length]))""")


def _a_trained_episode_with_tools(run_dir) -> dict:
    view = RunView(run_dir)
    got = view.poll()
    trained = {f["id"] for f in got["fates"] if f["fate"] == "trained"}
    return next(e for e in got["episodes"] if e["id"] in trained and e["tool_calls"] and e["reward"] is not None)


def test_curves_render(real_run, page, tmp_path):
    with ViewerServer(real_run) as srv:
        page.goto(srv.login_url)
        # "attached", not "visible": a flat series (constant reward) has a zero-height box,
        # which playwright counts as invisible
        page.wait_for_selector("svg.chart path.series", state="attached")
        page.wait_for_function("document.querySelector('#status').textContent.includes('finished')")
        drawn = _chart_paths(page)
        assert set(drawn) == {c["id"] for c in CHARTS}
        for chart in ("reward", "staleness", "mismatch_kl", "ess", "tokens_per_s", "idle", "push", "ledger"):
            assert drawn[chart] >= 1, (chart, drawn)
        assert drawn["reward"] == 3  # rollouts, trained batch, held-out eval
        assert page.locator("svg[data-chart=ledger] path.area").count() >= 2  # stacked fates
        labels = page.locator("svg[data-chart=reward] text").all_text_contents()
        assert "trainer step" in labels and "mean reward" in labels
        assert "step 4/4" in page.locator("#status").text_content()
        page.screenshot(path=str(tmp_path / "viewer-curves.png"), full_page=True)


def test_episode_browser_transcript_and_tokens(real_run, page, tmp_path):
    target = _a_trained_episode_with_tools(real_run)
    n_episodes = len(read_jsonl(real_run / "rollouts.jsonl")) + len(read_jsonl(real_run / "eval_rollouts.jsonl"))
    with ViewerServer(real_run) as srv:
        page.goto(srv.login_url)
        page.click("nav button[data-tab=episodes]")
        page.wait_for_selector("#episodes tbody tr")
        assert page.locator("#count").text_content().startswith(f"{n_episodes} of {n_episodes}")
        # filters: by fate, by source, by reward
        page.select_option("select[name=fate]", "trained")
        fates = page.locator("#episodes tbody tr td:nth-child(6)").all_text_contents()
        assert fates and set(fates) == {"trained"}
        page.select_option("select[name=fate]", "")
        page.select_option("select[name=source]", "eval")
        assert set(page.locator("#episodes tbody tr td:nth-child(2)").all_text_contents()) == {"eval"}
        page.select_option("select[name=source]", "")
        page.fill("input[name=rmin]", "0.5")
        rewards = page.locator("#episodes tbody tr td:nth-child(4)").all_text_contents()
        assert all(float(r) >= 0.5 for r in rewards)
        page.fill("input[name=rmin]", "")

        page.click(f"#episodes tbody tr[data-id='{target['id']}']")
        page.wait_for_selector("#detail .tool-call")
        call = page.locator("#detail .tool-call").first.text_content()
        assert "calculator" in call and "expression" in call
        assert page.locator("#detail .msg.tool").count() >= 1  # the tool's result
        assert "advantage" in page.locator("#detail .kv").first.text_content()
        assert "not trained" not in page.locator("#detail .kv").first.text_content()
        sampled, masked = page.locator("#detail .tok.sampled"), page.locator("#detail .tok.masked")
        assert sampled.count() > 0 and masked.count() > 0  # loss-masked spans shown as such
        by_logprob = _backgrounds(page)
        assert all(c.startswith("rgb") for c in by_logprob)
        page.screenshot(path=str(tmp_path / "viewer-episode.png"))
        page.click("#by-version")
        by_version = _backgrounds(page)
        assert by_version != by_logprob and len(by_version) == len(by_logprob)
        assert page.locator("#detail .legend").text_content().count("version") >= 1
        page.screenshot(path=str(tmp_path / "viewer-episode-versions.png"))


def _backgrounds(page) -> list[str]:
    return page.eval_on_selector_all("#detail .tok.sampled", "els => els.map(e => getComputedStyle(e).backgroundColor)")


def test_diff_shows_one_task_at_two_versions(real_run, page, tmp_path):
    with ViewerServer(real_run) as srv:
        page.goto(srv.login_url)
        page.click("nav button[data-tab=diff]")
        page.wait_for_selector("#diff-left .msg")
        left = page.locator("#diff-left h3").text_content()
        right = page.locator("#diff-right h3").text_content()
        assert left.startswith("version 0") and right.startswith("version 4")  # held-out: first and last eval
        question = page.locator("#diff-left .msg.user").first.text_content()
        assert question == page.locator("#diff-right .msg.user").first.text_content()
        page.screenshot(path=str(tmp_path / "viewer-diff.png"))
        # the word diff marks what changed between the two versions (here on a known pair)
        marked = page.evaluate("""() => {
            const box = document.createElement('div');
            box.append(...wordDiff('calculator("3*9") → 27', 'calculator("3+9") → 12', 'ins'));
            return [...box.querySelectorAll('ins')].map(e => e.textContent); }""")
        assert marked == ["+", "12"]


def test_page_follows_a_live_run(real_run, page, tmp_path):
    run = tmp_path / "live"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("final", "tensorboard", "summary.json"))
    metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    rollouts = (run / "rollouts.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(metrics[:2]))
    (run / "rollouts.jsonl").write_text("".join(rollouts[:8]))
    with ViewerServer(run) as srv:
        page.goto(srv.login_url)
        page.wait_for_function("document.querySelector('#status').textContent.includes('step 2/4')")
        before = _chart_paths(page)
        assert page.locator("svg[data-chart=reward] path.series[data-key='train/reward_mean']").get_attribute(
            "d").count("L") == 1
        with open(run / "metrics.jsonl", "a") as f:  # the run goes on: two more steps, more episodes
            f.writelines(metrics[2:])
        with open(run / "rollouts.jsonl", "a") as f:
            f.writelines(rollouts[8:])
        page.wait_for_function("document.querySelector('#status').textContent.includes('step 4/4')")
        trained = "svg[data-chart=reward] path.series[data-key='train/reward_mean']"
        assert before["reward"] >= 1
        assert page.locator(trained).get_attribute("d").count("L") == 3  # 4 points now, without a reload
        page.click("nav button[data-tab=episodes]")
        n = len(rollouts) + len(read_jsonl(run / "eval_rollouts.jsonl"))
        page.wait_for_function(f"document.querySelector('#count').textContent.startsWith('{n} of')")


def test_eval_directory(tmp_path, page):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"env": "calc", "model": "m"}))
    (out / "summary.json").write_text(json.dumps({"mean_reward": 0.5, "pass_at": {"1": 0.5}}))
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
             "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]},
            {"role": "tool", "content": "4", "tool_call_id": "c", "name": "calculator"},
            {"role": "assistant", "content": "4"}]
    rows = [{"task_index": 0, "rollout": r, "messages": msgs, "reward": float(r), "error": None,
             "error_kind": None, "stop_reason": "done", "turns": 2} for r in range(2)]
    rows.append({"task_index": 1, "rollout": 0, "messages": msgs[:1], "reward": 0.0, "error": "endpoint down",
                 "error_kind": "provider", "stop_reason": "error", "turns": 0})
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with ViewerServer(out) as srv:
        page.goto(srv.login_url)
        page.wait_for_selector("#episodes tbody tr")  # an eval dir opens on its episodes
        page.select_option("select[name=error_kind]", "provider")
        assert page.locator("#episodes tbody tr").count() == 1
        page.click("#episodes tbody tr")
        page.wait_for_selector("#detail .error")
        assert "endpoint down" in page.locator("#detail .error").text_content()
        page.select_option("select[name=error_kind]", "")
        page.click("#episodes tbody tr[data-id='0.1']")
        page.wait_for_selector("#detail .tool-call")
        assert "No token arrays" in page.locator("#detail").text_content()
