"""Make the README's images from a real run: ``python docs/make_images.py runs/quickstart``.

    docs/learning-curve.png   agentrl plot RUN --charts reward   (the README's learning curve)
    docs/curves.png           agentrl plot RUN                   (every chart)
    docs/viewer-curves.png    agentrl view RUN --serve, Curves tab, in headless Chromium
    docs/viewer-episode.png   one trained episode: transcript, tool call, tokens coloured by μ logprob
    docs/viewer-diff.png      one held-out task at the first and the last evaluated version

``python docs/make_images.py --smollm RUN`` (a run of examples/smollm.toml) makes instead:

    docs/smollm-curves.png          agentrl plot RUN
    docs/smollm-viewer-episode.png  one trained SmolLM2 episode: its Hermes <tool_call>, as text and as tokens

Needs the system Chromium (``apt-get install chromium``) and playwright (the dev extra).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

from agentrl.viewer.data import RunView
from agentrl.viewer.server import ViewerServer

DOCS = Path(__file__).resolve().parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]


def plots(run: Path) -> None:
    agentrl = [sys.executable, "-m", "agentrl.cli", "plot", str(run)]
    subprocess.run([*agentrl, "--out", str(DOCS / "learning-curve.png"), "--charts", "reward",
                    "--title", "quickstart: reward over training steps"], check=True)
    subprocess.run([*agentrl, "--out", str(DOCS / "curves.png"), "--dpi", "90"], check=True)


def pick_episode(view: RunView, fates: dict[str, str]) -> str:
    """A trained, rewarded episode with a tool call whose tokens show some uncertainty."""
    best, best_lp = None, 0.0
    candidates = [e for e in view.episodes if fates.get(e["id"]) == "trained" and e["tool_calls"] and e["reward"] == 1]
    for e in candidates[-400:]:
        ep = view.episode(e["id"])
        lps = [lp for s in ep["sequences"] for lp, m in zip(s["logprobs"], s["mask"], strict=True) if m and lp is not None]
        low = min(lps, default=0.0)
        if low < best_lp and low > math.log(0.05):
            best, best_lp = e["id"], low
    return best or candidates[-1]["id"]


def pick_diff(view: RunView) -> tuple[str, str, str] | None:
    """(task, first, last) for a held-out task whose reward went from 0 to 1."""
    by_task: dict[str, list[dict]] = {}
    for e in view.episodes:
        if e["source"] == "eval":
            by_task.setdefault(e["task"], []).append(e)
    for task, eps in by_task.items():
        eps.sort(key=lambda e: e["version"])
        if eps[0]["reward"] == 0 and eps[-1]["reward"] == 1 and eps[0]["tool_calls"]:
            return task, eps[0]["id"], eps[-1]["id"]
    return None


def screenshots(run: Path) -> None:
    from playwright.sync_api import sync_playwright

    view = RunView(run)
    got = view.poll()
    fates = {f["id"]: f["fate"] for f in got["fates"]}
    episode, diff = pick_episode(view, fates), pick_diff(view)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with ViewerServer(run) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 920}, device_scale_factor=1)
        page.goto(srv.login_url)  # the viewer's key, once; then its cookie
        page.wait_for_selector("svg.chart path.series")
        page.wait_for_function("document.querySelector('#status').textContent.includes('finished')")
        page.uncheck("#follow")
        page.screenshot(path=str(DOCS / "viewer-curves.png"))
        page.click("nav button[data-tab=episodes]")
        page.select_option("select[name=fate]", "trained")
        page.fill("input[name=task]", view.episode(episode)["summary"]["question"])
        page.click(f"#episodes tbody tr[data-id='{episode}']")
        page.wait_for_selector("#detail .tool-call")
        page.screenshot(path=str(DOCS / "viewer-episode.png"))
        if diff is not None:
            task, first, last = diff
            page.click("nav button[data-tab=diff]")
            page.select_option("#diff-task", task)
            page.select_option("#diff-a", first)
            page.select_option("#diff-b", last)
            page.wait_for_timeout(500)
            page.screenshot(path=str(DOCS / "viewer-diff.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 420})
        browser.close()


def smollm(run: Path) -> None:
    """The SmolLM2 section's images: every curve, and one trained episode's detail panel."""
    from playwright.sync_api import sync_playwright

    subprocess.run([sys.executable, "-m", "agentrl.cli", "plot", str(run), "--out", str(DOCS / "smollm-curves.png"),
                    "--dpi", "80", "--title", "SmolLM2-135M-Instruct: examples/smollm.toml"], check=True)
    view = RunView(run)
    fates = {f["id"]: f["fate"] for f in view.poll()["fates"]}
    rewarded = [e["id"] for e in reversed(view.episodes)
                if fates.get(e["id"]) == "trained" and e["tool_calls"] and e["reward"] == 1]
    # one whose answer is the bare result (some echo the <tool_response> wrapper around it)
    clean = [i for i in rewarded if "<" not in (view.episode(i)["messages"][-1].get("content") or "<")]
    episode = (clean or rewarded)[0]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with ViewerServer(run) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        # tall enough that the detail panel holds the transcript and every token without scrolling
        page = browser.new_page(viewport={"width": 1400, "height": 1500}, device_scale_factor=1)
        page.goto(srv.login_url)
        page.click("nav button[data-tab=episodes]")
        page.fill("input[name=task]", view.episode(episode)["summary"]["question"])
        page.click(f"#episodes tbody tr[data-id='{episode}']")
        page.wait_for_selector("#detail .tok.sampled")
        box = page.locator("#detail").bounding_box()
        tokens = page.locator("#detail .tokens").first.bounding_box()
        bottom = tokens["y"] + tokens["height"] + 8
        page.screenshot(path=str(DOCS / "smollm-viewer-episode.png"),
                        clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": bottom - box["y"]})
        browser.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--smollm"]:
        smollm(Path(sys.argv[2]))
        sys.exit(0)
    run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart")
    plots(run_dir)
    screenshots(run_dir)
    print("\n".join(str(p) for p in sorted(DOCS.glob("*.png"))))
