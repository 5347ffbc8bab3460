"""Where a policy is served: start the embedded engine, or connect to running servers.

:func:`open_policy` is the one "local model dir → start an engine, else connect to
``base_url``" step that ``agentrl run``, ``eval``, ``env test`` and the SFT evaluator share.
:func:`start_embedded_engine` runs ``python -m agentrl.inference.server`` in a child
process: ``with start_embedded_engine(model_dir) as eng: ...``; ``eng.base_url`` is the
OpenAI base URL (``http://127.0.0.1:PORT/v1``).  The child dies with the parent (Linux
parent-death signal, plus :func:`exit_with_parent`, the watchdog thread the server and its
engine core both start), ``stop()`` is idempotent and removes the engine's temporary
directory.  ``eng.api_key`` is the engine's key: the one given
(``api_key=``, else ``AGENTRL_API_KEY``), handed to the child in its environment (never its
command line), or the one the engine made and wrote 0600 into its temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.auth import KEY_ENV, auth_headers, client_key, new_key, read_key
from agentrl.errors import AgentrlError, EngineStartError
from agentrl.inference.engine_args import EngineArgs


def end_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, up to ``timeout`` s for it to exit, then SIGKILL; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_with_parent(ppid: int) -> None:
    """In a child: a daemon thread that exits this process (``os._exit(0)``, no cleanup) once
    ``ppid`` is no longer its parent, however that parent ended (even a SIGKILL): no orphans."""

    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class EngineHandle:
    """A running embedded engine: ``base_url`` (…/v1), ``root_url``, ``model``, ``api_key``, ``stop()``."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, model: str, log_path: Path,
                 tmp_dir: Path | None = None, api_key: str | None = None, shm_dir: Path | None = None):
        self.proc, self.host, self.port, self.model, self.log_path = proc, host, port, model, log_path
        self.tmp_dir = tmp_dir  # removed by stop()
        self.shm_dir = shm_dir  # the engine's shared-memory segments live here: removed by stop(), even after a kill
        self.api_key = api_key
        self.restarts = 0
        self._relaunch: Callable[[int], EngineHandle] | None = None  # set by start_embedded_engine
        url_host = f"[{host}]" if ":" in host else host
        self.root_url = f"http://{url_host}:{port}"
        self.base_url = f"{self.root_url}/v1"
        atexit.register(self.stop)

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header that opens this engine's control routes."""
        return auth_headers(self.api_key)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        end_process(self.proc, timeout)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None
        if self.shm_dir is not None:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            self.shm_dir = None

    def restart(self) -> None:
        """Start the engine again on the same address (after it died); it comes back on the
        checkpoint's base weights at version 0: the caller pushes the current weights."""
        if self._relaunch is None:
            raise EngineStartError(f"{self} was not started by agentrl and cannot be restarted")
        self.stop()
        fresh = self._relaunch(self.port)
        self.proc, self.log_path, self.tmp_dir, self.api_key = fresh.proc, fresh.log_path, fresh.tmp_dir, fresh.api_key
        self.shm_dir, fresh.tmp_dir, fresh.shm_dir = fresh.shm_dir, None, None
        atexit.unregister(fresh.stop)
        self.restarts += 1

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EngineHandle({self.base_url}, model={self.model!r}, pid={self.proc.pid})"


