"""Device names (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and whether this host has them.

One place for the engine (``inference.device``), the trainer (``trainer.device``), the config
checks and ``agentrl serve``: a typo or a GPU the host lacks is one line naming the setting,
before anything loads, never torch's traceback.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    import torch

NAMES = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
USE = "use auto, cpu, cuda or cuda:N"


def cuda_problem(device: str, setting: str = "device") -> str | None:
    """Why ``device`` (``cuda`` or ``cuda:N``; None for any other name) cannot run on this host,
    in one line naming ``setting``: torch sees no CUDA GPU (built without CUDA, or no driver or
    GPU visible), or fewer GPUs than ``N + 1``."""
    if not device.startswith("cuda"):
        return None
    import torch  # only for a cuda name: the config checks stay light
    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            why = "built without CUDA"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "no NVIDIA driver or GPU visible" + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
        return (f"{setting} = {device!r}, but torch sees no CUDA GPU on this host (torch {torch.__version__}, {why}); "
                f"use {setting} = 'auto' or 'cpu'")  # fmt: skip
    count = torch.cuda.device_count()
    index = device.partition(":")[2]
    if index and int(index) >= count:
        return (f"{setting} = {device!r}, but torch sees {count} CUDA GPU(s) on this host; use cuda:0 .. "
                f"cuda:{count - 1}, cuda, auto or cpu")  # fmt: skip
    return None


def resolve_device(name: str, error: type[AgentrlError] = AgentrlError, setting: str = "device") -> torch.device:
    """The torch device ``name`` means here (``auto``: the GPU if torch sees one, else the CPU);
    raises ``error`` (one line) for a name that is not a device or a CUDA device this host lacks."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not NAMES.fullmatch(name):
        raise error(f"{setting}: {name!r} is not a device; {USE}")
    if problem := cuda_problem(name, setting):
        raise error(problem)
    return torch.device(name)
