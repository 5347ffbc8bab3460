"""``agentrl eval`` and ``agentrl env ...``: evaluate a model on an environment; scaffold, list,
serve over HTTP and check environment packages."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.app import (
    AllowedHosts,
    AllowedOrigins,
    EnvArgs,
    EnvName,
    Host,
    ServerKey,
    ToolParser,
    app,
    env_app,
    print_table,
)

BaseUrl = Annotated[str | None, typer.Option("--base-url", "-b", help="OpenAI-compatible endpoint (…/v1).")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-t", min=1, help="Sampled tokens per turn.")]
#: the key a client sends to --base-url (engines a command starts itself have their own)
ClientKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar=["AGENTRL_API_KEY", "OPENAI_API_KEY"], show_envvar=True,
                 help="The endpoint's API key (an agentrl engine's: RUN_DIR/api_key or the file `agentrl serve` printed)."),
]


@app.command("eval")
def eval_cmd(
    env: EnvName,
    model: Annotated[str, typer.Option("--model", "-m", help="Model name at --base-url, or a local model dir.")],
    base_url: BaseUrl = None,
    api_key: ClientKey = None,
    num_tasks: Annotated[int, typer.Option("--num-tasks", "-n", min=1, help="Held-out tasks to run.")] = 5,
    rollouts: Annotated[int, typer.Option("--rollouts", "-r", min=1, help="Episodes per task.")] = 3,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Episodes in flight.")] = 32,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results directory (results.jsonl, summary.json).")] = Path(
        "runs/eval"
    ),
    resume: Annotated[bool, typer.Option("--resume", help="Rerun only missing or errored episodes in --out "
                                                 "(same settings; -n/-r may grow).")] = False,
    env_args: EnvArgs = None,
    max_tokens: MaxTokens = 256,
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
    tool_parser: ToolParser = "auto",
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
    from rich.table import Table

    from agentrl.plugins import ENV_GROUP, RUBRIC_GROUP, installed

    table = Table(show_header=True)
    for col in ("kind", "name", "distribution", "version", "source"):
        table.add_column(col)
    for kind, group in (("environment", ENV_GROUP), ("rubric", RUBRIC_GROUP)):
        for p in installed(group):
            table.add_row(kind, p.name, p.dist, p.version, str(p.source_dir or p.target))
    print_table(table)


@env_app.command("serve")
def env_serve(
    env: EnvName,
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="TCP port to listen on.")] = 8765,
    host: Host = "127.0.0.1",
    env_args: EnvArgs = None,
    idle_timeout: Annotated[
        float, typer.Option("--idle-timeout", min=0, help="Expire an open episode after this many idle seconds (0: never).")
    ] = 600.0,
    api_key: ServerKey = None,
    max_open: Annotated[int, typer.Option("--max-open", min=1, help="Open episodes at once, all clients together.")] = 1024,
    max_open_per_client: Annotated[
        int, typer.Option("--max-open-per-client", min=1, help="Open episodes at once per client address.")
    ] = 512,
    private_tasks: Annotated[
        bool, typer.Option("--private-tasks", help="Clients see task ids and prompts only, not answers or info.")
    ] = False,
    allowed_hosts: AllowedHosts = "",
    allowed_origins: AllowedOrigins = "",
) -> None:
    """Serve an environment over HTTP; runs and evals use it as env.name = "http://HOST:PORT".

    --api-key guards every route but /health; without one the server is open to whoever reaches
    the port, and binding beyond loopback prints a warning.  Requests that name the server by a
    DNS name (a rebinding page) or come from a web page are refused unless --allowed-hosts /
    --allowed-origins name them.
    """
    import asyncio

    from agentrl.auth import server_key
    from agentrl.envs.serve import exposure_warning, serve
    from agentrl.guard import AiohttpDoor, Limits, split_names
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
                          private_tasks=private_tasks,
                          door=AiohttpDoor((host, *split_names(allowed_hosts)), split_names(allowed_origins),
                                           limits=Limits(max_connections=max(Limits().max_connections, 2 * max_open)))))  # fmt: skip
    except KeyboardInterrupt:
        pass


@env_app.command("test")
def env_test(
    env: EnvName,
    num_episodes: Annotated[int, typer.Option("--num-episodes", "-n", min=1, help="Episodes to run.")] = 3,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model (local dir, or name at --base-url).")] = None,
    base_url: BaseUrl = None,
    api_key: ClientKey = None,
    env_args: EnvArgs = None,
    max_tokens: MaxTokens = 128,
) -> None:
    """Run the contract checklist (a scripted policy unless --model is given). Exit 1 on failure.

    With --model the endpoint is checked first (as `agentrl eval` does): one that cannot be
    reached, refuses the key or does not serve the model is one line and exit 2, not a checklist
    that blames the environment."""
    import asyncio

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
            from agentrl.inference import PolicyClient, probe

            # engines started here have their own key; --api-key (else AGENTRL_API_KEY) is for --base-url
            tokenizer = str(policy.tokenizer_dir) if policy.tokenizer_dir is not None else None
            client = PolicyClient(policy.base_urls, policy.model, tool_parser=policy.tool_parser, tokenizer=tokenizer,
                                  api_key=policy.api_key if policy.started else api_key,
                                  probe_settings=probe.ENV_TEST)  # fmt: skip
        try:
            if client is not None:
                await client.probe(token_path=True)  # the token path, as the checklist samples it
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
    print_table(table)
    if not report.ok:
        raise typer.Exit(1)
