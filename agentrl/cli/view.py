"""``agentrl view`` (a run or an eval as text, or followed live in the browser) and ``agentrl plot``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.app import (
    AllowedHosts,
    AllowedOrigins,
    Host,
    RunDir,
    ServerKey,
    app,
    bind_errors,
    print_table,
)
from agentrl.errors import AgentrlError


@app.command()
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (`agentrl run`) or an `agentrl eval --out` directory.")],
    rollouts: Annotated[int, typer.Option("--rollouts", min=1, help="How many recent rollouts to show.")] = 3,
    serve: Annotated[bool, typer.Option("--serve", help="Serve the browser viewer (curves, episodes, tokens, diff).")] = False,
    port: Annotated[int, typer.Option(min=0, max=65535, help="--serve: port (0 = a free one).")] = 8765,
    host: Host = "127.0.0.1",
    tokenizer: Annotated[
        Path | None, typer.Option(help="--serve: tokenizer dir for token text (default: the run's own).")
    ] = None,
    api_key: ServerKey = None,
    allowed_hosts: AllowedHosts = "",
    allowed_origins: AllowedOrigins = "",
) -> None:
    """Summarise a run (text), or with --serve follow it in the browser at http://HOST:PORT/.

    --host, --api-key and --allowed-* apply to --serve: every route needs the key (default: a
    new one, in the printed URL).
    """
    if tokenizer is not None and not (tokenizer / "tokenizer.json").is_file():  # else the viewer falls back silently
        what = "does not exist" if not tokenizer.exists() else "holds no tokenizer.json"
        raise AgentrlError(f"--tokenizer {tokenizer} {what}; pass a model or tokenizer dir, or leave it out to use "
                           "the run's own")
    if serve:
        from agentrl.guard import split_names
        from agentrl.viewer.server import serve as serve_viewer

        with bind_errors(host, port):
            serve_viewer(run_dir, host=host, port=port, tokenizer=tokenizer, on_ready=typer.echo, api_key=api_key,
                         allowed_hosts=split_names(allowed_hosts), allowed_origins=split_names(allowed_origins))
        return
    if (run_dir / "results.jsonl").is_file() and not (run_dir / "metrics.jsonl").is_file():  # an eval --out dir
        from agentrl.recipes.eval import summarize_dir, summary_table

        print_table(summary_table(summarize_dir(run_dir)))  # its own slots and --pass-threshold, from meta.json
        return
    from agentrl.metrics import summarize_run

    typer.echo(summarize_run(run_dir, last_rollouts=rollouts))


@app.command()
def plot(
    run_dir: RunDir,
    out: Annotated[Path, typer.Option("--out", "-o", help="Image file: .png, .svg or .pdf.")] = Path("curves.png"),
    charts: Annotated[
        str | None, typer.Option(help="Comma-separated subset, e.g. reward,staleness (default: all).")
    ] = None,
    title: Annotated[str | None, typer.Option(help="Figure title (default: the run's name).")] = None,
    dpi: Annotated[int, typer.Option(min=50, max=600, help="PNG resolution.")] = 120,
) -> None:
    """Draw a run's curves (reward, eval, staleness, KL, ESS, throughput, ledger, ...) into an image."""
    from agentrl.plot import plot_run

    picked = [c.strip() for c in charts.split(",") if c.strip()] if charts else None
    result = plot_run(run_dir, out, picked, dpi=dpi, title=title)
    typer.echo(f"{result['path']}: {len(result['panels'])} chart(s) over {result['steps']} steps")
