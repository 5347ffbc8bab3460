"""Orchestrator CPU cost per model call: the rollout manager driving a 3-turn tool env.

A stand-in OpenAI-compatible endpoint runs in a *separate process* (so its CPU is not
counted): ``/v1/completions`` answers every token-id prompt after a fixed latency
(default 20 ms) — a tool call on turns 1–2, a final answer on turn 3 — with token ids,
logprobs and versions like the embedded engine; ``/tokenize`` renders the tiny model's
real chat template.  The orchestrator is the real stack: RolloutManager → ToolEnv
(token-exact multi-turn loop, tool-call parsing, a Python tool) → PolicyClient → rubric
scoring → StalenessBuffer.  ``--render local`` (the default, as in ``agentrl run``)
renders chat prompts in the orchestrator with the model's tokenizer; ``--render server``
asks the endpoint's ``/tokenize`` instead (what a client without a tokenizer does).

``--path chat`` drives the chat path instead (``agentrl eval --chat``): episodes run through
``/v1/chat/completions``, which answers like vLLM with a tool-call parser (tool calls split
out, token ids, per-token logprobs, ``usage``).  It measures two clients in the same run:
``PolicyClient.chat`` (raw JSON over aiohttp, hosted-API-safe) and, as the baseline, the
same requests built and read through the ``openai`` SDK, as the chat path did before
(``SDKChatClient`` below); the ratio is baseline / new.

Prints episodes/s, CPU-ms of the orchestrator process per model call (and per HTTP
request, tokenize included), and the latency-bound ideal (every episode needs 3
sequential calls of ``latency``, ``concurrency`` at a time).  Last line: JSON.

    python benchmarks/rollout_overhead.py [--episodes 1024 --concurrency 256 --latency-ms 20]
    python benchmarks/rollout_overhead.py --path chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

# ----------------------------------------------------------------------------- stand-in endpoint


CHAT_CALLS = [{"name": "add", "arguments": '{"a": 12, "b": 30}'}, {"name": "add", "arguments": '{"a": 42, "b": 8}'}]


def chat_reply(req: dict, reply_ids: list[list[int]], replies: list[str]) -> dict:
    """vLLM with a tool-call parser: calls split out; token ids, logprobs, usage."""
    turn = min(sum(1 for m in req["messages"] if m["role"] == "tool"), 2)
    ids = reply_ids[turn]
    if turn < 2:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{turn}", "type": "function", "function": CHAT_CALLS[turn]}]}  # fmt: skip
        finish = "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": replies[2]}, "stop"
    prompt_ids = list(range(40 * len(req["messages"])))
    choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": ids,
              "token_versions": [0] * len(ids)}
    if req.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": "x", "logprob": -0.1, "bytes": [120], "top_logprobs": []}
                                          for _ in ids]}
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": req.get("model", "m"),
            "choices": [choice], "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)}}  # fmt: skip


def serve(port: int, latency_s: float) -> None:
    """A minimal ASGI OpenAI stand-in (runs in its own process)."""
    import uvicorn

    from agentrl.tiny_model import build_tokenizer

    tok = build_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tool_open = tok.convert_tokens_to_ids("<|im_start|>")
    replies = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 8}}\n</tool_call>',
        "The answer is 50",
    ]
    reply_ids = [tok.encode(r, add_special_tokens=False) + [im_end] for r in replies]
    tool_header = tok.encode("tool\n", add_special_tokens=False)
    counts = {"completions": 0, "tokenize": 0}

    def turn_of(prompt_ids: list[int]) -> int:
        # number of tool messages so far = occurrences of "<|im_start|>tool\n"
        n, k = 0, len(tool_header)
        for i, t in enumerate(prompt_ids):
            if t == tool_open and prompt_ids[i + 1 : i + 1 + k] == tool_header:
                n += 1
        return min(n, 2)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        req = json.loads(body) if body else {}
        if path.endswith("/chat/completions"):
            counts["completions"] += 1
            await asyncio.sleep(latency_s)
            out = chat_reply(req, reply_ids, replies)
        elif path.endswith("/completions"):
            counts["completions"] += 1
            await asyncio.sleep(latency_s)
            ids = reply_ids[turn_of(req["prompt"])]
            text = tok.decode(ids, skip_special_tokens=True)
            out = {
                "id": "cmpl-x", "object": "text_completion", "created": 0, "model": req.get("model", "m"),
                "choices": [{
                    "index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
                    "token_versions": [0] * len(ids),
                    "logprobs": {"token_logprobs": [-0.1] * len(ids), "tokens": [], "top_logprobs": None,
                                 "text_offset": []},
                }],
                "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": len(ids),
                          "total_tokens": len(req["prompt"]) + len(ids)},
            }  # fmt: skip
        elif path == "/tokenize":
            counts["tokenize"] += 1
            ids = tok.apply_chat_template(
                req["messages"], tools=req.get("tools"), add_generation_prompt=req.get("add_generation_prompt", True),
                tokenize=True, return_dict=False,
            )
            out = {"tokens": list(ids), "count": len(ids)}
        elif path == "/stats":
            out = counts
        else:
            out = {"status": "ok"}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096)


# ----------------------------------------------------------------------------- orchestrator side


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def answer_is_50(completion) -> float:
    return float("50" in str(completion))


async def drive(base_url: str, episodes: int, concurrency: int, group_size: int, render: str) -> dict[str, float]:
    from agentrl.buffer import StalenessBuffer
    from agentrl.envs import ToolEnv
    from agentrl.inference.client import PolicyClient
    from agentrl.rollout import RolloutManager, TaskSampler
    from agentrl.rubrics import Rubric
    from agentrl.types import SamplingParams

    env = ToolEnv(
        tools=[add], dataset=[f"What is 12+30+8? (#{i})" for i in range(episodes // group_size)],
        rubric=Rubric([answer_is_50]), max_turns=3, show_tools=True,
    )
    from agentrl.tiny_model import build_tokenizer

    tokenizer = build_tokenizer() if render == "local" else None
    client = PolicyClient(base_url, "stand-in", max_retries=0, tokenizer=tokenizer)
    n_groups = episodes // group_size
    buffer = StalenessBuffer(batch_groups=n_groups, max_staleness=0, filter_zero_variance=False)
    errors: list[str] = []

    def keep_error(t) -> None:
        if t.error and len(errors) < 3:
            errors.append(t.error)

    manager = RolloutManager(
        env, client, buffer, TaskSampler(list(env.dataset()), seed=0), SamplingParams(max_tokens=64),
        group_size=group_size, max_in_flight=concurrency, episode_timeout_s=600,
        on_trajectory=keep_error,
    )
    cpu0, t0 = time.process_time(), time.perf_counter()
    runner = asyncio.create_task(manager.run())
    while buffer.ready_groups + (buffer.ledger.filtered + buffer.ledger.errored) // group_size < n_groups:
        await buffer.wait_change()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    manager.stop()
    await runner
    calls = sum(e.calls for e in client.endpoints)
    await client.close()
    trajs = [t for g in buffer._ready for t in g.trajectories]
    return {
        "wall_s": wall, "cpu_s": cpu, "calls": calls, "errored": buffer.ledger.errored, "errors": errors,
        "reward_mean": sum(t.reward for t in trajs) / max(1, len(trajs)),
        "template_breaks": sum(t.metrics.get("template_breaks", 0) for t in trajs),
    }


def sdk_chat_client(base_url: str):
    """The baseline: a PolicyClient whose ``chat`` builds and reads requests through the
    ``openai`` SDK (what the chat path did before it spoke raw JSON), same fields sent."""
    import openai

    from agentrl.inference.client import PolicyClient
    from agentrl.types import Completion, ToolCall

    class SDKChatClient(PolicyClient):
        async def chat(self, messages, sampling, tools=None, n=1, *, _prefer=None):
            ep = self.endpoints[0]
            sdk = getattr(ep, "_sdk", None) or openai.AsyncOpenAI(base_url=ep.root + "/v1", api_key="x", max_retries=0)
            ep._sdk = sdk
            extra = {"top_k": -1, "min_p": sampling.min_p, "return_token_ids": True, "skip_special_tokens": True}
            body = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                    "n": n, **({"tools": tools} if tools else {})}

            async def go(ep):
                return await sdk.chat.completions.create(model=self.model, messages=messages, logprobs=True,
                                                         extra_body=extra, **body)

            resp = await self._call(go, "chat completion", _prefer)
            usage, out = resp.usage, []
            for ch in sorted(resp.choices, key=lambda c: c.index):
                ids = list(getattr(ch, "token_ids", None) or [])
                lps = [float(c.logprob) for c in (ch.logprobs.content if ch.logprobs and ch.logprobs.content else [])]
                calls = [ToolCall(name=tc.function.name, arguments=tc.function.arguments or "{}", id=tc.id)
                         for tc in (ch.message.tool_calls or [])]
                out.append(Completion(
                    text=ch.message.content or "", token_ids=ids, logprobs=lps, versions=[0] * len(ids),
                    finish_reason=ch.finish_reason, tool_calls=calls,
                    prompt_token_ids=list(getattr(resp, "prompt_token_ids", None) or []),
                    prompt_tokens=usage.prompt_tokens, completion_tokens=len(ids) or usage.completion_tokens,
                ))  # fmt: skip
            return out

        async def close(self):
            for ep in self.endpoints:
                if getattr(ep, "_sdk", None) is not None:
                    await ep._sdk.close()
            await super().close()

    return SDKChatClient(base_url, "stand-in", max_retries=0)


async def drive_chat(base_url: str, episodes: int, concurrency: int, group_size: int, client_kind: str) -> dict:
    """``episodes`` chat-path episodes (``agentrl eval --chat``'s loop), ``concurrency`` in flight."""
    from agentrl.envs import ToolEnv
    from agentrl.inference.client import PolicyClient
    from agentrl.rollout import run_group
    from agentrl.rubrics import Rubric
    from agentrl.types import SamplingParams

    env = ToolEnv(
        tools=[add], dataset=[f"What is 12+30+8? (#{i})" for i in range(episodes // group_size)],
        rubric=Rubric([answer_is_50]), max_turns=3, show_tools=True,
    )
    client = sdk_chat_client(base_url) if client_kind == "sdk" else PolicyClient(base_url, "stand-in", max_retries=0)
    gate = asyncio.Semaphore(max(1, concurrency // group_size))
    sampling = SamplingParams(max_tokens=64)

    async def group(task):
        async with gate:
            return await run_group(env, client, task, sampling, group_size, token_exact=False)

    if client_kind != "sdk":
        await client.probe(token_path=False)  # what agentrl eval --chat does once, before the episodes
    cpu0, t0 = time.process_time(), time.perf_counter()
    groups = await asyncio.gather(*(group(t) for t in env.dataset()))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    calls = sum(e.calls for e in client.endpoints)
    await client.close()
    trajs = [t for g in groups for t in g]
    errors = [t.error for t in trajs if t.error][:3]
    return {"wall_s": wall, "cpu_s": cpu, "calls": calls, "errored": sum(1 for t in trajs if t.error), "errors": errors,
            "reward_mean": sum(t.reward for t in trajs) / max(1, len(trajs)), "template_breaks": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report_token(args, r: dict, served: dict) -> dict:
    # model calls as the server counted them: the client's endpoint counter also counts /tokenize
    calls = served["completions"] or r["calls"]
    requests = calls + served["tokenize"]
    ideal_eps = args.concurrency / (3 * args.latency_ms / 1000)
    out = {
        "benchmark": "rollout_overhead", "path": "token", "episodes": args.episodes, "concurrency": args.concurrency,
        "latency_ms": args.latency_ms, "render": args.render,
        "episodes_per_s": args.episodes / r["wall_s"], "ideal_episodes_per_s": ideal_eps,
        "ratio_to_ideal": (args.episodes / r["wall_s"]) / ideal_eps, "model_calls": calls,
        "cpu_ms_per_call": 1000 * r["cpu_s"] / calls, "cpu_ms_per_http_request": 1000 * r["cpu_s"] / requests,
        "tokenize_per_call": served["tokenize"] / max(1, served["completions"]),
        "errored": r["errored"], "reward_mean": r["reward_mean"], "cores": os.cpu_count(),
    }  # fmt: skip
    print(f"rollout overhead: {args.episodes} episodes x 3 turns, concurrency {args.concurrency}, "
          f"stand-in latency {args.latency_ms:g} ms (separate process), prompts rendered "
          f"{'in the orchestrator' if args.render == 'local' else 'by the server (/tokenize)'}")
    print(f"  episodes/s           {out['episodes_per_s']:8.1f}   (latency-bound ideal {ideal_eps:.0f}, "
          f"ratio {out['ratio_to_ideal']:.2f})")
    print(f"  CPU-ms per model call {out['cpu_ms_per_call']:7.2f}   (goal <= 1.5; includes "
          f"{out['tokenize_per_call']:.1f} /tokenize requests per call)")
    print(f"  CPU-ms per HTTP request {out['cpu_ms_per_http_request']:5.2f}")
    print(f"  errored episodes {r['errored']}, reward {r['reward_mean']:.2f}  {r['errors'][:1]}")
    return out


def report_chat(args, new: dict, sdk: dict) -> dict:
    ideal_eps = args.concurrency / (3 * args.latency_ms / 1000)
    ms_new, ms_sdk = 1000 * new["cpu_s"] / new["calls"], 1000 * sdk["cpu_s"] / sdk["calls"]
    out = {
        "benchmark": "rollout_overhead", "path": "chat", "episodes": args.episodes, "concurrency": args.concurrency,
        "latency_ms": args.latency_ms, "model_calls": new["calls"],
        "episodes_per_s": args.episodes / new["wall_s"], "sdk_episodes_per_s": args.episodes / sdk["wall_s"],
        "ideal_episodes_per_s": ideal_eps, "cpu_ms_per_call": ms_new, "sdk_cpu_ms_per_call": ms_sdk,
        "sdk_over_new": ms_sdk / ms_new, "errored": new["errored"] + sdk["errored"],
        "reward_mean": new["reward_mean"], "cores": os.cpu_count(),
    }  # fmt: skip
    print(f"rollout overhead, chat path: {args.episodes} episodes x 3 turns, concurrency {args.concurrency}, "
          f"stand-in latency {args.latency_ms:g} ms (separate process, vLLM-like replies)")
    print(f"  {'client':<28}{'CPU-ms/call':>12}{'episodes/s':>12}")
    print(f"  {'PolicyClient.chat (raw JSON)':<28}{ms_new:12.2f}{out['episodes_per_s']:12.1f}")
    print(f"  {'openai SDK (baseline)':<28}{ms_sdk:12.2f}{out['sdk_episodes_per_s']:12.1f}")
    print(f"  baseline / new: {out['sdk_over_new']:.2f}x less CPU per call (goal <= 1.5 CPU-ms per call)")
    print(f"  errored episodes {out['errored']}, reward {new['reward_mean']:.2f}  {(new['errors'] + sdk['errors'])[:1]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--path", choices=["token", "chat"], default="token",
                   help="token: /v1/completions with token ids (agentrl run); chat: /v1/chat/completions (eval --chat)")
    p.add_argument("--render", choices=["local", "server"], default="local",
                   help="token path: where chat prompts become token ids (local = agentrl run's default)")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.latency_ms / 1000)
        return

    import urllib.request

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--latency-ms", str(args.latency_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}/v1"
        if args.path == "chat":
            for kind in ("new", "sdk"):  # warm-up: imports, connections, caches
                asyncio.run(drive_chat(base, 64, 64, args.group_size, kind))
            new = asyncio.run(drive_chat(base, args.episodes, args.concurrency, args.group_size, "new"))
            sdk = asyncio.run(drive_chat(base, args.episodes, args.concurrency, args.group_size, "sdk"))
        else:
            asyncio.run(drive(base, 64, 64, args.group_size, args.render))  # warm-up: imports, connections, caches
            r = asyncio.run(drive(base, args.episodes, args.concurrency, args.group_size, args.render))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats") as resp:
            served = json.loads(resp.read())
    finally:
        server.terminate()
        server.wait()
    out = report_chat(args, new, sdk) if args.path == "chat" else report_token(args, r, served)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
