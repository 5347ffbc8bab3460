"""Finding environments and rubrics: entry points, or a package directory on disk.

An environment package declares

    [project.entry-points."agentrl.environments"]
    my-env = "my_env:load_environment"

    [tool.agentrl.args]          # optional defaults for load_environment(**kwargs)
    difficulty = 2

and is found by its entry-point name once installed (``pip install -e path``), or — from a
checkout, without installing — by the path of its directory (``environments/calc``).
Rubric plugins work the same way under ``agentrl.rubrics`` (factories returning a Rubric).
Names compare case-insensitively with ``-`` and ``_`` treated alike.

A plugin's own code failing (its module does not import, its factory raises) is a
:class:`~agentrl.errors.UserCodeError` naming the plugin, its entry point, the function
and the exception on one line; the CLI's ``--traceback`` shows the full trace.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from agentrl.errors import AgentrlError, EnvironmentNotFound, RubricNotFound, UserCodeError

ENV_GROUP = "agentrl.environments"
RUBRIC_GROUP = "agentrl.rubrics"


def normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@dataclass
class Plugin:
    """One discovered plugin: where it comes from and how to load it."""

    name: str
    target: str  # "module:attr"
    group: str
    dist: str = ""
    version: str = ""
    source_dir: Path | None = None  # package dir (path mode, or an editable install)
    defaults: dict[str, Any] = field(default_factory=dict)
    eval_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "environment" if self.group == ENV_GROUP else "rubric"

    def load(self) -> Any:
        """The factory object (imports the module)."""
        module_name, _, attr = self.target.partition(":")
        if self.source_dir is not None:
            _prefer_source(self.source_dir, module_name)
        try:
            obj = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as e:
            raise UserCodeError(
                f"{self.kind} {self.name!r} ({self.target}) failed to import: {_one_line(e)}{_TRACE_HINT}"
            ) from e
        return obj

    def call(self, factory: Any, args: dict[str, Any]) -> Any:
        """``factory(**args)``; arguments it cannot take are an AgentrlError, anything it raises
        a :class:`UserCodeError` naming the plugin, the function and the exception."""
        try:
            inspect.signature(factory).bind(**args)
        except TypeError as e:
            raise AgentrlError(f"{self.kind} {self.name!r} rejected its arguments {sorted(args)}: {e}") from e
        except ValueError:  # no introspectable signature (a builtin, a C extension): just call it
            pass
        try:
            return factory(**args)
        except TypeError as e:
            if _is_bad_argument(e, args):  # ``**kwargs`` passed on to a constructor that refused one
                raise AgentrlError(f"{self.kind} {self.name!r} rejected its arguments {sorted(args)}: {e}") from e
            raise UserCodeError(f"{self.kind} {self.name!r} ({self.target}) raised {_one_line(e)}{_TRACE_HINT}") from e
        except Exception as e:
            raise UserCodeError(f"{self.kind} {self.name!r} ({self.target}) raised {_one_line(e)}{_TRACE_HINT}") from e


_TRACE_HINT = " (fix the plugin, or rerun with --traceback to see where)"


def _is_bad_argument(e: TypeError, args: dict[str, Any]) -> bool:
    """A TypeError about the call's own keyword arguments (not a bug deeper in the factory)."""
    text = str(e)
    named = re.search(r"unexpected keyword argument '(\w+)'", text)
    return (named is not None and named.group(1) in args) or "required keyword-only argument" in text


