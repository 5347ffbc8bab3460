"""A user's endpoint or model-dir mistake is one line naming what broke and the setting to change,
exit 2, no traceback: never an environment's checklist failing, never a run that trains first.

Real servers: an agentrl engine started with an explicit key (every route but /health needs it),
and a port where nothing listens; the real command line (`agentrl eval | env test | run | model`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from agentrl_cli import agentrl
from testkit import free_port

from agentrl.inference import start_embedded_engine

KEY = "arl-endpoint-errors-0123456789"
NO_KEY = {"AGENTRL_API_KEY": "", "OPENAI_API_KEY": ""}  # empty reads as unset


@pytest.fixture(scope="module")
def keyed(small_model):
    """An engine given its key explicitly: /v1/models needs it too."""
    with start_embedded_engine(small_model, max_batch_size=4, max_model_len=256, device="cpu", api_key=KEY) as eng:
        yield eng


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there


def one_line(r: subprocess.CompletedProcess) -> str:
    """The run's single ``error:`` line, after checking it is exit 2 with no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- agentrl env test


def test_env_test_on_a_dead_endpoint_is_the_endpoints_fault_not_the_envs(dead_url):
    r = agentrl("env", "test", "calc", "-m", "tiny", "-b", dead_url, "-n", "1", timeout=120)
    line = one_line(r)
    assert dead_url.removesuffix("/v1") in line and "--base-url" in line and "cannot reach" in line
    assert "FAIL" not in r.stdout and "episodes_run" not in r.stdout  # no checklist blaming the env


def test_env_test_takes_the_api_key_and_says_when_none_was_given(keyed):
    r = agentrl("env", "test", "calc", "-m", keyed.model, "-b", keyed.base_url, "-n", "1", "-t", "4", env=NO_KEY,
                timeout=120)
    line = one_line(r)
    assert "HTTP 401" in line and "no API key was given" in line and "--api-key" in line and "AGENTRL_API_KEY" in line
    r = agentrl("env", "test", "calc", "-m", keyed.model, "-b", keyed.base_url, "-n", "1", "-t", "4",
                "--api-key", KEY, env=NO_KEY, timeout=120)
    assert "error:" not in r.stderr and "401" not in r.stdout, r.stderr[-2000:]
    assert "episodes_run" in r.stdout  # the checklist ran against the endpoint


# ----------------------------------------------------------------------------- agentrl eval


def test_eval_without_a_key_says_none_was_given_not_a_wrong_one(keyed, tmp_path):
    r = agentrl("eval", "calc", "-m", keyed.model, "-b", keyed.base_url, "-n", "1", "-r", "1",
                "-o", tmp_path / "out", env=NO_KEY, timeout=120)
    line = one_line(r)
    assert "no API key was given" in line and "--api-key" in line and "AGENTRL_API_KEY" in line
    assert "wrong API key" not in line


# ----------------------------------------------------------------------------- agentrl run


def run_against(url: str, model_dir: Path, run_dir: Path, env: dict[str, str] | None = None, **extra):
    over = {"run.dir": run_dir, "model.path": model_dir, "env.name": "calc", "inference.base_url": url,
            "sft.enabled": "false", "trainer.steps": 1, "eval.every": 0, **extra}  # fmt: skip
    return agentrl("run", *[f"--{k}={v}" for k, v in over.items()], env=env, timeout=120)


def test_run_checks_inference_base_url_before_anything_starts(small_model, dead_url, tmp_path):
    r = run_against(dead_url, small_model, tmp_path / "run")
    line = one_line(r)
    assert "inference.base_url" in line and "--base-url" not in line and "cannot reach" in line
    assert not (tmp_path / "run").exists()  # failed in preflight: no run dir, no warm start, no engine


def test_run_without_the_servers_key_names_agentrl_api_key(keyed, small_model, tmp_path):
    r = run_against(keyed.base_url, small_model, tmp_path / "run", env=NO_KEY, **{"inference.model_name": keyed.model})
    line = one_line(r)
    assert "inference.base_url" in line and "AGENTRL_API_KEY is not set" in line and "--api-key" not in line
    assert not (tmp_path / "run").exists()


def test_run_with_a_model_name_the_server_lacks_names_inference_model_name(keyed, small_model, tmp_path):
    r = run_against(keyed.base_url, small_model, tmp_path / "run", env={"AGENTRL_API_KEY": KEY},
                    **{"inference.model_name": "nope"})
    line = one_line(r)
    assert f'set inference.model_name = "{keyed.model}"' in line and "--model" not in line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- model dirs


@pytest.fixture(scope="module")
def broken_dirs(small_model, tmp_path_factory) -> tuple[Path, Path]:
    """(a model dir without its tokenizer files, one whose tokenizer has no chat template)."""
    root = tmp_path_factory.mktemp("broken")
    notok, notmpl = root / "notok", root / "notmpl"
    shutil.copytree(small_model, notok)
    shutil.copytree(small_model, notmpl)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (notok / f).unlink()
    (notmpl / "chat_template.jinja").unlink(missing_ok=True)
    cfg = notmpl / "tokenizer_config.json"
    tc = json.loads(cfg.read_text())
    tc.pop("chat_template", None)
    cfg.write_text(json.dumps(tc))
    return notok, notmpl


