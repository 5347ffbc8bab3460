"""``agentrl sandbox ...``: clean up after killed runs, and say what this host gives the sandboxes."""

from __future__ import annotations

from typing import Annotated

import typer

from agentrl.cli.app import sandbox_app


@sandbox_app.command("prune")
def sandbox_prune(
    everything: Annotated[
        bool, typer.Option("--all", help="Remove every agentrl sandbox, including those of live runs.")
    ] = False,
) -> None:
    """Remove sandboxes (containers, temp dirs) that killed runs left behind."""
    from agentrl.sandbox.prune import prune

    typer.echo(prune(everything=everything).summary())


@sandbox_app.command("doctor")
def sandbox_doctor(
    live: Annotated[bool, typer.Option("--live/--no-live", help="Also start one sandbox per backend.")] = True,
) -> None:
    """What this host gives the sandboxes: backends, seccomp, cgroups, network (exit 1: none isolates)."""
    from agentrl.sandbox.doctor import doctor

    report = doctor(live=live)
    typer.echo(report.text())
    if not report.isolating_backend:
        raise typer.Exit(1)
