"""`agentrl ...` command line.

Each command parses its arguments and hands off to the module that owns the work;
heavy imports (torch, transformers) happen inside the command so `agentrl --help`
stays fast. User errors (:class:`agentrl.errors.AgentrlError`) print one line and exit 2.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from agentrl.errors import AgentrlError

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

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


# ----------------------------------------------------------------------------- run / sft


@app.command(context_settings=_EXTRA)
def run(
    ctx: typer.Context,
    configs: Annotated[list[str], typer.Argument(help="TOML files (merged left to right), then --dotted.overrides.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last complete checkpoint.")] = False,
) -> None:
    """Async RL: engine + rollouts + staleness buffer + trainer + live weight push.

    Extra arguments are dotted overrides: --trainer.lr=1e-5 --env.name calc
    """
    from agentrl.config import load_config, split_files_and_overrides

    files, overrides = split_files_and_overrides([*configs, *ctx.args])
    cfg = load_config(files, overrides)
    if dry_run:
        typer.echo(cfg.to_toml())
        return
    from agentrl.trainer.run import run_training

    run_training(cfg, resume=resume)


@app.command(context_settings=_EXTRA)
def sft(
    ctx: typer.Context,
    configs: Annotated[list[str], typer.Argument(help="TOML files (merged left to right), then --dotted.overrides.")],
) -> None:
    """Supervised warm start on the environment's demonstrations (cached by config)."""
    from agentrl.config import load_config, split_files_and_overrides
    from agentrl.trainer.sft import run_sft

    path = run_sft(load_config(*split_files_and_overrides([*configs, *ctx.args])))
    typer.echo(str(path))


# ----------------------------------------------------------------------------- model init


@model_app.command("init")
def model_init(
    kind: Annotated[str, typer.Argument(help="Model kind to build (only 'tiny').")],
    out_dir: Annotated[str, typer.Argument(help="Directory to write the HF model into.")],
    layers: Annotated[int, typer.Option(min=1, help="Decoder layers.")] = 4,
    hidden: Annotated[int, typer.Option(min=8, help="Hidden width.")] = 128,
    heads: Annotated[int, typer.Option(min=1, help="Attention heads.")] = 4,
    vocab_size: Annotated[int, typer.Option(min=300, help="BPE vocabulary size.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed for the initial weights.")] = 0,
) -> None:
    """Build a tiny Llama model + byte-level BPE tokenizer with a tool-aware chat template."""
    if kind != "tiny":
        raise AgentrlError(f"unknown model kind {kind!r}; available: tiny")
    from agentrl.tiny_model import build_tiny_model

    try:
        path = build_tiny_model(out_dir, layers=layers, hidden=hidden, heads=heads, vocab_size=vocab_size, seed=seed)
    except ValueError as e:
        raise AgentrlError(str(e)) from e
    typer.echo(str(path))


# ----------------------------------------------------------------------------- serve


@app.command()
def serve(
    model_dir: Annotated[str, typer.Argument(help="HF model directory (e.g. built by `agentrl model init tiny`).")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = a free one, printed at start).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = 64,
    max_model_len: Annotated[int, typer.Option(min=16, help="Longest prompt+completion in tokens.")] = 1024,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:i].")] = "auto",
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API (default: dir name).")] = None,
) -> None:
    """Serve a model with the embedded OpenAI-compatible engine (continuous batching, live weights)."""
    from pathlib import Path

    if not (Path(model_dir) / "config.json").is_file():
        raise AgentrlError(f"no model at {model_dir!r} (expected a HF model dir; try `agentrl model init tiny DIR`)")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise AgentrlError(f"unknown device {device!r}; use auto, cpu or cuda")
    from agentrl.inference.server import serve as run_server

    try:
        run_server(
            model_dir,
            host=host,
            port=port,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            device=device,
            served_model_name=served_model_name,
            log_level="info",
        )
    except OSError as e:
        raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    try:
        app(args=argv, standalone_mode=True)
    except AgentrlError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
