"""`agentrl eval` / `env init|list|test`: results, resume, pass@k, errors, and the full real path."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from agentrl_cli import agentrl

from agentrl.envs.check import ScriptedClient
from agentrl.errors import AgentrlError
from agentrl.plugins import load_environment
from agentrl.recipes.eval import evaluate, pass_at_k, read_results
from agentrl.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def solver(prompt: str) -> str:
    if "<|im_start|>tool\n" in prompt:
        return prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    expr = prompt.rsplit("What is ", 1)[1].split("?")[0]
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expr}})}\n</tool_call>'


class Flaky(ScriptedClient):
    """Endpoint that fails for some questions (an outage mid-eval)."""

    def __init__(self, bad_questions):
        super().__init__(solver)
        self.bad = bad_questions

    async def complete(self, prompt_ids, sampling, n=1):
        from agentrl.envs.check import decode

        if any(q in decode(prompt_ids) for q in self.bad):
            raise ConnectionError("endpoint down")
        return await super().complete(prompt_ids, sampling, n)


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)


async def test_results_are_jsonl_and_resume_reruns_only_errored(tmp_path):
    env = load_environment(str(ROOT / "environments/calc"), num_train=50)
    held = [t.prompt[0].content.removeprefix("What is ") for t in env.eval_dataset()[:4]]
    sampling = SamplingParams(max_tokens=100)
    s1 = await evaluate(env, Flaky(held[:1]), model="m", out_dir=tmp_path, num_tasks=4, rollouts=2, sampling=sampling)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and s1.episodes == 8 and s1.error_rate == pytest.approx(0.25)
    rec = json.loads(lines[0])
    for key in ["messages", "num_tool_calls", "prompt_tokens", "completion_tokens", "reward", "metrics",
                "stop_reason", "error", "timing", "env", "env_version"]:
        assert key in rec
    assert rec["env"] == "calc" and rec["env_version"] == "0.1.0"
    # the endpoint's failures measured nothing: the mean and pass@k are over the 6 scored episodes (3 tasks)
    assert s1.mean_reward == 1.0 and s1.pass_at[1] == 1.0

    with pytest.raises(AgentrlError, match="--resume"):  # never silently mixes two runs
        await evaluate(env, ScriptedClient(solver), model="m", out_dir=tmp_path, num_tasks=4, rollouts=2)
    with pytest.raises(AgentrlError, match="model"):
        await evaluate(env, ScriptedClient(solver), model="other", out_dir=tmp_path, num_tasks=4, rollouts=2, resume=True)

    client = ScriptedClient(solver)
    s2 = await evaluate(env, client, model="m", out_dir=tmp_path, num_tasks=4, rollouts=2, sampling=sampling, resume=True)
    assert len(client.prompts) == 2 * 2  # only the 2 errored episodes re-ran (2 model turns each)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 10
    assert s2.episodes == 8 and s2.error_rate == 0.0 and s2.mean_reward == 1.0 and s2.pass_at[2] == 1.0
    assert len(read_results(tmp_path)) == 8
    assert json.loads((tmp_path / "summary.json").read_text())["mean_reward"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "calcc", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"], "did you mean 'calc'"),
        (["eval", "calc", "--model", "m", "--env-args", "{bad"], "--env-args is not valid JSON"),
        (["eval", "calc", "--model", "m", "--env-args", '{"nope": 1}'], "rejected its arguments"),
        (["eval", "calc", "--model", "not/a/dir"], "not a local model dir"),
        (["env", "init", "Bad Name"], "bad environment name"),
        (["env", "test", "nosuchenv"], "no environment"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message):
    r = agentrl(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_an_unreachable_endpoint_is_named_before_any_episode_runs(tmp_path):
    r = agentrl("eval", "calc", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "-n", "2", "-r", "1",
                "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "cannot reach http://127.0.0.1:9" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out/results.jsonl").exists()


@pytest.mark.slow
def test_scaffold_install_discover_test_and_eval_on_the_embedded_engine(tmp_path):
    """env init → pip install -e → entry point → env list/test → eval (tiny model, embedded engine) → resume."""
    from agentrl.tiny_model import build_tiny_model

    r = agentrl("env", "init", "probe-env", "--path", str(tmp_path))
    assert r.returncode == 0, r.stderr
    pkg = tmp_path / "probe-env"
    assert {p.name for p in pkg.iterdir()} >= {"pyproject.toml", "probe_env.py", "README.md", "test_probe_env.py"}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(pkg)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    try:
        listed = agentrl("env", "list")
        assert "probe-env" in listed.stdout and "agentrl-env-probe-env" in listed.stdout
        tested = agentrl("env", "test", "probe-env")
        assert tested.returncode == 0, tested.stdout + tested.stderr
        scaffold_tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg)],
                                        capture_output=True, text=True, timeout=300, cwd=pkg)
        assert scaffold_tests.returncode == 0, scaffold_tests.stdout[-2000:]

        model = build_tiny_model(tmp_path / "tiny")
        out = tmp_path / "eval"
        ev = agentrl("eval", "probe-env", "--model", str(model), "-n", "3", "-r", "2", "-c", "4",
                     "--out", str(out), "--max-tokens", "24", "--temperature", "1.0", "--env-args", '{"num_tasks": 30}')
        assert ev.returncode == 0, ev.stderr[-3000:]
        recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        assert len(recs) == 6
        assert all(x["env"] == "probe-env" and x["env_version"] == "0.1.0" and x["error"] is None for x in recs)
        assert all(x["completion_tokens"] > 0 and x["prompt_tokens"] > 0 for x in recs)
        assert "mean reward" in ev.stdout and "pass@2" in ev.stdout
        again = agentrl("eval", "probe-env", "--model", str(model), "-n", "3", "-r", "2", "--out", str(out),
                        "--max-tokens", "24", "--temperature", "1.0", "--env-args", '{"num_tasks": 30}', "--resume")
        assert again.returncode == 0, again.stderr[-2000:]
        assert len((out / "results.jsonl").read_text().splitlines()) == 6  # nothing left to rerun
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "agentrl-env-probe-env"],
                       capture_output=True, timeout=120)


def token_server(tok, tokenize: str):
    """A vLLM-like token-path endpoint for the calc env (decodes each prompt, answers with
    ``solver``).  ``tokenize``: ``none`` (no /tokenize route), ``same`` or ``other`` (a
    /tokenize that disagrees with ``tok``)."""
    from aiohttp import web
    from threaded_app import ThreadedApp

    from agentrl.render import render_chat_ids

    hits = {"tokenize": 0, "completions": 0}
    eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def completions(request):
        body = await request.json()
        hits["completions"] += 1
        text = solver(tok.decode(body["prompt"]))
        ids = tok.encode(text, add_special_tokens=False)[: body["max_tokens"] - 1] + [eot]
        return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
                                               "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]})

    async def tokenize_route(request):
        body = await request.json()
        hits["tokenize"] += 1
        if "messages" in body:
            ids = render_chat_ids(tok, body["messages"], body.get("tools"), body.get("add_generation_prompt", True))
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=False)
        return web.json_response({"tokens": ids if tokenize == "same" else ids[::-1]})

    async def models(_):
        return web.json_response({"data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    if tokenize != "none":
        app.router.add_post("/tokenize", tokenize_route)
    return ThreadedApp(app), hits


@pytest.mark.parametrize("tokenize", ["none", "same", "other"])
@pytest.mark.slow
def test_eval_renders_prompts_with_the_local_tokenizer(tmp_path, tokenize):
    from agentrl.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    server, hits = token_server(tok, tokenize)
    with server as srv:
        base = ["eval", "calc", "--model", "tiny", "--base-url", srv.url, "-n", "2", "-r", "1", "--max-tokens", "100"]
        r = agentrl(*base, "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "out"))
        remote_renders = hits["tokenize"]
        without = agentrl(*base, "--out", str(tmp_path / "out2"))
    if tokenize == "other":  # a tokenizer that is not the served model's is refused before any episode
        assert r.returncode == 2 and "does not match the served model's" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "out/results.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(x["reward"] == 1.0 and x["turns"] == 2 for x in recs)
    assert remote_renders <= 1  # at most the probe's check; no prompt is rendered remotely
    if tokenize == "none":
        assert without.returncode == 2 and "no /tokenize route" in without.stderr and "--tokenizer DIR" in without.stderr
    else:
        assert without.returncode == 0, without.stderr[-2000:]


def test_a_bad_tokenizer_dir_is_one_line_exit_2(tmp_path):
    r = agentrl("eval", "calc", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--tokenizer", str(tmp_path / "no"))
    assert r.returncode == 2 and "is not a directory" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = agentrl("eval", "calc", "--model", "m", "--base-url", "http://127.0.0.1:9/v1", "--tool-parser", "hermse")
    assert r.returncode == 2 and "did you mean 'hermes'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
