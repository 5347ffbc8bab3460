"""``agentrl serve``: the embedded OpenAI-compatible engine over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.app import AllowedHosts, AllowedOrigins, Host, ServerKey, app, bind_errors
from agentrl.errors import AgentrlError
from agentrl.inference.engine_args import EngineArgs

_ENGINE = EngineArgs()


@app.command()
def serve(
    model_dir: Annotated[str, typer.Argument(help="HF model directory (e.g. built by `agentrl model init tiny`).")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = a free one, printed at start).")] = 8000,
    host: Host = "127.0.0.1",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = _ENGINE.max_batch_size,
    max_model_len: Annotated[int, typer.Option(min=16, help="Longest prompt+completion in tokens.")] = _ENGINE.max_model_len,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N.")] = _ENGINE.device,
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API (default: dir name).")] = None,
    tool_call_parser: Annotated[
        str, typer.Option(help="How the chat route splits tool calls: hermes | llama3_json | mistral | pythonic | auto.")
    ] = "auto",
    api_key: ServerKey = None,
    key_file: Annotated[
        Path | None, typer.Option(help="Where a key made here is written, 0600 (default ~/.cache/agentrl/keys/).")
    ] = None,
    allowed_hosts: AllowedHosts = "",
    allowed_origins: AllowedOrigins = "",
) -> None:
    """Serve a model with the embedded OpenAI-compatible engine (continuous batching, live weights).

    --api-key guards every route but /health; without one, a new key guards the control and
    weight routes and is written to --key-file.
    """
    from agentrl.config import check_device
    from agentrl.tool_format import get_parser

    if tool_call_parser != "auto":
        get_parser(tool_call_parser)
    if not (Path(model_dir) / "config.json").is_file():
        raise AgentrlError(f"no model at {model_dir!r} (expected a HF model dir; try `agentrl model init tiny DIR`)")
    check_device(device, "--device")  # a name torch refuses, or a GPU this host lacks: one line before any load
    from agentrl.guard import split_names
    from agentrl.inference.server_process import serve as run_server

    args = EngineArgs(max_batch_size=max_batch_size, max_model_len=max_model_len, device=device)
    with bind_errors(host, port):
        run_server(model_dir, host=host, port=port, args=args, served_model_name=served_model_name, log_level="info",
                   tool_parser=tool_call_parser, api_key=api_key, key_file=key_file,
                   allowed_hosts=split_names(allowed_hosts), allowed_origins=split_names(allowed_origins))