def _one_line(e: BaseException, limit: int = 300) -> str:
    """``ValueError: message`` with the message's whitespace (newlines included) collapsed."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _prefer_source(source_dir: Path, module_name: str) -> None:
    """Make ``module_name`` import from ``source_dir`` (or its ``src/``)."""
    roots = [source_dir / "src", source_dir] if (source_dir / "src").is_dir() else [source_dir]
    for root in reversed(roots):  # first on sys.path, even when already on it further down
        while str(root) in sys.path:
            sys.path.remove(str(root))
        sys.path.insert(0, str(root))
    top = module_name.split(".")[0]
    mod = sys.modules.get(top)
    if mod is not None:
        where = Path(getattr(mod, "__file__", "") or "").resolve()
        if not any(r.resolve() in where.parents for r in roots):
            for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
                del sys.modules[key]


def _read_pyproject(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads((path / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise AgentrlError(f"cannot read {path / 'pyproject.toml'}: {e}") from e


def _tool_table(pyproject: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    table = pyproject.get("tool", {}).get("agentrl", {})
    return dict(table.get("args", {})), dict(table.get("eval", {}))


def _editable_source(dist: md.Distribution) -> Path | None:
    """The source dir of an editable (``pip install -e``) distribution, if any."""
    try:
        text = dist.read_text("direct_url.json")
        if not text:
            return None
        info = json.loads(text)
        if not info.get("dir_info", {}).get("editable"):
            return None
        url = urlparse(info.get("url", ""))
        path = Path(unquote(url.path))
        return path if (path / "pyproject.toml").is_file() else None
    except (OSError, ValueError):
        return None


def installed(group: str) -> list[Plugin]:
    """Every plugin registered under ``group`` by an installed distribution."""
    found: dict[str, Plugin] = {}
    for ep in md.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        plugin = Plugin(ep.name, ep.value, group, dist.name if dist else "", dist.version if dist else "")
        source = _editable_source(dist) if dist else None
        if source is not None:
            plugin.source_dir = source
            plugin.defaults, plugin.eval_defaults = _tool_table(_read_pyproject(source))
        found.setdefault(normalize(ep.name), plugin)
    return sorted(found.values(), key=lambda p: p.name)


def _from_directory(path: Path, group: str) -> Plugin:
    pyproject = _read_pyproject(path)
    project = pyproject.get("project", {})
    eps = project.get("entry-points", {}).get(group, {})
    if not eps:
        raise EnvironmentNotFound(f"{path} declares no [project.entry-points.\"{group}\"] entry")
    name, target = next(iter(eps.items()))
    plugin = Plugin(name, target, group, project.get("name", ""), str(project.get("version", "")), path.resolve())
    plugin.defaults, plugin.eval_defaults = _tool_table(pyproject)
    return plugin


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith(".") or Path(name).is_dir() and (Path(name) / "pyproject.toml").is_file()


def find(name_or_path: str, group: str = ENV_GROUP) -> Plugin:
    """Resolve an installed name or a package directory to a :class:`Plugin`."""
    not_found = EnvironmentNotFound if group == ENV_GROUP else RubricNotFound
    kind = "environment" if group == ENV_GROUP else "rubric"
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "pyproject.toml").is_file():
            raise not_found(f"{path} is not a package directory (no pyproject.toml)")
        return _from_directory(path, group)
    plugins = installed(group)
    by_name = {normalize(p.name): p for p in plugins}
    if (p := by_name.get(normalize(name_or_path))) is not None:
        return p
    names = [p.name for p in plugins]
    close = difflib.get_close_matches(normalize(name_or_path), list(by_name), n=1, cutoff=0.5)
    hint = f"; did you mean {by_name[close[0]].name!r}?" if close else ""
    listing = ", ".join(names) if names else "none (pip install -e <env dir>, or pass a path)"
    raise not_found(f"no {kind} {name_or_path!r}{hint} installed: {listing}")


def load_environment(name_or_path: str, **kwargs: Any):
    """Build an environment: package defaults from ``[tool.agentrl.args]``, then ``kwargs``.

    A URL (``http://host:port``) names an environment served by ``agentrl env serve``; its
    arguments were given to the server, so ``kwargs`` must be empty."""
    from agentrl.envs.base import Environment

    if name_or_path.startswith(("http://", "https://")):
        from agentrl.envs.remote import RemoteEnvironment

        if kwargs:
            raise AgentrlError(
                f"environment arguments {sorted(kwargs)} cannot go to a served environment ({name_or_path}): "
                "give them to `agentrl env serve NAME --env-args ...`"
            )
        return RemoteEnvironment(name_or_path)
    plugin = find(name_or_path, ENV_GROUP)
    factory = plugin.load()
    env = plugin.call(factory, {**plugin.defaults, **kwargs})
    if not isinstance(env, Environment):
        raise AgentrlError(f"{plugin.target} returned {type(env).__name__}, not an agentrl Environment")
    if env.name == Environment.name:
        env.name = plugin.name
    if env.version == Environment.version and plugin.version:
        env.version = plugin.version
    env.plugin = plugin
    return env


def load_rubric(name: str, **kwargs: Any):
    """Build a rubric plugin registered under ``agentrl.rubrics``."""
    from agentrl.rubrics import Rubric

    plugin = find(name, RUBRIC_GROUP)
    factory = plugin.load()
    rubric = plugin.call(factory, kwargs) if callable(factory) and not isinstance(factory, Rubric) else factory
    if not isinstance(rubric, Rubric):
        raise AgentrlError(f"{plugin.target} gave {type(rubric).__name__}, not an agentrl Rubric")
    return rubric


def parse_env_args(text: str | None) -> dict[str, Any]:
    """``--env-args`` JSON → kwargs (one-line error on bad input)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise AgentrlError(f"--env-args is not valid JSON ({e.msg} at char {e.pos}): {text!r}") from e
    if not isinstance(value, dict):
        raise AgentrlError(f"--env-args must be a JSON object like '{{\"k\": 1}}', got {text!r}")
    return value
