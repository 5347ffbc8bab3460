"""``agentrl run`` (async RL), ``agentrl sft`` (warm start) and ``agentrl export`` (a checkpoint as a HF dir)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.app import EXTRA_ARGS, Configs, RunDir, app


@app.command(context_settings=EXTRA_ARGS)
def run(
    ctx: typer.Context,
    configs: Configs,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last complete checkpoint.")] = False,
) -> None:
    """Async RL: engine + rollouts + staleness buffer + trainer + live weight push.

    Extra arguments are dotted overrides: --trainer.lr=1e-5 --env.name calc
    """
    from agentrl.config import load_config
    from agentrl.heap import keep_freed_memory
    from agentrl.overrides import split_files_and_overrides

    keep_freed_memory(single_arena=True)  # before any thread allocates: the trainer's steps share one arena

    files, overrides = split_files_and_overrides([*configs, *ctx.args])
    cfg = load_config(files, overrides)
    if dry_run:
        typer.echo(cfg.to_toml())
        return
    from agentrl.recipes.rl import train

    train(cfg, resume=resume)


@app.command(context_settings=EXTRA_ARGS)
def sft(ctx: typer.Context, configs: Configs) -> None:
    """Supervised warm start on the environment's demonstrations (cached by config)."""
    from agentrl.config import load_config
    from agentrl.heap import keep_freed_memory
    from agentrl.overrides import split_files_and_overrides
    from agentrl.recipes.sft import sft_command

    keep_freed_memory(single_arena=True)  # before any thread allocates (agentrl.heap)

    typer.echo(str(sft_command(load_config(*split_files_and_overrides([*configs, *ctx.args])))))


@app.command()
def export(
    run_dir: RunDir,
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