def start_embedded_engine(
    model_dir: str | Path,
    args: EngineArgs | None = None,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    startup_timeout: float = 300.0,
    env: dict[str, str] | None = None,
    tool_parser: str | None = None,
    api_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    weights_dir: str | Path | None = None,
    **overrides: Any,
) -> EngineHandle:
    """Launch ``python -m agentrl.inference.server`` and wait until ``/health`` answers.

    ``args`` (or keyword overrides of its fields, e.g. ``max_model_len=512``): :class:`EngineArgs`.
    ``tool_parser``: how the chat route splits tool calls (default: detected from the template).
    ``api_key``: the engine's key (every route but /health needs it); without one (and no
    ``AGENTRL_API_KEY``) the engine makes its own, guarding its control routes: ``handle.api_key``.
    ``allowed_hosts``: Host names it serves besides loopback names and IP literals.
    ``weights_dir``: the one dir its disk weight pushes and ``/update_weights_from_disk`` read
    (default: a private dir of the engine's own).
    """
    args = dataclasses.replace(args or EngineArgs(), **overrides)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise EngineStartError(f"no model at {str(model_dir)!r} (expected a HF model dir with config.json)")
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-engine-"))  # 0700
    # 0700 too; the engine makes its own private dir inside, and stop() removes both even if it was killed
    shm = Path(tempfile.mkdtemp(prefix="agentrl-engine-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    port_file, log_path, key_file = tmp / "port.json", tmp / "engine.log", tmp / "api_key"
    name = served_model_name or model_dir.name
    cmd = [
        sys.executable, "-m", "agentrl.inference.server", str(model_dir),
        "--host", host, "--port", str(port), *args.cli_args(), "--served-model-name", name,
        "--port-file", str(port_file), "--parent-pid", str(os.getpid()),
        "--tool-call-parser", tool_parser or "auto", "--key-file", str(key_file),
        *(["--weights-dir", str(weights_dir)] if weights_dir is not None else []),
        *(["--shm-dir", str(shm)] if shm is not None else []),
    ]  # fmt: skip
    if allowed_hosts:
        cmd += ["--allowed-hosts", ",".join(allowed_hosts)]
    child_env = {**os.environ, **(env or {})}
    if api_key:
        child_env[KEY_ENV] = api_key
    given = child_env.get(KEY_ENV, "").strip() or None
    log = open(log_path, "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    log.close()

    def bound_port() -> int | None:
        return json.loads(port_file.read_text())["port"] if port_file.exists() else None

    try:
        port = wait_for_health(proc, host, bound_port, log_path, timeout=startup_timeout, what="embedded engine")
    except BaseException:  # a refusal, a timeout, or Ctrl-C while it starts: no child or temp dir is left
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
        raise
    handle = EngineHandle(proc, host, port, name, log_path, tmp, given or read_key(key_file), shm)
    handle._relaunch = lambda on_port: start_embedded_engine(  # the same key: the run's clients keep theirs
        model_dir, args, port=on_port, host=host, served_model_name=served_model_name,
        startup_timeout=startup_timeout, env=env, tool_parser=tool_parser, api_key=handle.api_key,
        allowed_hosts=allowed_hosts, weights_dir=weights_dir,
    )
    return handle


def wait_for_health(
    proc: subprocess.Popen,
    host: str,
    port: Callable[[], int | None],
    log_path: Path,
    *,
    timeout: float,
    what: str,
    poll_s: float = 0.1,
) -> int:
    """Poll ``/health`` until a server child answers 200; return its port.

    ``port()`` returns the port once known (None while the child is still binding).
    Raises :class:`EngineStartError` with the log's tail if the child dies, and kills it
    if it does not answer within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log_path.read_text(errors="replace").splitlines()
            refusal = [ln for ln in lines if ln.startswith("agentrl engine: error: ")]
            if refusal:  # the engine said why in one line (e.g. a model it cannot serve exactly)
                raise EngineStartError(refusal[-1].removeprefix("agentrl engine: error: "))
            tail = "\n".join(lines[-15:])
            raise EngineStartError(f"{what} exited with code {proc.returncode} during startup:\n{tail}")
        bound = port()
        if bound is not None:
            try:
                with urllib.request.urlopen(f"http://{host}:{bound}/health", timeout=2) as r:
                    if r.status == 200:
                        return bound
            except OSError:
                pass
        time.sleep(poll_s)
    proc.kill()
    raise EngineStartError(f"{what} did not answer /health within {timeout:.0f}s (log: {log_path})")


class Policy:
    """Where a run samples from: endpoint URLs, the served model name, engines to stop."""

    def __init__(self, base_urls: list[str], model: str, engines: list[Any] | None = None,
                 tokenizer_dir: Path | None = None, tool_parser: str = "hermes", api_key: str | None = None):
        self.base_urls, self.model, self.engines = base_urls, model, list(engines or [])
        self.api_key = api_key  # what its clients send (the key of the engines agentrl started)
        self.tokenizer_dir = tokenizer_dir  # a local copy of the served model's tokenizer, if any
        self.tool_parser = tool_parser  # the model's tool-call format (agentrl.tool_format)

    @property
    def started(self) -> bool:
        """True when agentrl started the engines (and may push weights into them)."""
        return bool(self.engines)

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        self.engines.clear()

    def dead(self) -> list[Any]:
        """Engines agentrl started that are no longer running."""
        return [e for e in self.engines if not e.alive]

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_model_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def engine_devices(device: str, engines: int, gpus: int, trainer_device: str) -> list[str]:
    """Where each of ``engines`` local engines runs, given the host's ``gpus``.

    ``auto`` or ``cuda`` on a host with several GPUs spreads the engines round-robin over the
    GPUs the trainer does not use (``trainer_device``; ``auto``/``cuda`` is GPU 0): an engine
    and a training step on one GPU share its memory and slow each other.  With one GPU or
    none, and for an explicit device (``cpu``, ``cuda:1``), every engine gets ``device``.
    Raises ``ValueError`` (one line) for a ``cuda:N`` past the host's GPUs.
    """
    if engines < 1:
        raise ValueError(f"engine_devices: engines must be at least 1, got {engines}")
    _gpu_of("inference.device", device, gpus)
    taken = _gpu_of("trainer.device", trainer_device, gpus)
    if device not in ("auto", "cuda") or gpus < 2:
        return [device] * engines
    free = [i for i in range(gpus) if i != taken]
    return [f"cuda:{free[k % len(free)]}" for k in range(engines)]


def _gpu_of(name: str, device: str, gpus: int) -> int | None:
    """The GPU ``device`` names (``auto``/``cuda``: 0; None: not a GPU); ValueError for a ``cuda:N`` the host lacks."""
    if not device.startswith("cuda:"):
        return 0 if device in ("auto", "cuda") else None
    index = device.split(":", 1)[1]
    if not index.isdigit() or (gpus and int(index) >= gpus):
        raise ValueError(f"{name} = {device!r}, but this host has {gpus} GPU(s): use auto, cpu or cuda:0..")
    return int(index)


def open_policy(
    model: str | Path,
    base_urls: str | list[str] | None = None,
    *,
    args: EngineArgs | None = None,
    served_model_name: str | None = None,
    env: dict[str, str] | None = None,
    tool_parser: str | None = None,
    tokenizer_dir: str | Path | None = None,
    engines: int = 1,
    devices: list[str] | None = None,
    api_key: str | None = None,
) -> Policy:
    """Connect to ``base_urls`` serving ``model``, or start ``engines`` embedded engines on the local dir ``model``.

    The one place that decides; raises :class:`~agentrl.errors.AgentrlError` with what to
    pass when neither works.  ``tool_parser`` (None or ``auto``: detected from the chat
    template of ``tokenizer_dir``, default the model dir when local; else ``hermes``) becomes
    ``Policy.tool_parser`` and the embedded engine's chat-route parser.  ``devices``: one per
    engine (:func:`engine_devices`), overriding ``args.device``.
    """
    from agentrl.tool_format import chat_template_of, resolve_tool_parser

    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls or [])
    local = is_model_dir(model)
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is None and local and (Path(model) / "tokenizer_config.json").is_file():
        tok = Path(model)
    parser = resolve_tool_parser(tool_parser, chat_template_of(tok) if tok is not None else None).name
    if urls:
        name = served_model_name or (Path(model).name if local else str(model))
        return Policy(urls, name, tokenizer_dir=tok, tool_parser=parser, api_key=api_key or client_key())
    if not local:
        raise AgentrlError(
            f"--model {str(model)!r} is not a local model dir (no config.json); "
            "pass --base-url for a remote endpoint"
        )
    if engines < 1:
        raise ValueError(f"open_policy: engines must be at least 1, got {engines}")
    if devices is not None and len(devices) != engines:
        raise ValueError(f"open_policy: {len(devices)} devices for {engines} engines")
    key = api_key or client_key() or new_key()  # one key for all of them: one client talks to each
    handles: list[EngineHandle] = []
    try:
        for i in range(engines):  # each its own process: its own GIL and torch threads
            own = dataclasses.replace(args or EngineArgs(), device=devices[i]) if devices is not None else args
            handles.append(start_embedded_engine(model, own, served_model_name=served_model_name, env=env,
                                                 tool_parser=parser, api_key=key))
    except BaseException:
        for h in handles:
            with contextlib.suppress(Exception):  # stop the rest even if one stop fails
                h.stop()
        raise
    return Policy([h.base_url for h in handles], handles[0].model, handles, tokenizer_dir=tok, tool_parser=parser,
                  api_key=key)