def assert_not_cut(line: str) -> None:
    """Ends a sentence: not mid-word, not at a dangling 'from one of:'."""
    assert not line.rstrip().endswith(":") and "instanti" not in line.split()[-1], line


def test_a_model_dir_without_a_tokenizer_says_which_files_and_what_to_do(broken_dirs):
    notok, _ = broken_dirs
    for r in (agentrl("model", "check-template", notok, timeout=120),
              agentrl("serve", notok, "--port", "0", "--device", "cpu", timeout=120)):
        line = one_line(r)
        assert f"no tokenizer in '{notok}'" in line and "tokenizer.json / tokenizer_config.json missing" in line, line
        assert "copy the base model's tokenizer files into it" in line and "Couldn't instantiate" not in line
        assert_not_cut(line)


def test_a_tokenizer_without_a_chat_template_says_how_to_add_one(broken_dirs):
    _, notmpl = broken_dirs
    line = one_line(agentrl("model", "check-template", notmpl, timeout=120))
    assert "has no chat template" in line and "chat_template" in line.split("has no chat template", 1)[1]
    assert f"agentrl model check-template {notmpl}" in line


def test_clip_cuts_at_a_word_with_an_ellipsis():
    from agentrl.inference.client import clip

    text = "Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` library serialization file"
    out = clip(text, 60)
    assert out.endswith("…") and "\n" not in out and len(out) <= 61
    assert text.replace("\n", " ").startswith(out[:-1])
    assert out[:-1].split()[-1] in text.split()  # the last word is whole
    assert clip("short", 60) == "short"


def test_serving_a_model_without_a_chat_template_warns_and_blames_the_server_not_the_messages(broken_dirs):
    """`agentrl serve` of such a model started silently, and every chat request got a 400 "could not apply
    the chat template to these messages" (param messages): the client's fault, it said.  The server now
    warns at start, and the chat route names the served model's missing template; completions work."""
    import httpx

    _, notmpl = broken_dirs
    with start_embedded_engine(notmpl, max_batch_size=4, max_model_len=256, device="cpu", api_key=KEY) as eng:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=eng.root_url, headers=headers, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={"model": eng.model, "messages": [{"role": "user", "content": "hi"}]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "no_chat_template", r.text
            assert "has no chat template" in err["message"] and "/v1/completions" in err["message"], err
            r = http.post("/v1/completions", json={"model": eng.model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    port = free_port()
    proc = subprocess.Popen(["agentrl", "serve", str(notmpl), "--port", str(port), "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        import selectors
        import time

        lines: list[str] = []
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)  # type: ignore[arg-type]
        deadline = time.monotonic() + 120
        # the start-up notes follow "serving" at once: read until the warning, or 5 quiet seconds after it
        quiet_from = None
        while time.monotonic() < deadline and not any("no chat template" in x for x in lines):
            if not sel.select(timeout=1.0):
                if any("agentrl engine: serving" in x for x in lines):
                    quiet_from = quiet_from or time.monotonic()
                    if time.monotonic() - quiet_from > 5:
                        break
                continue
            line = proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
        assert any("warning: the model's tokenizer has no chat template" in x for x in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(30)


# ----------------------------------------------------------------------------- a server that fails


def flaky_models_server(failures: int, status: int = 503):
    """A real HTTP server whose ``GET /v1/models`` answers ``status`` ``failures`` times, then lists ``tiny``."""
    from aiohttp import web
    from threaded_app import ThreadedApp

    hits = {"models": 0}

    async def models(_):
        hits["models"] += 1
        if hits["models"] <= failures:
            return web.json_response({"error": {"message": "warming up", "type": "server_error"}}, status=status)
        return web.json_response({"data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return ThreadedApp(app), hits


async def test_a_server_busy_for_a_moment_is_tried_again():
    from agentrl.inference.probe import CLI, reachable

    app, hits = flaky_models_server(failures=2)
    with app as srv:
        await reachable([srv.url], None, settings=CLI, model="tiny")
    assert hits["models"] == 3


def test_a_server_that_keeps_failing_is_its_failure_not_the_users_settings(tmp_path):
    """Exit 1 (failed work), not 2 (bad input): nothing the user set is wrong."""
    app, hits = flaky_models_server(failures=10**6, status=500)
    with app as srv:
        r = agentrl("eval", "calc", "--model", "tiny", "--base-url", srv.url, "-n", "1", "--out", str(tmp_path / "o"),
                    timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and hits["models"] == 3
    line = next(x for x in r.stderr.splitlines() if x.startswith("error:"))
    assert "answered HTTP 500 (warming up) to 3 tries: the server failed, not this command; see its log" in line
