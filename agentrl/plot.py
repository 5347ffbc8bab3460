"""`agentrl plot RUN_DIR --out curves.png`: a run's curves as PNG or SVG (matplotlib).

The same charts as the viewer's page (:data:`agentrl.viewer.data.CHARTS`: metric names,
labels and colours in one place): rewards with the held-out eval, staleness and η,
mismatch KL, masked/clipped share, ESS, tokens/s, trainer idle, weight push time, and the
episode ledger as a stacked area.  ``charts=["reward"]`` draws a subset (the README's
learning curve).  SVG keeps its text as text, so labels stay searchable and editable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.viewer.data import CHARTS, X_LABEL, RunView, series_points


def plot_run(run_dir: str | Path, out: str | Path, charts: list[str] | None = None, *,
             dpi: int = 120, title: str | None = None) -> dict[str, Any]:
    """Draw the run's curves into ``out`` (.png, .svg or .pdf); returns what each panel holds."""
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise AgentrlError(f"--out {out}: use a .png, .svg or .pdf file name")
    view = RunView(run_dir, streams=("metrics", "eval_rollouts"))  # held-out episodes fill evals a row lacks
    if view.kind != "run":
        raise AgentrlError(f"{run_dir} is an eval directory: it has no training curves (see `agentrl view --serve`)")
    view.refresh()
    if not view.metrics:
        raise AgentrlError(f"{run_dir} has no training steps logged yet (metrics.jsonl is empty)")
    specs = _pick(charts)

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    cols = min(3, len(specs))
    rows = -(-len(specs) // cols)
    with plt.rc_context({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False}):
        size = (6.4, 4.0) if len(specs) == 1 else (4.6 * cols, 3.2 * rows)
        fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
        panels = [_panel(ax, spec, view.metrics, view.episodes) for ax, spec in zip(axes.flat, specs, strict=False)]
        xs = [x for ax in axes.flat for x in ax.dataLim.intervalx if ax.has_data()]
        if xs:  # one x range for every panel, padded so a one-step run's points sit inside it
            lo, hi = min(xs), max(xs)
            pad = max(0.04 * (hi - lo), 0.5)
            for ax in axes.flat:
                ax.set_xlim(lo - pad, hi + pad)
        for ax in list(axes.flat)[len(specs):]:
            ax.set_visible(False)
        if len(specs) == 1:  # one chart: the title goes on it
            axes[0, 0].set_title(title or f"{view.meta()['name']}: {specs[0]['title']}")
        else:
            fig.suptitle(title or view.meta()["name"], fontsize=11)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
        plt.close(fig)
    return {"path": str(out), "steps": len(view.metrics), "panels": panels}


def _pick(charts: list[str] | None) -> list[dict[str, Any]]:
    if not charts:
        return CHARTS
    known = {c["id"]: c for c in CHARTS}
    unknown = [c for c in charts if c not in known]
    if unknown:
        raise AgentrlError(f"unknown chart(s) {', '.join(unknown)}; available: {', '.join(known)}")
    return [known[c] for c in charts]


def _panel(ax: Any, spec: dict[str, Any], rows: list[dict[str, Any]], episodes: list[dict[str, Any]]) -> dict[str, Any]:
    from matplotlib.ticker import MaxNLocator

    drawn: dict[str, int] = {}
    series = [(s, series_points(rows, s, episodes)) for s in spec["series"]]
    series = [(s, pts) for s, pts in series if pts]
    if spec.get("stacked") and series:
        xs = sorted({x for _, pts in series for x, _ in pts})
        stacks = [[dict(pts).get(x, 0.0) for x in xs] for _, pts in series]
        if len(xs) == 1:  # one step: an area needs two x; draw the stack as one bar
            ax.bar(xs * len(stacks), [st[0] for st in stacks], bottom=[sum(st[0] for st in stacks[:i]) for i in
                   range(len(stacks))], width=0.4, color=[s["color"] for s, _ in series],
                   label=[s["label"] for s, _ in series], alpha=0.8)
        else:
            ax.stackplot(xs, *stacks, labels=[s["label"] for s, _ in series],
                         colors=[s["color"] for s, _ in series], alpha=0.8)
        drawn = {s["label"]: len(pts) for s, pts in series}
    else:
        for s, pts in series:
            xs, ys = zip(*pts, strict=True)
            few = len(pts) <= 3  # a line needs two points: a short run's series would be invisible without markers
            ax.plot(xs, ys, label=s["label"], color=s["color"], linewidth=1.4,
                    linestyle="--" if s.get("dash") else "-", marker="o" if s.get("marker") or few else None,
                    markersize=4 if few else 3)
            drawn[s["label"]] = len(pts)
    if not series:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="#999")
    ax.set_title(spec["title"])
    ax.set_xlabel(X_LABEL)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole numbers
    ax.set_ylabel(spec["y"])
    ax.grid(True, color="#eee", linewidth=0.8)
    ax.set_axisbelow(True)
    if len(series) > 1:
        ax.legend(fontsize=7, frameon=False, loc="best")
    return {"id": spec["id"], "title": spec["title"], "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "series": drawn}
