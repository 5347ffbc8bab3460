"""trainer.device, inference.device and `agentrl serve --device`: a name torch cannot use, or a
CUDA GPU this host lacks, is one line naming the setting and exit code 2, never a traceback
(`--trainer.device=gpu` was torch's RuntimeError after the engine had started; `cuda` on a
CPU-only host was "Torch not compiled with CUDA enabled", or the engine child's whole traceback)."""

from __future__ import annotations

import pytest
import torch
from agentrl_cli import agentrl

from agentrl.config import load_config
from agentrl.errors import AgentrlError, ConfigError, EngineStartError
from agentrl.inference import requests
from agentrl.trainer import trainer

BAD = ["gpu", "cuda0", "cuda:", "cuda:-1", "cuda:x", "CPU", "cpu:0", " cuda", "mps"]
GOOD = ["auto", "cpu", "cuda", "cuda:0", "cuda:7"]
SETTINGS = ["trainer.device", "inference.device"]
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU")


@pytest.fixture
def no_cuda(monkeypatch):
    """torch sees no CUDA GPU (as on a CPU-only host), on any host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def one_line_exit_2(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", BAD)
def test_config_refuses_a_name_that_is_not_a_device(setting, name):
    with pytest.raises(ConfigError) as e:
        load_config([], [f"--{setting}={name}"])
    msg = str(e.value)
    assert f"{setting}: not a device; use auto, cpu, cuda or cuda:N (got {name!r})" in msg, msg


@pytest.mark.parametrize("setting", SETTINGS)
def test_config_takes_the_device_names_and_only_them(setting):
    section, key = setting.split(".")
    for name in GOOD:  # a name only: whether this host has the GPU is checked where it runs (check_device)
        assert getattr(getattr(load_config([], [f"--{setting}={name}"]), section), key) == name
    for name in BAD:
        with pytest.raises(ConfigError, match=f"^{setting}: not a device"):
            load_config([], [f"--{setting}={name}"])


@pytest.mark.parametrize("setting", SETTINGS)
def test_dry_run_refuses_a_bad_device_in_one_line(tmp_path, setting):
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    line = one_line_exit_2(agentrl("run", cfg, "--dry-run", f"--{setting}=gpu"))
    assert f"{setting}: not a device; use auto, cpu, cuda or cuda:N (got 'gpu')" in line, line


@no_gpu_here
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_serve_on_a_cpu_only_host_refuses_cuda_in_one_line(small_model, device):
    line = one_line_exit_2(agentrl("serve", small_model, "--device", device, "--port", "0", timeout=120))
    assert f"--device = {device!r}, but torch sees no CUDA GPU on this host" in line, line
    assert "use --device = 'auto' or 'cpu'" in line, line


def test_serve_refuses_a_bad_device_name_in_one_line(small_model):
    line = one_line_exit_2(agentrl("serve", small_model, "--device", "gpu", "--port", "0", timeout=120))
    assert "--device: 'gpu' is not a device; use auto, cpu, cuda or cuda:N" in line, line


RESOLVERS = [(requests.resolve_device, "inference.device"), (trainer.resolve_device, "trainer.device")]


@pytest.mark.parametrize(("resolve", "setting"), RESOLVERS, ids=["engine", "trainer"])
@pytest.mark.parametrize("name", ["gpu", "cuda0", "cuda:x"])
def test_resolve_device_refuses_a_name_that_is_not_a_device(resolve, setting, name):
    with pytest.raises(AgentrlError, match=f"^{setting}: {name!r} is not a device; use auto, cpu, cuda or cuda:N$"):
        resolve(name)


@pytest.mark.parametrize(("resolve", "setting"), RESOLVERS, ids=["engine", "trainer"])
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_refuses_cuda_where_torch_sees_no_gpu(resolve, setting, name, no_cuda):
    with pytest.raises(AgentrlError) as e:
        resolve(name)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{setting} = {name!r}, but torch sees no CUDA GPU on this host (torch {torch.__version__}, "), msg
    assert msg.endswith(f"use {setting} = 'auto' or 'cpu'"), msg
    assert resolve("cpu") == resolve("auto") == torch.device("cpu")  # what the message offers works


@pytest.mark.parametrize(("resolve", "setting"), RESOLVERS, ids=["engine", "trainer"])
def test_resolve_device_refuses_a_gpu_index_past_the_hosts(resolve, setting, one_gpu):
    with pytest.raises(AgentrlError, match=rf"^{setting} = 'cuda:1', but torch sees 1 CUDA GPU\(s\) on this host"):
        resolve("cuda:1")


def test_the_engine_refuses_a_device_as_a_start_error(no_cuda):
    """The engine's server prints an EngineStartError as its one-line refused start (which the launcher
    reports as is), so a refused device must be one."""
    for name in ("gpu", "cuda"):
        with pytest.raises(EngineStartError):
            requests.resolve_device(name)


@pytest.mark.parametrize("setting", SETTINGS)
def test_check_device_names_the_setting(setting, no_cuda):
    from agentrl.config import check_device

    with pytest.raises(ConfigError, match=f"^{setting}: 'gpu' is not a device; use auto, cpu, cuda or cuda:N$"):
        check_device("gpu", setting)
    with pytest.raises(ConfigError, match=f"^{setting} = 'cuda', but torch sees no CUDA GPU on this host .*"
                                          f"use {setting} = 'auto' or 'cpu'$"):
        check_device("cuda", setting)
    check_device("cpu", setting)
    check_device("auto", setting)


def test_check_devices_checks_what_runs_here(no_cuda):
    from agentrl.config import check_devices

    with pytest.raises(ConfigError, match="^trainer.device = 'cuda'"):
        check_devices(load_config([], ["--trainer.device=cuda"]))
    with pytest.raises(ConfigError, match="^inference.device = 'cuda:0'"):
        check_devices(load_config([], ["--inference.device=cuda:0"]))
    check_devices(load_config([], ["--inference.device=cuda", "--inference.base_url=http://127.0.0.1:1/v1"]))
    check_devices(load_config([], []))


@no_gpu_here
def test_an_engine_child_refuses_cuda_in_one_line(small_model):
    """`agentrl run --inference.device=cuda` on a CPU-only host printed the engine child's traceback."""
    from agentrl.inference.launcher import start_embedded_engine

    with pytest.raises(EngineStartError) as e:
        start_embedded_engine(small_model, device="cuda", startup_timeout=120)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert msg.startswith("inference.device = 'cuda', but torch sees no CUDA GPU on this host"), msg
