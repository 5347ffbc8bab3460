"""`agentrl plot` on a real run: the PNG holds the expected curves (a non-trivial image in the
charts' colours), the SVG carries the axis labels as text, and bad input is one line, exit 2."""

from __future__ import annotations

import numpy as np
import pytest
from agentrl_cli import agentrl
from PIL import Image

from agentrl.plot import plot_run
from agentrl.viewer.data import CHARTS


def _has_colour(img: np.ndarray, hex_colour: str, tol: int = 40) -> int:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(img[..., :3].astype(int) - rgb).sum(axis=-1) < tol).sum())


@pytest.mark.slow
def test_plot_png_has_every_curve(real_run, tmp_path, steps):
    out = tmp_path / "curves.png"
    res = agentrl("plot", str(real_run), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert f"{len(CHARTS)} chart(s) over {steps} steps" in res.stdout
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[0] > 600 and img.shape[1] > 1000
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 200  # lines, text, anti-aliasing: not a blank canvas
    for colour in ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#e377c2", "#17becf"):  # reward, eval, ..., tok/s
        assert _has_colour(img, colour) > 30, colour


def test_plot_panels_are_labelled(real_run, tmp_path, steps):
    result = plot_run(real_run, tmp_path / "all.png")
    panels = {p["id"]: p for p in result["panels"]}
    assert set(panels) == {c["id"] for c in CHARTS}
    for p in panels.values():
        assert p["xlabel"] == "trainer step" and p["ylabel"]
    reward = panels["reward"]["series"]
    # rollout reward is absent on a step where no episode finished; held-out eval at versions 0, 2, 4
    assert reward["trained batch"] == steps and 1 <= reward["rollouts"] <= steps and reward["held-out eval"] == 3
    assert panels["ledger"]["series"]["trained"] == steps


def test_plot_svg_subset_keeps_text(real_run, tmp_path):
    out = tmp_path / "reward.svg"
    res = agentrl("plot", str(real_run), "--out", str(out), "--charts", "reward", "--title", "learning curve")
    assert res.returncode == 0, res.stderr
    svg = out.read_text()
    for text in ("trainer step", "mean reward", "held-out eval", "learning curve"):
        assert text in svg, text
    assert "staleness" not in svg


def test_plot_bad_input_is_one_line(real_run, tmp_path):
    res = agentrl("plot", str(real_run), "--out", str(tmp_path / "x.png"), "--charts", "reward,nope")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "available: reward" in res.stderr
    res = agentrl("plot", str(real_run), "--out", str(tmp_path / "x.gif"))
    assert res.returncode == 2 and ".png" in res.stderr
    res = agentrl("plot", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "neither a run directory" in res.stderr
