"""Ray backend: real local Ray cluster, real embedded engines as actors, real HTTP."""

import asyncio
import os
from urllib.parse import urlparse

import httpx
import pytest

ray = pytest.importorskip("ray")

from agentrl.distributed.ray_backend import start_inference_actors  # noqa: E402
from agentrl.inference import PolicyClient  # noqa: E402
from agentrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _listening_on(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


def test_engines_as_ray_actors_serve_and_stop(tmp_path, small_model):
    """Multi-node mode: each engine listens on its node's cluster address (never every interface,
    where any network=True sandbox reaches it) and requires the pool's key."""
    model = small_model
    pool = start_inference_actors(model, num_engines=2, num_cpus_per_engine=0.5, max_batch_size=8, max_model_len=128,
                                  local_only=False)
    try:
        assert len(set(pool.base_urls)) == 2
        assert all(_alive(p) for p in pool.engine_pids)
        node_ip = ray.util.get_node_ip_address()
        for url in pool.base_urls:
            parts = urlparse(url)
            assert parts.hostname == node_ip
            bound = _listening_on(parts.port)
            assert bound and not bound & {"00000000", "00000000000000000000000000000000"}, bound  # not 0.0.0.0 / ::
            root = url.removesuffix("/v1")
            assert httpx.post(root + "/pause", timeout=30).status_code == 401
            assert httpx.post(root + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                              timeout=30).status_code == 401  # fmt: skip
            assert httpx.get(root + "/is_paused", headers={"Authorization": f"Bearer {pool.api_key}"},
                             timeout=30).json() == {"is_paused": False}  # fmt: skip

        async def sample() -> list[list[int]]:
            client = PolicyClient(pool.base_urls, model.name, api_key=pool.api_key)
            try:
                ids = await client.tokenize(prompt="hello")
                outs = await asyncio.gather(
                    *[client.complete(ids, SamplingParams(max_tokens=4, seed=i)) for i in range(8)]
                )
                return [o[0].token_ids for o in outs]
            finally:
                await client.close()

        outs = asyncio.run(sample())
        assert len(outs) == 8 and all(1 <= len(t) <= 4 for t in outs)
    finally:
        pids = list(pool.engine_pids)
        pool.stop()
    assert not ray.is_initialized()
    # the engines are child processes of the actors: stopping the pool ends them
    for _ in range(100):
        if not any(_alive(p) for p in pids):
            break
        import time

        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_agentrl_run_with_ray_backend_trains_across_two_engines(tmp_path, small_model):
    """`[cluster] backend = "ray"`: the same run, engines placed by Ray, load-balanced, pushed to."""
    from agentrl.config import load_config
    from agentrl.metrics import read_jsonl
    from agentrl.recipes.rl import train as run_training

    model = small_model
    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.num_inference": 2,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 3, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 0, "inference.max_batch_size": 16,
    }  # fmt: skip
    run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["ledger/trained"] == 3 * 2 * 4
    # weights were pushed to the engines: later episodes carry later versions
    versions = {v for r in read_jsonl(run_dir / "rollouts.jsonl") for s in r["sequences"] for v in s["versions"] if v >= 0}
    assert max(versions) >= 1
    assert not ray.is_initialized()  # the run shut down the cluster it started


def test_killed_engine_actor_is_restarted_and_the_run_completes(tmp_path, small_model):
    """Kill engine actor 0 mid-run: Ray restarts it, the supervisor finds it at its new address,
    pushes the current weights, and the run finishes with every episode accounted for.

    Catches: a dead engine that is never brought back (the run stalls: admission waits for it),
    a restarted engine left on the base weights or at its old address (versions differ at the end,
    or it serves no traffic after), lost episodes (the ledger does not add up), restarts not
    counted in engine/restarts."""
    import threading
    import time

    from agentrl.config import load_config
    from agentrl.distributed.ray_backend import engine_actor_name
    from agentrl.metrics import read_jsonl
    from agentrl.recipes.rl import train as run_training

    model = small_model
    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.num_inference": 2, "cluster.engine_cpus": 0.25,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 6, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 0, "inference.max_batch_size": 16, "trainer.num_threads": 1,
    }  # fmt: skip
    killed: dict[str, float] = {}

    def kill_after_first_step() -> None:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.1)
        ray.kill(ray.get_actor(engine_actor_name(0)), no_restart=False)  # Ray restarts it
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    killer.join(timeout=5)
    assert "at" in killed, "the run ended before the engine could be killed"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = rows[-1]
    assert [r["step"] for r in rows] == list(range(6))
    assert last["engine/restarts"] >= 1
    fates = sum(last[f"ledger/{f}"] for f in ("trained", "stale", "filtered", "errored", "interrupted", "skipped"))
    assert last["ledger/started"] == fates + last["ledger/in_flight"]
    assert last["ledger/trained"] == 6 * 2 * 4
    # the restarted engine rejoined: same version as the other, and it served requests after
    assert last["engine/0/version"] == last["engine/1/version"] == 6
    assert last["engine/0/requests"] > 0 and last["engine/1/requests"] > 0
    assert not ray.is_initialized()


def test_a_local_cluster_keeps_its_sockets_logs_and_token_private(tmp_path):
    """Left to itself Ray makes /tmp/ray and the session's sockets and logs 0777 (any local user
    could swap a socket or read the logs) and writes ~/.ray/auth_token with the umask's mode;
    the cluster a run starts lives in a 0700 directory of its own, and its token is 0600.  In a
    child with a home of its own: Ray keeps its token mode and token per process."""
    import json
    import subprocess
    import sys

    child = """
import json, os, ray
from pathlib import Path
from agentrl.auth import key_files
from agentrl.distributed.ray_backend import ensure_ray, shutdown_ray
os.umask(0o022)
assert ensure_ray(None)
session = ray._private.worker._global_node.get_session_dir_path()
chain = [session, *map(str, Path(session).parents)]
private = [p for p in chain if os.stat(p).st_mode & 0o077 == 0 and os.stat(p).st_uid == os.getuid()]
token = Path.home() / ".ray" / "auth_token"
seen = {"session": session, "private": private, "token_mode": oct(os.stat(token).st_mode & 0o777),
        "ray_dir_mode": oct(os.stat(token.parent).st_mode & 0o777), "token_len": len(token.read_text()),
        "masked": token.resolve() in key_files()[0], "auth_mode": os.environ.get("RAY_AUTH_MODE")}
shutdown_ray()
seen["top_left"] = bool(private) and os.path.exists(private[0])
print(json.dumps(seen))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["private"], f"every directory above {seen['session']} is open to other users"
    assert (seen["token_mode"], seen["ray_dir_mode"], seen["token_len"]) == ("0o600", "0o700", 64), seen
    assert seen["masked"] and seen["auth_mode"] == "token", seen  # masked for harness programs
    assert not seen["top_left"], seen  # the cluster's directory goes with it
