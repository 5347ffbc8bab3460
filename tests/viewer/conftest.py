"""A real run directory for the viewer, plot and sink tests: tiny model, a short SFT warm start
(so the policy calls the calculator), 4 async RL steps on the real engine with held-out evals
at versions 0, 2 and 4, TensorBoard on.  Built once per session (well under a minute)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"]
STEPS = 4


@pytest.fixture(scope="session")
def real_run(tmp_path_factory) -> Path:
    from agentrl.config import load_config
    from agentrl.recipes.rl import train

    root = tmp_path_factory.mktemp("viewer-run")
    cfg = load_config([], {
        "run": {"dir": str(root / "run"), "name": "viewer-test"},
        "model": {"path": str(root / "tiny"), "tiny_layers": 2, "tiny_hidden": 64},
        "env": {"name": "calc", "args": {"max_operand": 9}},
        "sft": {"enabled": True, "steps": 300, "batch_size": 32, "num_demos": 512, "lr": 3e-3},
        "rollout": {"group_size": 4, "max_in_flight": 16, "max_tokens": 32, "max_turns": 2, "temperature": 0.7},
        "trainer": {"steps": STEPS, "batch_groups": 2, "checkpoint_every": 0, "num_threads": 1},
        "buffer": {"filter_zero_variance": False, "max_staleness": 1},
        "eval": {"every": 2, "num_tasks": 4},
        "inference": {"max_batch_size": 16},
        "metrics": {"tensorboard": True},
    })
    return train(cfg, progress=False)


@pytest.fixture(scope="session")
def steps() -> int:
    """Optimizer steps of ``real_run``."""
    return STEPS


@pytest.fixture(scope="module")  # the sync API keeps an event loop running until it exits
def browser():
    """Debian's chromium driven by playwright (the system browser: no download)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (`apt-get install chromium`; .ci/install does it as root on Debian)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh page; any JavaScript error or failed request fails the test."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 950})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.set_default_timeout(20_000)
    yield pg
    ctx.close()
    # the server stops when the test leaves its `with` block while the page still polls
    assert not [e for e in errors if "ERR_CONNECTION_REFUSED" not in e], errors
