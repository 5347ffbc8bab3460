"""A sharded rank's model without the whole model: built on the meta device, each rank reads only its own shards.

A rank of the sharded trainer (:mod:`agentrl.trainer.sharded`) never holds the whole model:

1. :func:`skeleton` builds the model from its config on the meta device (shapes, no storage) and
   checks that the checkpoint's safetensors files name every parameter and persistent buffer
   (a tied weight under any of its names);
2. the rank wraps LoRA adapters around it and shards it with FSDP2 (still no storage);
3. :func:`materialise` allocates only this rank's shards (``to_empty``) and fills each from the
   safetensors files, reading just its own rows of dim 0 with plain reads of at most
   ``CHUNK_BYTES`` (no mapping of the file, whose pages would count in the rank's memory), converted
   to float32 whatever the file's dtype; LoRA factors come from :func:`agentrl.trainer.trainer.adapter_start` (the
   same start as one process, sliced); non-persistent buffers (rotary ``inv_freq``, ...) are
   recomputed by the model's own ``_init_weights``, as ``from_pretrained`` does, and a buffer left
   unset is an error, never garbage.

No collective runs here: every rank reads the files on its own.  A checkpoint this cannot read
(no safetensors, or names that need transformers' key conversions) returns None from
:func:`skeleton`, and the rank loads the whole model as before, then shards it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrl.errors import AgentrlError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CHUNK_BYTES = 4 << 20  # a rank reads at most this much of a file at once (then converts it into its shard)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}  # fmt: skip


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes are in a safetensors file (little-endian, row-major)."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


def weight_files(model_dir: str | Path) -> dict[str, Stored] | None:
    """Checkpoint key → where it is stored, or None where the weights are not (only) safetensors of known dtypes."""
    d = Path(model_dir)
    if (d / INDEX).is_file():
        paths = sorted({d / f for f in json.loads((d / INDEX).read_text())["weight_map"].values()})
    elif (d / SINGLE).is_file():
        paths = [d / SINGLE]
    else:
        return None
    out: dict[str, Stored] = {}
    for path in paths:
        with open(path, "rb") as f:  # the safetensors layout: u64 header size, JSON header, then the data
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                return None
            out[key] = Stored(path, DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + size + entry["data_offsets"][0])
    return out


def file_key(name: str) -> str:
    """A parameter's checkpoint key: peft's prefix and ``base_layer`` dropped."""
    name = name.replace(".base_layer.", ".")
    prefix = "base_model.model."
    return name[len(prefix):] if name.startswith(prefix) else name


def skeleton(model_dir: str | Path) -> tuple[torch.nn.Module, dict[str, Stored]] | None:
    """(the model on the meta device, key → file), or None where the files do not name every tensor it holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    files = weight_files(model_dir)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if _sources(model, files) is None:
        return None
    return model, files


def _sources(model: torch.nn.Module, files: dict[str, Stored]) -> dict[str, str | None] | None:
    """Per tensor (first name of each parameter, every persistent buffer): its checkpoint key (None for a LoRA
    factor: it starts from a seeded value), or None overall where the files lack some tensor."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out: dict[str, str | None] = {}
    for names in aliases.values():
        key = next((file_key(n) for n in names if file_key(n) in files), None)
        if key is None and ".lora_" not in names[0]:
            return None
        out[names[0]] = key
    persistent = set(model.state_dict(keep_vars=True))
    for name, _ in model.named_buffers():
        if name in persistent:
            if file_key(name) not in files:
                return None
            out[name] = file_key(name)
    return out


def materialise(model: torch.nn.Module, files: dict[str, Stored], device: torch.device,
                start: Callable[[str, torch.Size], torch.Tensor | None]) -> None:  # fmt: skip
    """Allocate this rank's shards of a sharded meta ``model`` on ``device`` and fill them (module docstring)."""
    sources = _sources(model, files)
    if sources is None:  # skeleton() checked the base model; only adapters are added since
        raise AgentrlError("trainer.world_size > 1: the checkpoint no longer names every tensor of the model")
    model.to_empty(device=device)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        _init_buffers(model)
        for name, key in sources.items():
            t = tensors[name]
            rows = _rows(t)
            if key is None:
                value = start(name, t.shape)
                if value is None:
                    raise AgentrlError(f"trainer.world_size > 1: no start value for {name}")
                _local(t).copy_(value[rows[0]:rows[1]] if rows else value)
                continue
            stored = files[key]
            if stored.shape != tuple(t.shape):
                raise AgentrlError(f"{key} in {stored.path.name} has shape {stored.shape}, the model's {name} "
                                   f"{tuple(t.shape)}: the checkpoint does not fit its config")  # fmt: skip
            _read_rows(stored, rows or (0, stored.shape[0] if stored.shape else 1), _local(t))


def _read_rows(stored: Stored, rows: tuple[int, int], dest: torch.Tensor) -> None:
    """Rows [start, end) of dim 0 of a stored tensor into ``dest`` (any dtype and device), ``CHUNK_BYTES`` at a time:
    no more of the file than that is ever in memory (a plain read, not a mapping of the file)."""
    row_numel = math.prod(stored.shape[1:]) if stored.shape else 1
    row_bytes = row_numel * stored.dtype.itemsize
    per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
    flat = dest.view(-1, row_numel) if stored.shape else dest.view(1, 1)
    with open(stored.path, "rb", buffering=0) as f:
        for r0 in range(rows[0], rows[1], per_chunk):
            r1 = min(rows[1], r0 + per_chunk)
            buf = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8)
            f.seek(stored.offset + r0 * row_bytes)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise AgentrlError(f"{stored.path} ends early: the checkpoint is truncated")
            flat[r0 - rows[0]:r1 - rows[0]].copy_(buf.view(stored.dtype).view(r1 - r0, row_numel))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(t: torch.Tensor) -> tuple[int, int] | None:
    """This rank's rows [start, end) of dim 0 of an FSDP2 shard (``torch.chunk`` layout), None for a whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None
    if tuple(t.placements) != (Shard(0),):
        raise AgentrlError(f"trainer.world_size > 1: unexpected placement {t.placements} of a parameter")
    n, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = math.ceil(n / world) if n else 0
    start, end = min(n, rank * chunk), min(n, (rank + 1) * chunk)
    if t.to_local().shape[0] != end - start:
        raise AgentrlError(f"trainer.world_size > 1: a shard of {n} rows holds {t.to_local().shape[0]}, not {end - start}")
    return start, end


def _init_buffers(model: torch.nn.Module) -> None:
    """Recompute the non-persistent buffers (rotary ``inv_freq``, ...) with the model's own ``_init_weights`` (what
    ``from_pretrained`` does for them); the module's parameters are flagged initialised so it leaves them alone."""
    from transformers import PreTrainedModel

    owner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    buffers = []
    for mod in model.modules():
        own = [getattr(mod, b) for b in mod._non_persistent_buffers_set if getattr(mod, b, None) is not None]
        if not own:
            continue
        for b in own:
            if b.is_floating_point():
                b.fill_(float("nan"))
            buffers.append(b)
        params = list(mod.parameters(recurse=False))
        for p in params:
            p._is_hf_initialized = True
        if owner is not None:
            owner._init_weights(mod)
        for p in params:
            del p._is_hf_initialized
    unset = [n for n, b in model.named_buffers() if b.is_floating_point() and any(b is x for x in buffers)
             and bool(torch.isnan(b).any())]  # fmt: skip
    if unset:
        raise AgentrlError(f"trainer.world_size > 1: cannot recompute the buffer {unset[0]} of "
                           f"{type(model).__name__} without loading the whole model")  # fmt: skip
