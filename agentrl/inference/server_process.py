"""The engine's server process (``python -m agentrl.inference.server``, started by
:func:`agentrl.inference.launcher.start_embedded_engine` or ``agentrl serve``).

:func:`serve` starts the engine as ``inference.server_process`` says: in this process (``same``),
or as an engine core in a child process (``split``, :class:`~agentrl.inference.core.CoreClient`),
whose death makes the server exit 1 once the requests in flight have their 503.  It then binds
the port, settles the key (:mod:`agentrl.guard`), and runs the routes of
:func:`agentrl.inference.server.create_app` under uvicorn until interrupted.  :func:`main` is the
command line (one flag per :class:`~agentrl.inference.engine_args.EngineArgs` field); a refused
start is one line that starts with :data:`STARTUP_ERROR` and exits 2.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from agentrl.auth import key_dir, server_key
from agentrl.errors import EngineStartError
from agentrl.guard import Limits, split_names, uvicorn_config
from agentrl.heap import keep_freed_memory
from agentrl.inference.core import CoreClient
from agentrl.inference.engine import Engine
from agentrl.inference.engine_args import EngineArgs
from agentrl.inference.launcher import exit_with_parent
from agentrl.inference.server import create_app

STARTUP_ERROR = "agentrl engine: error: "  # prefix of the one line a refused start prints


def default_key_file(port: int) -> Path:
    """Where ``agentrl serve`` writes a key it made (the user's own cache dir, 0600)."""
    return key_dir() / f"engine-{port}.key"


def serve(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    args: EngineArgs | None = None,
    served_model_name: str | None = None,
    port_file: str | None = None,
    parent_pid: int | None = None,
    log_level: str = "warning",
    tool_parser: str | None = None,
    api_key: str | None = None,
    key_file: str | Path | None = None,
    allowed_hosts: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
    limits: Limits | None = None,
    weights_dir: str | Path | None = None,
    shm_dir: str | Path | None = None,
) -> None:
    """Load the model, bind ``host:port`` (0 = a free port), serve until interrupted.

    The key: ``api_key``, else ``AGENTRL_API_KEY``, else a new one written 0600 to ``key_file``
    (default :func:`default_key_file`) before the port file appears.  ``weights_dir``: the one dir
    disk pushes and ``/update_weights_from_disk`` read (default: a private one)."""
    import uvicorn

    limits = limits or Limits()
    args = args or EngineArgs()
    died: list[str] = []  # a split engine's core died: why (the server then exits non-zero)
    uv: list[Any] = []  # the uvicorn server, once made

    def core_died(reason: str) -> None:
        died.append(reason)
        print(f"{STARTUP_ERROR}{reason}", file=sys.stderr, flush=True)
        if uv:
            uv[0].should_exit = True  # requests in flight get their 503 first, then the server exits

    if args.server_process == "same":
        keep_freed_memory()  # this process runs the model loop (split: the core does this itself)
    if args.server_process == "split":
        engine: Engine | CoreClient = CoreClient(model_dir, args, on_death=core_died)
    elif args.server_process == "same":
        engine = Engine(model_dir, args)
    else:
        raise EngineStartError(f"server_process must be 'same' or 'split', got {args.server_process!r}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit this; without it keep-alive requests stall ~40 ms (Nagle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    key = server_key(api_key, write_to=key_file or default_key_file(bound))
    app = create_app(engine, served_model_name, tool_parser, key=key, allowed_hosts=(host, *allowed_hosts),
                     allowed_origins=allowed_origins, limits=limits, weights_dir=weights_dir, shm_dir=shm_dir)
    if parent_pid:
        exit_with_parent(parent_pid)  # no orphaned engines
    if port_file:
        tmp = Path(port_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": bound, "pid": os.getpid()}))
        tmp.replace(port_file)
    print(f"agentrl engine: serving {app.state.server.name!r} on http://{host}:{bound}/v1 "
          f"(tool-call parser {app.state.server.tool_parser.name})", file=sys.stderr, flush=True)
    if key.explicit:
        print("agentrl engine: API key given (--api-key or AGENTRL_API_KEY): every route but /health needs it",
              file=sys.stderr, flush=True)
    else:
        print(f"agentrl engine: made an API key for the control and weight routes, written to {key.path} (0600); "
              f"clients: export AGENTRL_API_KEY=$(cat {key.path})", file=sys.stderr, flush=True)
    if not getattr(app.state.server.tok, "chat_template", None):
        print("agentrl engine: warning: the model's tokenizer has no chat template: /v1/chat/completions will refuse "
              "every request (use /v1/completions, or add a chat_template; `agentrl model check-template DIR`)",
              file=sys.stderr, flush=True)
    if host in ("0.0.0.0", "::", ""):
        print("agentrl engine: warning: listening on every interface; anyone who reaches this port can "
              + ("call it with the key" if key.explicit else "use the OpenAI routes (give --api-key to close them)"),
              file=sys.stderr, flush=True)
    config = uvicorn_config(app, limits, log_level=log_level)
    uv.append(uvicorn.Server(config))
    try:
        if died:
            return
        uv[0].run(sockets=[sock])
    finally:
        if app.state.server.weights is not None:
            app.state.server.weights.close()  # its shared-memory files and private weights dir
        engine.close()
        if died:
            sys.exit(1)


def _flag(text: str) -> bool:
    """A boolean flag value as :meth:`EngineArgs.cli_args` writes it (True/False)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> None:
    """``python -m agentrl.inference.server MODEL_DIR [--port ...]`` (used by the launcher)."""
    import argparse
    from dataclasses import fields

    defaults = EngineArgs()
    ap = argparse.ArgumentParser(prog="agentrl-engine")
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    for f in fields(EngineArgs):
        default = getattr(defaults, f.name)
        kind = _flag if isinstance(default, bool) else type(default)
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--tool-call-parser", default="auto", help="hermes | llama3_json | mistral | pythonic | auto")
    ap.add_argument("--port-file", default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    # the key itself comes from AGENTRL_API_KEY, never argv (any local user can read a command line)
    ap.add_argument("--key-file", default=None, help="where a key made here is written (0600)")
    ap.add_argument("--allowed-hosts", type=split_names, default=(), help="more Host names to serve (comma-separated; *: any)")
    ap.add_argument("--allowed-origins", type=split_names, default=(), help="web origins allowed to call (comma-separated)")
    ap.add_argument("--weights-dir", default=None, help="the one dir disk weight pushes are read from")
    ap.add_argument("--shm-dir", default=None, help="where the engine makes its private shared-memory dir (default /dev/shm)")
    a = ap.parse_args(argv)
    try:
        serve(
            a.model_dir,
            host=a.host,
            port=a.port,
            args=EngineArgs(**{f.name: getattr(a, f.name) for f in fields(EngineArgs)}),
            served_model_name=a.served_model_name,
            port_file=a.port_file,
            parent_pid=a.parent_pid,
            tool_parser=a.tool_call_parser,
            key_file=a.key_file,
            allowed_hosts=a.allowed_hosts,
            allowed_origins=a.allowed_origins,
            weights_dir=a.weights_dir,
            shm_dir=a.shm_dir,
        )
    except EngineStartError as e:  # a refusal is one line (the launcher reports it as is)
        print(f"{STARTUP_ERROR}{e}", file=sys.stderr, flush=True)
        sys.exit(2)

