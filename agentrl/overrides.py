"""Config text from files and the command line: dotted overrides, literals, merging.

Pure parsing, independent of the config's schema (:mod:`agentrl.config` validates what these
produce): ``--trainer.lr=1e-5`` becomes ``{"trainer": {"lr": 1e-5}}``, TOML tables merge left
to right, and non-finite numbers are refused wherever they appear.  A table given whole on the
command line (``--env.args='{}'``, ``--env.args='{show_tools = true}'``) replaces the files'
table, where dotted keys (``--env.args.show_tools=true``) merge into it: otherwise a config
file's env arguments could not be dropped for another env.
"""

from __future__ import annotations

import json
import math
import tomllib
from typing import Any

from agentrl.errors import ConfigError


class Whole(dict):
    """A table an override gave whole: :func:`deep_merge` puts it in place of the one it meets."""


def deep_merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in new.items():
        if isinstance(v, Whole):
            out[k] = dict(v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _parse_value(text: str) -> Any:
    """Override values are TOML/JSON literals when they parse as one, else strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN/inf inside ``value`` (None when every number is finite)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = non_finite(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if found is not None:
            return found
    return None


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--trainer.lr=1e-5", "--env.name", "calc"]`` → nested dict.

    Non-finite numbers (``nan``, ``inf``, ``NaN``, ``-Infinity``, also inside a list or
    table) are refused: JSON has no spelling for them, so they would vanish from
    ``--dry-run`` and ``config.toml`` while still reaching the code.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            i += 1
            value = args[i]
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"bad override key {key!r}")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with another override")
        parsed = _parse_value(value)
        if (bad := non_finite(parsed, key)) is not None:
            raise ConfigError(
                f"override --{key}={value}: {bad} is not a finite number; give a finite value "
                "(nan and inf cannot be recorded in config.toml)"
            )
        node[leaf] = Whole(parsed) if isinstance(parsed, dict) else parsed
        i += 1
    return out


def split_files_and_overrides(tokens: list[str]) -> tuple[list[str], list[str]]:
    """CLI tokens → (config files, dotted overrides): files come first, overrides after."""
    files: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.startswith("--"):
            return files, list(tokens[i:])
        files.append(tok)
    return files, []
