"""Finding environments and rubrics: entry points, or a package directory on disk.

An environment package declares

    [project.entry-points."agentrl.environments"]
    my-env = "my_env:load_environment"

and is found by its entry-point name once installed (``pip install -e path``), or — from a
checkout, without installing — by the path of its directory (``environments/calc``).
Rubric plugins work the same way under ``agentrl.rubrics`` (factories returning a Rubric).
Names compare case-insensitively with ``-`` and ``_`` treated alike.

A name is a path only when it looks like one (it holds a ``/`` or ``\\``, starts with ``.``
or ``~``, or is absolute): a bare ``code-tests`` is always an entry point, never a folder
of that name in the current directory, so a directory someone else can write to cannot
stand in for an installed plugin.  Two different distributions registering one name in one
group is an error when that name is looked up, naming both.  A plugin's source directory
(path mode, or an editable install) is appended to ``sys.path``, never put first: only the
entry point's own top-level module is loaded from it by force, so a stray ``json.py``
beside it cannot shadow the standard library or an installed package.

An environment's defaults are its factory's own keyword defaults (``def
load_environment(difficulty=2)``), which hold however the package is installed.  A
``[tool.agentrl.args]`` table in ``pyproject.toml`` is still applied when the package is loaded
from its source (a path, ``pip install -e``), with a warning: a wheel does not carry the file,
so the same package installed with ``pip install DIR`` ran with other arguments, silently.

A plugin's own code failing (its module does not import, its factory raises) is a
:class:`~agentrl.errors.UserCodeError` naming the plugin, its entry point, the function
and the exception on one line; the CLI's ``--traceback`` shows the full trace.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.metadata as md
import importlib.util
import inspect
import json
import re
import sys
import tomllib
import warnings
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
    defaults: dict[str, Any] = field(default_factory=dict)  # [tool.agentrl.args], source dirs only
    location: str = ""  # the directory the distribution is installed in (for error messages)

    @property
    def kind(self) -> str:
        return "environment" if self.group == ENV_GROUP else "rubric"

    def load(self) -> Any:
        """The factory object (imports the module)."""
        module_name, _, attr = self.target.partition(":")
        try:
            if self.source_dir is not None:
                _import_top_from_source(self.source_dir, module_name)
            obj = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as e:
            raise UserCodeError(
                f"{self.kind} {self.name!r} ({self.target}) failed to import: {_one_line(e)}{_TRACE_HINT}"
            ) from e
        return obj

    def call(self, factory: Any, args: dict[str, Any], given: dict[str, Any] | None = None) -> Any:
        """``factory(**args)``; arguments it cannot take are an AgentrlError (naming the ones the
        caller ``given``, default all), anything it raises a :class:`UserCodeError` naming the
        plugin, the function and the exception."""
        named = sorted(args if given is None else given)
        try:
            inspect.signature(factory).bind(**args)
        except TypeError as e:
            raise AgentrlError(f"{self.kind} {self.name!r} rejected its arguments {named}: {e}") from e
        except ValueError:  # no introspectable signature (a builtin, a C extension): just call it
            pass
        try:
            return factory(**args)
        except TypeError as e:
            if _is_bad_argument(e, args):  # ``**kwargs`` passed on to a constructor that refused one
                raise AgentrlError(f"{self.kind} {self.name!r} rejected its arguments {named}: {e}") from e
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


def _import_top_from_source(source_dir: Path, module_name: str) -> None:
    """Import ``module_name``'s top-level module from ``source_dir`` (or its ``src/``).

    Only that one module is taken from the directory by force (a copy imported from
    elsewhere, say another worktree, is dropped first), so two checkouts of one module each
    load their own.  The directory itself goes on the *end* of ``sys.path``, for the
    plugin's sibling modules: any other file in it cannot shadow the standard library or an
    installed package."""
    roots = [source_dir / "src", source_dir] if (source_dir / "src").is_dir() else [source_dir]
    for root in roots:
        if str(root) not in sys.path:
            sys.path.append(str(root))
    top = module_name.split(".")[0]
    spec = importlib.machinery.PathFinder.find_spec(top, [str(r) for r in roots])
    if spec is None:  # the entry point names a module from elsewhere: an ordinary import
        return
    mod = sys.modules.get(top)
    if mod is not None:
        where = Path(getattr(mod, "__file__", "") or "").resolve()
        if any(r.resolve() in where.parents for r in roots):
            return  # already this directory's copy
        for key in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
            del sys.modules[key]
    if spec.loader is None or spec.origin is None:  # a namespace package: the import path decides
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules[top] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(top, None)
        raise


def _read_pyproject(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads((path / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise AgentrlError(f"cannot read {path / 'pyproject.toml'}: {e}") from e


def _tool_args(pyproject: dict[str, Any]) -> dict[str, Any]:
    """``[tool.agentrl.args]`` (read from a source dir only: a wheel does not carry pyproject.toml)."""
    return dict(pyproject.get("tool", {}).get("agentrl", {}).get("args", {}))


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


def _dist_key(dist: md.Distribution) -> str:
    """One key per distribution name (PEP 503), so the same distribution found twice on
    ``sys.path`` (a repeated entry, a stale ``*.egg-info`` beside an editable source) counts once."""
    name = dist.name or ""
    return re.sub(r"[-_.]+", "-", name).lower() if name else f"?{id(dist)}"


def _by_name(group: str) -> dict[str, list[Plugin]]:
    """Normalised plugin name → the plugins registering it, one per distribution, in
    ``sys.path`` order (two entries: two distributions claim the name)."""
    found: dict[str, list[Plugin]] = {}
    seen: set[str] = set()
    for dist in md.distributions():
        key = _dist_key(dist)
        if key in seen:  # the first copy on sys.path is the one Python imports, as md.entry_points()
            continue
        seen.add(key)
        for ep in dist.entry_points.select(group=group):
            plugin = Plugin(ep.name, ep.value, group, dist.name or "", dist.version or "")
            plugin.location = str(dist.locate_file(""))
            source = _editable_source(dist)
            if source is not None:
                plugin.source_dir = source
                plugin.defaults = _tool_args(_read_pyproject(source))
            found.setdefault(normalize(ep.name), []).append(plugin)
    return found


def installed(group: str) -> list[Plugin]:
    """Every plugin registered under ``group`` by an installed distribution; a name that two
    distributions register is listed once for each (and :func:`find` refuses it)."""
    return sorted((p for ps in _by_name(group).values() for p in ps), key=lambda p: (normalize(p.name), p.dist))


def _from_directory(path: Path, group: str) -> Plugin:
    pyproject = _read_pyproject(path)
    project = pyproject.get("project", {})
    eps = project.get("entry-points", {}).get(group, {})
    if not eps:
        raise EnvironmentNotFound(f"{path} declares no [project.entry-points.\"{group}\"] entry")
    name, target = next(iter(eps.items()))
    plugin = Plugin(name, target, group, project.get("name", ""), str(project.get("version", "")), path.resolve())
    plugin.defaults = _tool_args(pyproject)
    return plugin


def _looks_like_path(name: str) -> bool:
    """``environments/calc``, ``./my_env``, ``~/envs/x``, ``/abs/dir``: yes; ``code-tests``: no,
    even when a folder of that name is in the current directory (an entry point, always)."""
    return "/" in name or "\\" in name or name.startswith((".", "~")) or Path(name).is_absolute()


def find(name_or_path: str, group: str = ENV_GROUP) -> Plugin:
    """Resolve an installed name or a package directory to a :class:`Plugin`."""
    not_found = EnvironmentNotFound if group == ENV_GROUP else RubricNotFound
    kind = "environment" if group == ENV_GROUP else "rubric"
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "pyproject.toml").is_file():
            raise not_found(f"{path} is not a package directory (no pyproject.toml)")
        return _from_directory(path, group)
    registered = _by_name(group)
    match = registered.get(normalize(name_or_path), [])
    if len(match) == 1:
        return match[0]
    if len(match) > 1:
        claims = ", ".join(f"{p.dist} {p.version} in {p.location}" for p in match)
        raise AgentrlError(
            f"{kind} {name_or_path!r} is registered by {len(match)} distributions ({claims}): "
            "pip uninstall all but the one you mean"
        )
    by_name = {n: ps[0] for n, ps in registered.items()}
    close = difflib.get_close_matches(normalize(name_or_path), list(by_name), n=1, cutoff=0.5)
    hint = f"; did you mean {by_name[close[0]].name!r}?" if close else ""
    names = sorted(p.name for p in by_name.values())
    listing = ", ".join(names) if names else "none (pip install -e <env dir>, or pass a path)"
    local = ""
    if (Path(name_or_path) / "pyproject.toml").is_file():  # a bare name is never a folder: say how to ask for one
        local = f"; ./{name_or_path} here is a package directory: pass ./{name_or_path} to load it from source"
    raise not_found(f"no {kind} {name_or_path!r}{hint} installed: {listing}{local}")


def load_environment(name_or_path: str, **kwargs: Any):
    """Build an environment: ``factory(**kwargs)`` (a source dir's ``[tool.agentrl.args]``
    under them, with a warning: module docstring).

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
    if plugin.defaults:
        warnings.warn(
            f"environment {plugin.name!r}: [tool.agentrl.args] in {plugin.source_dir}/pyproject.toml applies only "
            "when the package is loaded from its source; a wheel install (pip install DIR) ignores it: give "
            "load_environment() those defaults in its signature and delete the table", UserWarning, stacklevel=2,
        )
    env = plugin.call(factory, {**plugin.defaults, **kwargs}, given=kwargs)
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
