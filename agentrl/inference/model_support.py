"""What the embedded engine can serve exactly, decided when a model is loaded.

The engine runs the model's own HF forward (so its own logit processing: final-logit
softcapping, logit scaling, ...) over its slot cache, with masks it builds per row
(:mod:`agentrl.inference.kv_cache`).  That is exact when the model's attention is causal
over full and/or sliding-window layers, its rotary frequencies do not depend on the batch,
and it reads K/V only through ``Cache.update``.  Anything else is refused at load with a
one-line :class:`~agentrl.errors.EngineStartError` naming what is missing, never served wrong:

1. static checks on the config (:func:`unsupported_features`);
2. a self-check (:func:`self_check`): a short probe prefilled in two chunks over two padded
   rows, then decoded, through the engine's own path, compared with the model's plain forward
   of the same tokens.  It catches what no config field says (a model that ignores position
   ids, keeps K/V elsewhere, or slices its logits otherwise than the engine reads them).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.errors import EngineStartError
from agentrl.inference.kv_cache import FULL, SLIDING

if TYPE_CHECKING:
    from agentrl.inference.engine import Engine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |Δ logprob| (over each position's 16 likeliest tokens) the self-check tolerates: kernels
# differ between a padded batch and a plain forward (rounding, large in half precision); a wrong
# mask or a skipped logit transform moves the likely tokens by nats.  bf16: SmolLM2-135M's 30
# layers measured 0.28 (loaded in float32, then cast) and 0.53 (loaded as bf16) of rounding
# alone on a Zen 4, where a mask that sees the future measured 15
SELF_CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 1.5, torch.float16: 0.25}


def _one_line(e: BaseException) -> str:
    from agentrl.inference.client import clip

    return f"{type(e).__name__}: {clip(str(e), 300)}"


CPU_LINEAR = ("packed", "onednn", "torch")


def load_model(model_dir: Path, dtype: str, device: torch.device, cpu_linear: str = "packed") -> tuple[Any, Any]:
    """(model in eval mode on ``device``, tokenizer) from a local HF causal-LM directory.

    ``dtype`` auto: the checkpoint's, except that a float32 checkpoint runs in bf16 where
    :func:`agentrl.precision.use_bf16` says bf16 is native and faster (a wide model on a bf16 CPU).
    ``cpu_linear``: how float32 linear layers compute on a CPU (:mod:`agentrl.cpu_gemm`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype != "auto" and dtype not in DTYPES:
        raise EngineStartError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    if cpu_linear not in CPU_LINEAR:
        raise EngineStartError(f"cpu_linear must be {' | '.join(CPU_LINEAR)}; got {cpu_linear!r}")
    if not (model_dir / "config.json").is_file():
        raise EngineStartError(f"no model at {str(model_dir)!r} (expected a HF model dir with config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES.get(dtype, "auto"))
    except (OSError, ValueError, KeyError, ImportError) as e:
        from agentrl.inference.client import no_tokenizer

        if "tokenizer" in str(e).lower() and (reason := no_tokenizer(model_dir)) is not None:
            raise EngineStartError(reason) from e  # HF's own text stops at "from one of:"
        raise EngineStartError(f"cannot load {str(model_dir)!r} as a causal LM: {_one_line(e)}") from e
    if dtype == "auto" and model.dtype == torch.float32:
        from agentrl.precision import use_bf16

        if use_bf16("auto", model.config.get_text_config().hidden_size, device.type):
            model = model.to(torch.bfloat16)
    model = model.to(device).eval()
    if device.type == "cpu" and cpu_linear != "torch":
        from agentrl.cpu_gemm import route_linears

        # float32 products through oneDNN: ~2x MKL's on AMD CPUs with AVX-512
        route_linears(model, prepack=cpu_linear == "packed")
    return model, tokenizer


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a sequence: the model's generation config and config EOS sets, the
    tokenizer's eos, and its pad token (a sampled padding token ends the sequence too)."""
    ids: set[int] = set()
    for src in (model.generation_config, model.config):
        eos = getattr(src, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    ids.update(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None)
    return ids


def mask_kinds(cfg: Any) -> tuple[dict[str, int | None], bool]:
    """(layer kind -> sliding window, whether the model takes a per-kind dict of masks)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return {kind: (window if kind == SLIDING else None) for kind in sorted(set(layer_types))}, True
    return {FULL: window}, False  # one mask for every layer (Mistral, Phi-3: window or none)


def unsupported_features(model: Any, max_model_len: int) -> list[str]:
    """What about this model the engine cannot reproduce exactly (empty: nothing known)."""
    cfg = model.config
    missing: list[str] = []
    if getattr(cfg, "is_encoder_decoder", False):
        missing.append("encoder-decoder models")
    attn = getattr(cfg, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        missing.append(f"attention implementation {attn!r} (sdpa or eager only)")
    kinds = set(getattr(cfg, "layer_types", None) or [])
    if kinds - {FULL, SLIDING}:
        missing.append(f"layer types {sorted(kinds - {FULL, SLIDING})} (full and sliding attention only)")
    if SLIDING in kinds and getattr(cfg, "sliding_window", None) is None:
        missing.append("sliding layers without a sliding_window")
    if getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "is_causal", True) is False:
        missing.append("bidirectional attention")
    if getattr(cfg, "attention_chunk_size", None) and not kinds:
        missing.append("chunked attention")
    problem = _rope_problem(cfg, max_model_len)
    if problem:
        missing.append(problem)
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" not in params:
        missing.append("logits of chosen positions (the model's forward has no logits_to_keep)")
    if not ({"cache", "past_key_values"} & set(params)):
        missing.append("an external KV cache (the model's forward takes no cache)")
    return missing


def _rope_problem(cfg: Any, max_model_len: int) -> str | None:
    """Dynamic and LongRoPE frequencies follow the batch's longest position: refuse past the switch."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for p in groups:
        kind = p.get("rope_type") or p.get("type")
        if kind in ("dynamic", "longrope"):
            original = (p.get("original_max_position_embeddings")
                        or getattr(cfg, "original_max_position_embeddings", None)
                        or cfg.max_position_embeddings)  # fmt: skip
            if max_model_len > original:
                return (f"rope_type {kind!r} past {original} tokens (its frequencies depend on the batch's "
                        f"longest sequence); serve with max_model_len <= {original}")
    return None


def check_servable(model: Any, max_model_len: int) -> None:
    """Raise the one-line refusal for what :func:`unsupported_features` finds."""
    missing = unsupported_features(model, max_model_len)
    if missing:
        name = getattr(model.config, "model_type", type(model).__name__)
        raise EngineStartError(f"the engine cannot serve {name!r} exactly: no support for {'; '.join(missing)}")


def _delta(got: torch.Tensor, ref: torch.Tensor, top: int = 16) -> float:
    """Max |Δ| over the reference's likeliest tokens (the far tail is rounding noise in half precision)."""
    idx = ref.topk(min(top, ref.numel())).indices
    return float((got[idx] - ref[idx]).abs().max())


def layer_kinds(cfg: Any) -> list[str]:
    """Each layer's mask kind (a key of :func:`mask_kinds`)."""
    layer_types = getattr(cfg, "layer_types", None)
    return list(layer_types) if layer_types else [FULL] * cfg.num_hidden_layers


def _padded_probe(engine: Engine, probe: torch.Tensor, length: int) -> dict[tuple[int, int], torch.Tensor]:
    rows = probe.shape[0]
    got: dict[tuple[int, int], torch.Tensor] = {}  # (row, position) -> logits
    cuts = [length // 3, length // 4][:rows]
    logits = engine._prefill_logits(0, [probe[r, : cuts[r]].tolist() for r in range(rows)], [0] * rows)
    for r in range(rows):
        got[(r, cuts[r] - 1)] = logits[r]
    if rows == 2:  # row 1 continues on its cached prefix, alone in its batch
        mid = length // 2
        got[(1, mid - 1)] = engine._prefill_logits(1, [probe[1, cuts[1] : mid].tolist()], [cuts[1]])[0]
        cuts[1] = mid
    pos = list(cuts)
    while min(pos) < length:
        live = [r for r in range(rows) if pos[r] < length]
        live = list(range(live[0], rows))  # decode rows are contiguous from the first live one
        ids = [[int(probe[r, min(pos[r], length - 1)])] for r in live]
        out = engine._decode_logits(live[0], ids, [min(pos[r], length - 1) for r in live])
        for i, r in enumerate(live):
            if pos[r] < length:
                got[(r, pos[r])] = out[i]
            pos[r] += 1
    return got


def _ragged_probe(engine: Engine, probe: torch.Tensor, length: int) -> dict[tuple[int, int], torch.Tensor]:
    """The padded probe's schedule through ragged forwards: both prompts as one group of two
    segments; then row 1's prompt continues (a segment on a cached prefix) beside row 0's decode;
    one step of plain decoding (one token per row); then 0-3 draft tokens after each decode token
    (rows of unequal lengths), with row 1 once more as a segment of its own beside row 0."""
    rows = probe.shape[0]
    cuts = [length // 3, length // 4][:rows]
    first = [(r, probe[r, : cuts[r]].tolist(), 0) for r in range(rows)]
    logits = engine._ragged_logits([], [], first, [cuts[0] - 1, cuts[0] + cuts[-1] - 1][:rows])
    got = {(r, cuts[r] - 1): logits[r] for r in range(rows)}
    pos, step = list(cuts), 0
    while any(p < length for p in pos):
        decode: list[tuple[int, int]] = []
        drafts: list[list[int]] = []
        segments: list[tuple[int, list[int], int]] = []
        at_decode: list[tuple[int, int]] = []
        at_drafts: list[tuple[int, int]] = []
        at_segments: list[tuple[int, int]] = []
        for r in range(rows):
            if pos[r] >= length:
                continue
            alone = r == 1 and step in (0, 2)  # a segment, not a decode row
            if step == 0 and r == 1:
                n = length // 2 - pos[r]
            else:
                n = min(1 if step == 1 else 1 + (step + r) % 4, length - pos[r])
            toks = probe[r, pos[r] : pos[r] + n].tolist()
            if r == len(decode) and not alone:  # decode rows: slots 0..B-1
                decode.append((toks[0], pos[r]))
                drafts.append(toks[1:])
                at_decode.append((r, pos[r]))
                at_drafts += [(r, pos[r] + j) for j in range(1, n)]
            else:
                segments.append((r, toks, pos[r]))
                at_segments += [(r, pos[r] + j) for j in range(n)]
            pos[r] += n
        at = at_decode + at_drafts + at_segments
        logits = engine._ragged_logits(decode, drafts, segments, list(range(len(at))))
        got.update(zip(at, logits, strict=True))
        step += 1
    return got


def _probe(engine: Engine, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probe token ids ``[rows, length]``, the model's plain-forward log-probs ``[rows, length, V]``)."""
    model = engine.model
    rows = 2 if engine.max_batch_size >= 2 else 1
    gen = torch.Generator().manual_seed(1234)
    probe = torch.randint(model.config.vocab_size, (rows, length), generator=gen)
    return probe, model(input_ids=probe.to(engine.device)).logits.float().log_softmax(-1).cpu()


@torch.no_grad()
def reference(engine: Engine, length: int = 24) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`self_check`'s probe and reference, computed now (before the engine changes the
    model's attention, so the reference is the model's own)."""
    length = min(length, engine.max_model_len - 1)
    return _probe(engine, length) if length >= 8 else None


@torch.no_grad()
def self_check(engine: Engine, length: int = 24, ref: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Max |Δ logprob| between the engine's path and the plain forward on a probe; refuses above tolerance.

    Two rows, ``a`` and ``b``: prefill ``a[:n0]`` and ``b[:n1]`` together, then ``b[n1:n2]`` on
    top of its cached K/V (the prefix-reuse path), then decode both to ``length``: a token
    at a time through padded forwards, or, when ``engine.ragged``, through ragged forwards
    with draft tokens (:func:`_ragged_probe`).  Runs before the engine's loop starts (slots 0 and 1).
    ``ref``: :func:`reference`'s, taken before the model's attention changed (default: computed here).
    """
    model = engine.model
    length = min(length, engine.max_model_len - 1)
    if length < 8:  # too short a context to probe (and to serve anything useful)
        return 0.0
    name = getattr(model.config, "model_type", type(model).__name__)
    try:
        probe, logprobs = ref if ref is not None else _probe(engine, length)
        got = (_ragged_probe if engine.ragged else _padded_probe)(engine, probe, length)
        # a forward that returned another shape (a transformers that reads logits_to_keep otherwise) fails here
        delta = max(_delta(lp.float().log_softmax(-1).cpu(), logprobs[r, p]) for (r, p), lp in got.items())
    except EngineStartError:
        raise
    except Exception as e:
        raise EngineStartError(f"the engine cannot serve {name!r}: its self-check failed ({_one_line(e)})") from e
    tol = SELF_CHECK_TOL.get(next(model.parameters()).dtype, 1e-3)
    if not delta <= tol:  # also catches NaN
        raise EngineStartError(
            f"the engine cannot serve {name!r} exactly: its logprobs differ from the model's own forward "
            f"by {delta:.3g} on a self-check probe (tolerance {tol:g})"
        )
    return delta
