"""What the engine's door costs: requests/s with keys and caps on vs off, one run, alternating.

- **on**: the engine as ``agentrl serve`` and ``agentrl run`` start it (``start_embedded_engine``
  with a key): every route checks the key (constant-time), Host and Origin; bodies are capped;
  uvicorn runs agentrl's h11 protocol with header/body deadlines and a connection cap; chat
  prompts are rendered on the render threads with a deadline, text prompts length-checked first.
- **off**: the same engine assembled here without any of that (this script's ``--serve-open``):
  no :class:`agentrl.guard.Guard`, uvicorn's own protocol, no connection cap, renders inline on
  the event loop (the door as it was before the keys); the rest of the app (its routes, the
  generation routes' fast path) is the same, so ratios measured before that fast path (when
  this baseline dropped it too) do not compare with later ones.

Both are real engine processes on the same tiny model.  Each round sends a burst of short
requests (C concurrent: token-id completions and chat completions, ``max_tokens`` 2) to one,
then the other, the order alternating per round, so load from other processes on the machine
falls on both alike.  Prints a table and, last, a JSON line with ``ratio`` = on / off
requests/s over all rounds (goal >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from agentrl.inference import start_embedded_engine
from agentrl.inference.launcher import wait_for_health
from agentrl.tiny_model import build_tiny_model

KEY = "arl-benchmark-key-not-secret"


def serve_open(model_dir: str, port_file: str, max_model_len: int, batch: int) -> None:
    """The baseline server: the engine's app without the guard, plain uvicorn, renders on the loop."""
    import socket

    import uvicorn

    from agentrl.guard import Guard
    from agentrl.inference.engine import Engine
    from agentrl.inference.engine_args import EngineArgs
    from agentrl.inference.server import EngineServer, create_app

    async def inline(self, fn, *args, **kwargs):  # what the server did before: render on the event loop
        return fn(*args, **kwargs)

    EngineServer.off_loop = inline
    engine = Engine(model_dir, EngineArgs(max_batch_size=batch, max_model_len=max_model_len, device="cpu"))
    app = create_app(engine)
    # no Guard, everything else as served (the generation fast path stays); the stack is built on the first request
    app.user_middleware[:] = [m for m in app.user_middleware if m.cls is not Guard]
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    Path(port_file).write_text(json.dumps({"port": sock.getsockname()[1]}))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30)).run(sockets=[sock])


def start_open(model_dir: Path, tmp: Path, max_model_len: int, batch: int, env: dict[str, str]):
    port_file, log = tmp / "open.json", tmp / "open.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-open", str(model_dir), str(port_file), str(max_model_len), str(batch)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
        )  # fmt: skip

    def port() -> int | None:
        try:
            return json.loads(port_file.read_text())["port"]
        except (OSError, ValueError):
            return None

    return proc, wait_for_health(proc, "127.0.0.1", port, log, timeout=300, what="open engine")


async def burst(root: str, headers: dict[str, str], model: str, requests: int, concurrency: int) -> float:
    """Requests/s for ``requests`` short requests, ``concurrency`` at a time, half chat, half token ids."""
    bodies = [
        ("/v1/completions", {"model": model, "prompt": [1, 40, 41, 42, 43, 44], "max_tokens": 2, "temperature": 0}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "What is 12+30?"}],
                                  "max_tokens": 2, "temperature": 0}),
    ]  # fmt: skip
    queue = list(range(requests))
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                path, body = bodies[i % 2]
                async with http.post(root + path, json=body) as r:
                    await r.read()
                    assert r.status == 200, (r.status, await r.text())

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests / (time.perf_counter() - t0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-open":
        serve_open(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=256, help="requests per burst")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agentrl-authcost-"))
    model_dir = build_tiny_model(tmp / "tiny", layers=1, hidden=32, heads=2)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    batch, max_len = 32, 256
    open_proc, open_port = start_open(model_dir, tmp, max_len, batch, env)
    try:
        with start_embedded_engine(model_dir, max_batch_size=batch, max_model_len=max_len, device="cpu", env=env,
                                   api_key=KEY) as guarded:  # fmt: skip
            sides = {
                "on": (guarded.root_url, guarded.headers, guarded.model),
                "off": (f"http://127.0.0.1:{open_port}", {}, "tiny"),
            }
            for root, headers, model in sides.values():  # warm both (first renders, allocator)
                asyncio.run(burst(root, headers, model, 64, args.concurrency))
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(args.rounds):
                for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    root, headers, model = sides[name]
                    rates[name].append(asyncio.run(burst(root, headers, model, args.requests, args.concurrency)))
    finally:
        open_proc.terminate()
        open_proc.wait(timeout=30)

    print(f"{'round':>6}{'on req/s':>12}{'off req/s':>12}{'on/off':>10}")
    for i, (on, off) in enumerate(zip(rates["on"], rates["off"], strict=True)):
        print(f"{i:>6}{on:>12.1f}{off:>12.1f}{on / off:>10.3f}")
    mean_on, mean_off = statistics.fmean(rates["on"]), statistics.fmean(rates["off"])
    ratio = mean_on / mean_off
    print(f"{'mean':>6}{mean_on:>12.1f}{mean_off:>12.1f}{ratio:>10.3f}   (goal >= 0.95)")
    print(json.dumps({
        "bench": "engine_auth_cost", "rounds": args.rounds, "requests": args.requests,
        "concurrency": args.concurrency, "on_req_s": round(mean_on, 1), "off_req_s": round(mean_off, 1),
        "ratio": round(ratio, 3), "per_round_ratio": [round(a / b, 3) for a, b in zip(rates["on"], rates["off"], strict=True)],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
