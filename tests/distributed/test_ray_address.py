"""`cluster.ray_address` joins a cluster started apart with `ray start --head` (its own temp
dir and ports), runs engines and rollout workers there, and leaves it running."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from testkit import free_ports

ray = pytest.importorskip("ray")


pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


def _up(address: str) -> bool:
    return subprocess.run([RAY, "status", "--address", address], capture_output=True, timeout=60).returncode == 0


@pytest.fixture
def head_node():
    """`ray start --head --num-cpus 2 --block` on free ports with a short temp dir, in its own
    process group: teardown ends that group only (never `ray stop`, which ends every Ray on the machine)."""
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    port, *others = free_ports(8)  # distinct: eight free_port() calls in a row repeat one ~1 time in 700
    ports = {f"--{k}": str(p) for k, p in zip((
        "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port"), others, strict=True)}  # fmt: skip
    cmd = [RAY, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port), "--temp-dir", temp_dir,
           "--include-dashboard", "false", "--disable-usage-stats", *[x for kv in ports.items() for x in kv]]  # fmt: skip
    log = open(Path(temp_dir) / "head.log", "w")  # noqa: SIM115 (closed in teardown)
    # no token auth on this throwaway head (Ray 2.x `ray start` enables it; the driver would need the token)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _up(address):
            assert head.poll() is None, f"ray start exited: {(Path(temp_dir) / 'head.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the Ray head did not come up within 180s"
            time.sleep(1)
        yield address, Path(temp_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGTERM)  # ray start --block stops what it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # anything of ours still in the group
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_agentrl_run_joins_an_existing_cluster(tmp_path, head_node, small_model):
    """Catches: ray_address ignored (a private local cluster started instead: no actor logs under
    the head's temp dir), workers that never deliver on the joined cluster, the driver left
    or the joined cluster shut down by the run (it belongs to whoever started it)."""
    from agentrl.config import load_config
    from agentrl.metrics import read_jsonl
    from agentrl.recipes.rl import train as run_training

    address, temp_dir = head_node
    model = small_model
    run_dir = tmp_path / "run"
    over = {
        "run.dir": run_dir, "model.path": model, "sft.enabled": "false", "env.name": "calc",
        "cluster.backend": "ray", "cluster.ray_address": address, "cluster.num_inference": 2,
        "cluster.engine_cpus": 0.25, "cluster.rollout_workers": 2, "cluster.worker_cpus": 0.25,
        "rollout.group_size": 4, "rollout.max_in_flight": 16, "rollout.max_tokens": 16, "rollout.max_turns": 2,
        "trainer.batch_groups": 2, "trainer.steps": 8, "buffer.filter_zero_variance": "false",
        "eval.every": 0, "trainer.checkpoint_every": 0, "inference.max_batch_size": 16, "trainer.num_threads": 1,
    }  # fmt: skip
    try:
        run_training(load_config([], [f"--{k}={v}" for k, v in over.items()]), progress=False)
    finally:
        ray.shutdown()  # a joined cluster is not the run's to shut down: the driver stays connected
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    # 8 steps: a worker whose actor starts late still delivers (in 3 steps the other could fill them all)
    assert last["step"] == 7 and last["ledger/trained"] == 8 * 2 * 4
    assert last["rollout/groups/w0"] > 0 and last["rollout/groups/w1"] > 0
    # the actors ran on the joined cluster: their logs are under its temp dir
    logs = "".join(p.read_text(errors="ignore") for p in (temp_dir / "session_latest" / "logs").glob("worker-*"))
    assert "RolloutWorkerImpl" in logs and "InferenceActor" in logs
    # and the cluster is still up for its owner
    assert _up(address)
