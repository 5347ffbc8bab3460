"""agentrl against the real vLLM: the CPU build in ``.venv-vllm`` (``bash .ci/install-vllm``).

Skipped where ``.venv-vllm`` is absent; ``.ci/run`` builds it, so CI runs every test here.
One ``vllm serve`` (started by agentrl's launcher, ~1 min on 2 cores) serves the module; the
RL run starts its own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from agentrl.config import load_config
from agentrl.errors import AgentrlError, EndpointError, EngineStartError
from agentrl.inference import PolicyClient
from agentrl.inference.vllm import VLLMArgs, find_vllm, start_vllm_server
from agentrl.metrics import read_jsonl
from agentrl.recipes.rl import train as run_training
from agentrl.types import SamplingParams
from agentrl.weights.vllm import VLLMWeightSync

try:
    VLLM = find_vllm()
except EngineStartError:
    VLLM = None

# the first test also waits for the module's servers (vLLM starts in ~80 s on 2 idle cores, minutes on busy ones)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(VLLM is None, reason="no .venv-vllm: bash .ci/install-vllm")]  # fmt: skip
KEY = "test-key-vllm"


@pytest.fixture(scope="module")
def vllm(model_dir, max_model_len):
    with start_vllm_server(model_dir, api_key=KEY, args=VLLMArgs(max_model_len=max_model_len, max_num_seqs=16),
                           env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as h:  # fmt: skip
        yield h


def _client(url: str, model: str, tokenizer=None, **kw) -> PolicyClient:
    return PolicyClient(url, model, api_key=KEY, tokenizer=tokenizer, **kw)


def _prompts(tokenizer, tools, tool_prompt) -> list[list[int]]:
    """The taught tool-call prompt and prefixes of its answer: peaked and flat next-token distributions."""
    ids = list(tokenizer.apply_chat_template(tool_prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))  # fmt: skip
    assert all(isinstance(i, int) for i in ids)
    return [ids, ids[:-3], ids[:10], [1, 5, 6, 7]]


def test_every_route_but_health_needs_the_key(vllm):
    """vLLM's --api-key guards /v1 only; the dev routes (/collective_rpc calls any worker method) need the key too."""
    routes = [("GET", "/v1/models"), ("GET", "/weight_info"), ("GET", "/metrics"), ("POST", "/pause"),
              ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"), ("POST", "/collective_rpc")]  # fmt: skip
    with httpx.Client(base_url=vllm.root_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        for method, path in routes:
            body = {"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}} if path == "/collective_rpc" else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
                r = http.request(method, path, json=body, headers=headers, params={"new_version": "x"})
                assert r.status_code == 401, (method, path, headers, r.status_code)
        assert http.get("/weight_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == vllm.model


def test_logprobs_match_the_embedded_engine_in_fp32(vllm, engine, tokenizer, tools, tool_prompt):
    """Same checkpoint, same prompts: identical greedy tokens, μ within 1e-5 (the trainer's dtype is served)."""

    async def go():
        a, b = _client(vllm.base_url, vllm.model), _client(engine.base_url, engine.model)
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        worst = 0.0
        for ids in _prompts(tokenizer, tools, tool_prompt):
            (ca,), (cb,) = await a.complete(ids, greedy), await b.complete(ids, greedy)
            assert ca.token_ids == cb.token_ids
            worst = max([worst, *(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs, strict=True))])
        await a.close()
        await b.close()
        return worst

    assert asyncio.run(go()) <= 1e-5


def test_support_size_from_top_logprobs_matches_the_embedded_engine(vllm, engine, tokenizer, tools, tool_prompt):
    """top_p < 1: K counted from vLLM's top-20 processed logprobs equals the embedded engine's token_support."""

    async def go():
        a = _client(vllm.base_url, vllm.model, support_logprobs=20)
        b = _client(engine.base_url, engine.model)
        pairs, unknown = [], 0
        for ids in _prompts(tokenizer, tools, tool_prompt):
            for top_p in (0.3, 0.6, 0.9, 0.99):
                s = SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p, seed=0)
                (cb,) = await b.complete(ids, s)
                try:
                    (ca,) = await a.complete(ids, s)
                except EndpointError as e:  # K ≥ 20: refused, never guessed
                    assert "support size unknown" in str(e) and cb.support[0] >= 20
                    unknown += 1
                    continue
                pairs.append((ca.support[0], cb.support[0]))
        await a.close()
        await b.close()
        return pairs, unknown

    pairs, unknown = asyncio.run(go())
    assert all(k_vllm == k_engine for k_vllm, k_engine in pairs), pairs
    assert len({k for k, _ in pairs}) >= 3 and unknown >= 1  # several K measured, and the refusal was reached


def test_disk_push_changes_the_served_weights_and_restores_them_exactly(vllm, model_dir, tokenizer, tools, tool_prompt):
    ids = _prompts(tokenizer, tools, tool_prompt)[0]
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    async def go():
        client, sync = _client(vllm.base_url, vllm.model), VLLMWeightSync(vllm.base_url, api_key=KEY)
        (before,) = await client.complete(ids, greedy)
        await sync.push({k: v * 1.5 for k, v in weights.items()}, 1)
        changed_version = await sync.versions()
        (changed,) = await client.complete(ids, greedy)
        await sync.push(weights, 2)
        (after,) = await client.complete(ids, greedy)
        await sync.close()
        await client.close()
        return before, changed, after, changed_version, sync.last_stats

    before, changed, after, version, stats = asyncio.run(go())
    assert version == ["1"] and stats["bytes"] > 0
    assert (changed.token_ids, changed.logprobs) != (before.token_ids, before.logprobs)
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)  # bit-exact


def test_a_request_spanning_a_push_tags_each_token_with_its_version(vllm, model_dir, tokenizer, tools, tool_prompt,
                                                                     max_model_len):
    """vLLM's /inference/v1/generate reports which weight version sampled each token (no request-start guess)."""
    from agentrl.inference.client import from_generate

    ids = _prompts(tokenizer, tools, tool_prompt)[0]
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go(old: int):
        """One request whose server is paused (requests stay in flight) and given version old+1 once a streamed
        twin of it, batched in the same steps, has shown tokens.  None when the request ended before the pause."""
        sync = VLLMWeightSync(vllm.base_url, api_key=KEY)
        await sync.set_version(old)
        async with httpx.AsyncClient(base_url=vllm.root_url, headers=headers, timeout=300) as http:
            body = {"model": vllm.model, "token_ids": ids, "output_mode": "text", "sampling_params": {
                "max_tokens": max_model_len - len(ids) - 1, "temperature": 1.0, "seed": 0, "ignore_eos": True,
                "logprobs": 0, "detokenize": True}}  # fmt: skip
            request = asyncio.create_task(http.post("/inference/v1/generate", json=body))
            await asyncio.sleep(0)  # its POST goes out first
            # no fixed delay: how long a request takes depends on the host; the twin's first tokens say "decoding"
            async with http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as twin:
                assert twin.status_code == 200, (await twin.aread())[:500]
                async for line in twin.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                        break
                (await http.post("/pause", params={"mode": "keep"})).raise_for_status()  # frozen mid-generation
            if request.done():
                reply = await request
                await http.post("/resume")
                await sync.close()
                assert reply.status_code == 200, f"/inference/v1/generate: {reply.status_code} {reply.text[:500]}"
                return None
            await sync.push(weights, old + 1)  # pauses (already), reloads, resumes
            reply = await request
        await sync.close()
        assert reply.status_code == 200, f"/inference/v1/generate: {reply.status_code} {reply.text[:500]}"
        return from_generate(reply.json()["choices"][0], start_version=-1)

    # a pause before the request's first step gives every token the new version, one after its last step none:
    # both are tried again
    tried = []
    for k in range(5):
        old = 5 + 2 * k
        ch = asyncio.run(go(old))
        tried.append(None if ch is None else sorted(set(ch["token_versions"])))
        if ch is not None and set(ch["token_versions"]) == {old, old + 1}:
            break
    else:
        pytest.fail(f"no pause landed mid-request (versions per try: {tried})")
    versions = ch["token_versions"]
    assert len(versions) == len(ch["token_ids"]) == max_model_len - len(ids) - 1
    assert versions[0] == old and versions[-1] == old + 1 and versions == sorted(versions)
    assert set(versions) == {old, old + 1}


@pytest.mark.parametrize("chat", [False, True], ids=["token", "chat"])
def test_eval_on_vllm(vllm, model_dir, tmp_path, chat):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "agentrl.cli", "eval", "calc", "--model", vllm.model, "--base-url", vllm.base_url,
           "--api-key", KEY, "--tokenizer", str(model_dir), "-n", "4", "-r", "2", "-t", "24", "--out", str(out)]  # fmt: skip
    r = subprocess.run([*cmd, *(["--chat"] if chat else [])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and not [x for x in rows if x.get("error_kind") == "endpoint"]


def _run_overrides(model: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": str(run_dir), "model.path": str(model), "sft.enabled": "false", "env.name": "calc",
        "rollout.group_size": "4", "rollout.max_in_flight": "16", "rollout.max_tokens": "16", "rollout.max_turns": "2",
        "trainer.batch_groups": "2", "buffer.filter_zero_variance": "false", "trainer.checkpoint_every": "0",
        "trainer.num_threads": "1", "inference.max_batch_size": "16", "inference.max_model_len": "256",
        "inference.engine": "vllm", "eval.num_tasks": "4",
    }  # fmt: skip
    base.update({k: str(v) for k, v in extra.items()})
    return [f"--{k}={v}" for k, v in base.items()]


def test_rl_run_launches_vllm_pushes_every_version_and_tags_tokens(model_dir, tmp_path):
    """`agentrl run --inference.engine=vllm` (no base_url): 3 steps, each version pushed into vLLM."""
    run_dir = tmp_path / "run"
    cfg = load_config([], _run_overrides(model_dir, run_dir, **{"trainer.steps": 3, "eval.every": 3}))
    run_training(cfg, progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/mismatch_kl" in r]
    assert [r["step"] for r in train_rows] == [0, 1, 2]
    assert [r["engine/0/version"] for r in train_rows] == [1, 2, 3]  # vLLM's /weight_info after each push
    assert all(r["weights/push_s"] > 0 for r in train_rows)
    assert abs(train_rows[0]["train/mismatch_kl"]) < 1e-3  # step 0: μ from the same fp32 weights as π
    last = train_rows[-1]
    fates = sum(last[f"ledger/{k}"] for k in ("trained", "stale", "filtered", "errored", "interrupted", "skipped",
                                              "in_flight"))  # fmt: skip
    assert fates == last["ledger/started"] and last["ledger/errored"] == 0
    versions = [v for r in read_jsonl(run_dir / "rollouts.jsonl") for s in r["sequences"]
                for v, m in zip(s["versions"], s["loss_mask"], strict=True) if m]  # fmt: skip
    assert min(versions) == 0 and max(versions) >= 1  # tokens sampled after a push carry its version
    evals = [r for r in read_jsonl(run_dir / "eval_rollouts.jsonl")]
    assert {r["eval_version"] for r in evals} == {0, 3}


def test_external_vllm_gets_the_warm_start_pushed(vllm, model_dir, tmp_path, monkeypatch):
    """A string base_url is accepted; the run pushes the warm start into the server as version 0."""
    run_dir = tmp_path / "ext"
    overrides = _run_overrides(model_dir, run_dir, **{"trainer.steps": 1, "eval.every": 0})
    overrides += [f"--inference.base_url={vllm.base_url}", f"--inference.model_name={vllm.model}"]
    monkeypatch.setenv("AGENTRL_API_KEY", KEY)
    run_training(load_config([], overrides), progress=False)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/mismatch_kl" in r]
    assert rows[0]["engine/0/version"] == 1 and abs(rows[0]["train/mismatch_kl"]) < 1e-3


def test_a_server_that_cannot_take_a_push_is_refused_in_one_line(engine, model_dir, tmp_path, monkeypatch):
    """An 'external vLLM' without the weight routes (here: the embedded engine) stops the run before step 0."""
    monkeypatch.setenv("AGENTRL_API_KEY", engine.api_key)  # past the key check: the push is what fails
    overrides = _run_overrides(model_dir, tmp_path / "refused", **{"trainer.steps": 1, "eval.every": 0})
    overrides += [f"--inference.base_url={engine.base_url}", f"--inference.model_name={engine.model}"]
    with pytest.raises(AgentrlError, match="cannot push the warm start") as e:
        run_training(load_config([], overrides), progress=False)
    assert "\n" not in str(e.value)


def test_the_nccl_init_info_is_what_vllms_workers_parse_in_unique_id_mode():
    """vLLM's own ``NCCLWeightTransferInitInfo`` (in .venv-vllm) reads the workers' init_info as a
    unique-id rendezvous: the id the trainer minted, and no TCPStore address or port (a store any
    local process can join, whose contents the workers unpickle)."""
    from agentrl.weights.vllm import nccl_init_info

    uid = bytes(range(128))
    python = str(Path(VLLM[0]).parent / "python")
    probe = ("import base64, json, sys\n"
             "from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as E\n"
             "i = E.init_info_cls(**json.loads(sys.argv[1]))\n"
             "print(json.dumps([i.master_address, i.master_port, base64.b64encode(i.nccl_unique_id_bytes).decode(),"
             " i.rank_offset, i.world_size, i.packed]))")  # fmt: skip
    out = subprocess.run([python, "-c", probe, json.dumps(nccl_init_info(uid, 3))], capture_output=True, text=True,
                         timeout=300, check=True).stdout  # fmt: skip
    import base64

    assert json.loads(out.strip().splitlines()[-1]) == [None, None, base64.b64encode(uid).decode(), 1, 3, True]
