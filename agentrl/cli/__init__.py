"""`agentrl ...` command line.

Each command parses its arguments and hands off to the module that owns the work;
heavy imports (torch, transformers) happen inside the command so `agentrl --help`
stays fast. User errors (:class:`agentrl.errors.AgentrlError`) print one line and exit 2;
``agentrl --traceback ...`` (or ``AGENTRL_TRACEBACK=1``) prints the full trace instead.

One module per command group: ``train`` (run, sft, export), ``serve`` (the engine),
``env`` (eval and ``agentrl env ...``), ``model``, ``view`` (view, plot), ``sandbox``;
``app`` holds the typer apps and the options several commands share.
"""

from __future__ import annotations

import sys

import typer

from agentrl.cli.app import app, show_traceback
from agentrl.errors import AgentrlError

# each module registers its commands; this order is the order `agentrl --help` lists them in
# isort: off
from agentrl.cli import train, serve, env, view, model, sandbox  # noqa: E402, F401
# isort: on

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    # typer vendors click; its exceptions live here (the `click` package is not used)
    from typer._click import exceptions as click

    try:
        rv = app(args=argv, standalone_mode=False)
    except click.NoArgsIsHelpError as e:  # bare `agentrl` / `agentrl env`: show help
        typer.echo(e.ctx.get_help() if e.ctx is not None else str(e))
        sys.exit(2)
    except click.UsageError as e:  # bad argument/option: one line, not click's boxed usage text
        where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{where}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except AgentrlError as e:  # user errors exit 2; failed work (e.g. a stalled run) says its own code
        if show_traceback():  # the whole chain: the user's own frames are in the cause
            import traceback

            traceback.print_exception(e)
        else:
            typer.echo(f"error: {e}", err=True)
        sys.exit(getattr(e, "exit_code", 2))
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
