"""The typer apps every command module registers on, the global ``--traceback`` flag, and
the options several commands share (one declaration each, so a flag means the same everywhere)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from rich.table import Table

app = typer.Typer(
    name="agentrl",
    help="Agentic multi-turn async RL for language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Build and inspect models.", no_args_is_help=True)
env_app = typer.Typer(help="Create, list and test environment packages.", no_args_is_help=True)
sandbox_app = typer.Typer(help="Manage sandboxes.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(env_app, name="env")
app.add_typer(sandbox_app, name="sandbox")

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # for --dotted.overrides
_TRACEBACK = {"on": False}  # set by --traceback


@app.callback()
def _options(
    traceback: Annotated[
        bool, typer.Option("--traceback", help="On an error, print the full Python trace, not one line (or AGENTRL_TRACEBACK=1).")
    ] = False,
) -> None:
    """Agentic multi-turn async RL for language models."""
    _TRACEBACK["on"] = traceback


def show_traceback() -> bool:
    """``--traceback`` or ``AGENTRL_TRACEBACK=1``: print the whole trace of a user error."""
    return _TRACEBACK["on"] or os.environ.get("AGENTRL_TRACEBACK", "").strip().lower() in ("1", "true", "yes", "on")


def print_table(table: Table) -> None:
    """A rich table on stdout; not wrapped at 80 columns when piped."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(table)


@contextmanager
def bind_errors(host: str, port: int) -> Iterator[None]:
    """A port in use or an address not on this host: one line naming both, exit 2."""
    try:
        yield
    except OSError as e:
        raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e


# ----------------------------------------------------------------------------- shared options

#: environments and configs
EnvName = Annotated[str, typer.Argument(help="Installed environment name or path to an env package dir.")]
EnvArgs = Annotated[str | None, typer.Option("--env-args", "-a", help="JSON kwargs for load_environment.")]
Configs = Annotated[list[str], typer.Argument(help="TOML files (merged left to right), then --dotted.overrides.")]
RunDir = Annotated[Path, typer.Argument(help="A run directory (RUN_DIR of `agentrl run`).")]
ToolParser = Annotated[
    str,
    typer.Option("--tool-parser", help="Tool-call format (vLLM names): hermes | llama3_json | mistral | pythonic | "
                 "auto (detected from the chat template)."),
]

#: a server's exposure: where it binds, the key its clients send, the names and pages it answers
Host = Annotated[str, typer.Option("--host", help="Interface to bind (0.0.0.0: every interface).")]
ServerKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="AGENTRL_API_KEY", show_envvar=True,
                 help="The key clients send as 'Authorization: Bearer KEY' (what it guards: above)."),
]
AllowedHosts = Annotated[
    str, typer.Option(help="More Host names to serve, comma-separated (loopback names and IPs always; *: any).")
]
AllowedOrigins = Annotated[
    str, typer.Option(help="Web origins whose pages may call the server, comma-separated (default: none).")
]
