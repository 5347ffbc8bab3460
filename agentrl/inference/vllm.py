"""Start ``vllm serve`` from vLLM's own venv, with the flags agentrl's token path needs.

vLLM lives in ``.venv-vllm`` (``bash .ci/install-vllm``), never in the trainer's venv:
agentrl runs its CLI as a child process and talks to it over HTTP only.
:func:`start_vllm_server` adds, to what a plain ``vllm serve MODEL`` does:

- the trainer's dtype (``--dtype``; fp32 served as bf16 would make μ another policy than π),
  μ after temperature/top-k/top-p (``--logprobs-mode processed_logprobs``, the embedded
  engine's basis), no sampling defaults from the model's ``generation_config.json``, tools
  (``--tool-call-parser``), prefix caching;
- a memory cap (vLLM's default takes most of the host's RAM or GPU), a port of its own,
  loopback only (``VLLM_HOST_IP=127.0.0.1``: its internal queues bind that address too);
- the routes a weight push needs (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
  ``/collective_rpc``, ``/reset_prefix_cache``, ``/weight_info``, NCCL weight transfer),
  all behind the run's key: vLLM's ``--api-key`` guards ``/v1`` only, so agentrl loads
  :mod:`agentrl.inference.vllm_guard` as ASGI middleware, which guards every route but
  ``/health``.  The key travels in the environment (``AGENTRL_API_KEY``), never on a
  command line other users can read.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.auth import check_private_path
from agentrl.errors import EngineStartError
from agentrl.inference.launcher import EngineHandle, _die_with_parent, wait_for_health

VENV = ".venv-vllm"  # made by .ci/install-vllm
GUARD = "agentrl_vllm_guard.KeyGuard"  # the middleware's import path inside the server


def find_vllm(command: str | None = None) -> list[str]:
    """The command that runs vLLM's CLI: ``command`` (``inference.vllm_command``), else
    ``.venv-vllm/bin/vllm`` in the working directory or in agentrl's checkout.
    Raises :class:`EngineStartError` (one line, what to do) when there is none."""
    if command:
        argv = shlex.split(command)
        if not argv or shutil.which(argv[0]) is None:
            raise EngineStartError(f"inference.vllm_command = {command!r}: {argv[0] if argv else '(empty)'} is not "
                                   "an executable; give the path of vLLM's CLI (e.g. .venv-vllm/bin/vllm)")  # fmt: skip
        return argv
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        exe = root / VENV / "bin" / "vllm"
        if exe.is_file() and os.access(exe, os.X_OK):
            try:  # it runs with the run's key: one another user could have put there is refused
                check_private_path(exe.absolute())
            except PermissionError as e:
                raise EngineStartError(f"{exe} is not safe to run: {e}; set inference.vllm_command to a vLLM CLI "
                                       "only you can change") from None  # fmt: skip
            return [str(exe)]
    raise EngineStartError(
        f"inference.engine = \"vllm\" needs vLLM: run `bash .ci/install-vllm` (makes {VENV}, ~12 min) or set "
        "inference.vllm_command to vLLM's CLI, or pass inference.base_url of a running vllm serve"
    )


def host_has_gpu() -> bool:
    """Whether vLLM here would be the CUDA build (``.ci/install-vllm`` asks nvidia-smi the same)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class VLLMArgs:
    """What agentrl sets on a ``vllm serve`` it starts (the rest are vLLM's defaults)."""

    dtype: str = "float32"  # the trainer's: agentrl trains in fp32
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_gb: int = 1
    gpu: bool = False
    enforce_eager: bool | None = None  # None: on a CPU host only (start-up 1 min, not 2-5)
    nccl: bool = False  # --weight-transfer-config nccl (GPU only)
    tool_parser: str = "hermes"
    max_logprobs: int = 20  # top-N logprobs a request may ask for (support size K, see client)
    extra_args: Sequence[str] = field(default_factory=tuple)


def vllm_serve_command(vllm: Sequence[str], model: str | Path, *, port: int, served_model_name: str,
                       args: VLLMArgs, host: str = "127.0.0.1") -> list[str]:  # fmt: skip
    """The ``vllm serve`` command line agentrl runs."""
    cmd = [
        *vllm, "serve", str(model), "--host", host, "--port", str(port),
        "--served-model-name", served_model_name, "--dtype", args.dtype,
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(args.max_logprobs),
        "--generation-config", "vllm",  # sampling defaults from the model's files would change μ
        "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", args.tool_parser,
        "--middleware", GUARD, "--disable-uvicorn-access-log",
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out, the weight version of every token
    ]  # fmt: skip
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.gpu:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_gb * 2**30)]
    if args.enforce_eager if args.enforce_eager is not None else not args.gpu:
        cmd += ["--enforce-eager"]
    if args.nccl:
        cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
    return [*cmd, *args.extra_args]


def vllm_env(args: VLLMArgs, api_key: str, guard_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: dev-mode routes, loopback, memory cap, the key and its guard."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_API_KEY", None)  # the guard checks every route; a second key would only disagree
    env.update({
        "VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "AGENTRL_API_KEY": api_key,
        "PYTHONPATH": os.pathsep.join(p for p in (str(guard_dir), env.get("PYTHONPATH", "")) if p),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no phoning home
    })  # fmt: skip
    if not args.gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    return env


class VLLMHandle(EngineHandle):
    """A running ``vllm serve``: stopping it stops its whole process group (its engine core too)."""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (an engine core that outlived its server)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None


def start_vllm_server(
    model: str | Path,
    *,
    api_key: str,
    args: VLLMArgs | None = None,
    vllm: Sequence[str] | None = None,
    port: int = 0,
    served_model_name: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout: float = 900.0,
) -> VLLMHandle:
    """Run ``vllm serve`` on ``model`` in a child process and wait for ``/health``.

    ``api_key``: every route but ``/health`` asks for it.  ``vllm``: the CLI
    (:func:`find_vllm` by default).  ``env``: extra variables (e.g. thread counts).
    """
    from agentrl.inference.launcher import is_model_dir

    if not is_model_dir(model):
        raise EngineStartError(f"no model at {str(model)!r} (expected a HF model dir with config.json)")
    args = args or VLLMArgs()
    vllm = list(vllm or find_vllm())
    name = served_model_name or Path(model).name
    port = port or _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-vllm-"))  # 0700: the guard's copy and the log
    shutil.copyfile(Path(__file__).with_name("vllm_guard.py"), tmp / "agentrl_vllm_guard.py")
    log_path = tmp / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            vllm_serve_command(vllm, model, port=port, served_model_name=name, args=args),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**vllm_env(args, api_key, tmp), **(env or {})},
            start_new_session=True,  # its own process group: stop() reaches the engine core too
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )  # fmt: skip
    handle = VLLMHandle(proc, "127.0.0.1", port, name, log_path, tmp)
    try:
        wait_for_health(proc, "127.0.0.1", lambda: port, log_path, timeout=startup_timeout, what="vllm serve",
                        poll_s=1.0)  # fmt: skip
    except BaseException:  # a failed start, a timeout or Ctrl-C: no child or temp dir is left
        handle.stop(timeout=5)
        raise
    handle._relaunch = lambda on_port: start_vllm_server(
        model, api_key=api_key, args=args, vllm=vllm, port=on_port, served_model_name=served_model_name, env=env,
        startup_timeout=startup_timeout,
    )
    return handle


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # pragma: no cover - manual: python -m agentrl.inference.vllm MODEL
    print(shlex.join(vllm_serve_command(find_vllm(), sys.argv[1], port=8000, served_model_name="model",
                                        args=VLLMArgs())))  # fmt: skip
