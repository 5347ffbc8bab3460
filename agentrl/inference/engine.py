"""The embedded inference engine: continuous batching over a slot KV cache, live weights.

One background thread owns the model.  Each loop iteration ("step"):

1. admits waiting requests into free slots and prefills their prompts in one padded
   forward pass (a request with ``n`` choices is prefilled once; its cache rows are copied);
2. decodes one token for every running sequence in one batched forward pass;
3. retires finished sequences at once (their slots are refilled by compaction), so a long
   request never holds short ones back and new requests join at any step.

The KV cache is one preallocated tensor per K and V, ``[layers, max_batch, kv_heads,
max_model_len, head_dim]``; running sequences always occupy slots ``0..B-1`` so a decode
step attends over the view ``[:, :B, :, :L]`` with a boolean mask ``key_pos <= query_pos``.
The HF model's own forward runs unchanged: :class:`_SlotCache` implements the one
``Cache.update`` hook the attention layers call, and the 4-D mask bypasses HF's mask
builder.  (transformers' own continuous batching was considered; it has no per-request
sampling parameters, sampling-distribution logprobs, or pause-and-swap weight updates
with per-token version tags, which training needs.)

Sampling and logprobs: :mod:`agentrl.inference.sampling` (the μ contract the trainer
mirrors).  Every sampled token is returned with its μ, its support size and the weight
version that sampled it.

Streaming: ``submit(..., on_tokens=cb)`` makes the engine thread call ``cb(events)`` once per
step for that request, with one :class:`TokenEvent` per choice that sampled a token in the
step (the last event of a choice carries its ``finish_reason`` and final ``text``), always
before the request's future resolves.  ``cb`` runs on the engine thread, so it must only
hand the batch off (e.g. ``loop.call_soon_threadsafe``).  Requests without a callback do
no per-token streaming work.

Weights: :meth:`Engine.update_weights` waits for the current step to end, swaps the
tensors, bumps ``version`` and lets the loop continue.  In-flight sequences keep their KV
cache (vLLM ``pause(mode="keep")`` semantics) and every token records the version that
produced it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import RequestError
from agentrl.inference.engine_args import EngineArgs
from agentrl.inference.sampling import EngineSampling, sample


@dataclass
class SequenceResult:
    """One finished choice."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    support: list[int] = field(default_factory=list)  # kept-set size K of each token's distribution


@dataclass
class TokenEvent:
    """One token one choice sampled in one step, as handed to a request's ``on_tokens``."""

    index: int  # the choice
    token_id: int
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None = None  # set on the choice's last token
    text: str | None = None  # the choice's whole final text, with finish_reason
    support: int = 0


TokenCallback = Callable[[list[TokenEvent]], None]


@dataclass
class _Sequence:
    request: _Request
    index: int
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the cache
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    support: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    text: str | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: EngineSampling
    n: int
    future: concurrent.futures.Future
    seqs: list[_Sequence] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    on_tokens: TokenCallback | None = None


class _SlotCache:
    """The ``Cache.update`` hook HF attention layers call, backed by the slot tensors.

    Before each forward the engine binds the first slot row ``r0``, the positions
    ``[R, T]`` the new tokens take, and the key length ``L`` attention should see.
    """

    is_compileable = False

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.r0 = 0
        self.positions: torch.Tensor | None = None
        self.kv_len = 0

    def bind(self, r0: int, positions: torch.Tensor, kv_len: int) -> None:
        self.r0, self.positions, self.kv_len = r0, positions, kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows, heads, t, dim = key_states.shape
        kb = self.k[layer_idx, self.r0 : self.r0 + rows]
        vb = self.v[layer_idx, self.r0 : self.r0 + rows]
        idx = self.positions[:, None, :, None].expand(rows, heads, t, dim)
        kb.scatter_(2, idx, key_states.to(kb.dtype))
        vb.scatter_(2, idx, value_states.to(vb.dtype))
        return kb[:, :, : self.kv_len], vb[:, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class Engine:
    """A batched generator over one HF causal LM. Thread-safe ``submit``; see module doc."""

    def __init__(self, model_dir: str | Path, args: EngineArgs | None = None, **overrides: Any):
        """``args`` (or keyword overrides of its fields): :class:`EngineArgs`."""
        from dataclasses import replace

        from transformers import AutoModelForCausalLM, AutoTokenizer

        args = replace(args or EngineArgs(), **overrides)
        max_batch_size, max_model_len = args.max_batch_size, args.max_model_len
        self.model_dir = Path(model_dir)
        self.device = resolve_device(args.device)
        torch_dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype or "auto")
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.max_batch_size = max_batch_size
        limit = getattr(cfg, "max_position_embeddings", None) or max_model_len
        self.max_model_len = min(max_model_len, limit)
        self.prefill_token_budget = max(args.prefill_token_budget, self.max_model_len)
        self.eos_ids = self._eos_ids()

        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        shape = (cfg.num_hidden_layers, max_batch_size, kv_heads, self.max_model_len, head_dim)
        param_dtype = next(self.model.parameters()).dtype
        self._k = torch.zeros(shape, dtype=param_dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=param_dtype, device=self.device)
        self._cache = _SlotCache(self._k, self._v)
        self._base = self.model.base_model
        self._head = self.model.get_output_embeddings()
        import inspect

        params = inspect.signature(self._base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

        self.version = 0
        self._waiting: deque[_Request] = deque()
        self._active: list[_Sequence] = []
        self._cv = threading.Condition()
        self._paused = False
        self._updating = False
        self._busy = False
        self._closed = False
        self._rng = torch.Generator(device=self.device)
        self._rng.manual_seed(0)
        self._token_times: deque[tuple[float, int]] = deque()
        self.total_generated = 0
        self.steps = 0
        self.requests_aborted = 0  # cancelled by their client (disconnect) before finishing
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._thread.start()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config, self.model.config):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        if self.tokenizer.pad_token_id is not None:  # a sampled padding token ends the sequence too
            ids.add(self.tokenizer.pad_token_id)
        return ids

    # ------------------------------------------------------------------ public API

    def submit(
        self, prompt_ids: list[int], sampling: EngineSampling, n: int = 1, on_tokens: TokenCallback | None = None
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to ``list[SequenceResult]`` (one per choice).

        ``on_tokens``: called on the engine thread with each step's :class:`TokenEvent` batch
        for this request (see the module docstring); cancel the future to abort.
        """
        if not prompt_ids:
            raise RequestError("prompt must contain at least one token", param="prompt")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(prompt_ids)} tokens, leaving no room for a completion. Please reduce "
                "the length of the messages or prompt.",
                code="context_length_exceeded",
                param="messages",
            )
        if n < 1 or n > self.max_batch_size:
            raise RequestError(f"n must be between 1 and {self.max_batch_size}, got {n}", param="n")
        sampling.max_tokens = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = _Request(list(prompt_ids), sampling, n, fut, on_tokens=on_tokens)
        for i in range(n):
            seq = _Sequence(req, i)
            if sampling.seed is not None:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(sampling.seed + i)
            req.seqs.append(seq)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._waiting.append(req)
            self._cv.notify_all()
        return fut

    def pause(self) -> None:
        """Stop generating after the current step (requests stay queued/in flight)."""
        with self._cv:
            self._paused = True
            while self._busy:
                self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def update_weights(self, apply: Callable[[torch.nn.Module], Any], version: int | None = None) -> int:
        """Run ``apply(model)`` between steps, then set the version (default: +1). Returns it."""
        with self._cv:
            while self._updating:
                self._cv.wait()
            self._updating = True
            while self._busy:
                self._cv.wait()
        try:
            with torch.no_grad():
                apply(self.model)
            self.version = self.version + 1 if version is None else int(version)
            return self.version
        finally:
            with self._cv:
                self._updating = False
                self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._cv:
            recent = [(t, n) for t, n in self._token_times if now - t <= 10.0]
            window = (now - recent[0][0]) if len(recent) > 1 else 0.0
            toks = sum(n for _, n in recent[1:]) if len(recent) > 1 else 0
            return {
                "queue_depth": sum(1 for r in self._waiting if not r.future.cancelled()),
                # live sequences: a cancelled request's are only dropped at the next step
                "running": sum(1 for s in self._active if not s.request.future.cancelled()),
                "tokens_per_s": toks / window if window > 0 else 0.0,
                "total_generated_tokens": self.total_generated,
                "steps": self.steps,
                "requests_aborted": self.requests_aborted,
                "version": self.version,
                "paused": self._paused,
                "max_batch_size": self.max_batch_size,
                "max_model_len": self.max_model_len,
                "device": str(self.device),
            }

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        err = RuntimeError("engine closed")
        for req in list(self._waiting) + list({id(s.request): s.request for s in self._active}.values()):
            if not req.future.done():
                req.future.set_exception(err)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (
                    self._paused or self._updating or (not self._waiting and not self._active)
                ):
                    self._cv.wait()
                if self._closed:
                    return
                self._busy = True
            try:
                self._step()
            except Exception as e:  # never let one bad batch kill the server
                self._fail_all(e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _fail_all(self, exc: Exception) -> None:
        reqs = {id(s.request): s.request for s in self._active}
        self._active = []
        for req in reqs.values():
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"engine step failed: {exc!r}"))

    @torch.no_grad()
    def _step(self) -> None:
        gone = {id(s.request) for s in self._active if s.request.future.cancelled()}  # client went away
        if gone:
            for s in self._active:
                if id(s.request) in gone:
                    s.finish_reason = "abort"
            self.requests_aborted += len(gone)
            self._retire()
        admitted = self._take_admissible()
        if admitted:
            self._prefill(admitted)
        if self._active:
            self._decode()
        self.steps += 1

    def _take_admissible(self) -> list[_Request]:
        out: list[_Request] = []
        free = self.max_batch_size - len(self._active)
        budget = self.prefill_token_budget
        with self._cv:
            while self._waiting:
                req = self._waiting[0]
                if req.future.cancelled():
                    self._waiting.popleft()
                    self.requests_aborted += 1
                    continue
                if req.n > free or (out and len(req.prompt_ids) > budget):
                    break
                self._waiting.popleft()
                out.append(req)
                free -= req.n
                budget -= len(req.prompt_ids)
        return out

    def _forward(self, r0: int, input_ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Run the base model on rows ``r0..`` of the slot cache; returns hidden states."""
        mask = torch.arange(kv_len, device=self.device)[None, None, None, :] <= positions[:, None, :, None]
        self._cache.bind(r0, positions, kv_len)
        out = self._base(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        return out.last_hidden_state

    def _prefill(self, reqs: list[_Request]) -> None:
        r0 = len(self._active)
        lens = [len(r.prompt_ids) for r in reqs]
        t = max(lens)
        ids = torch.full((len(reqs), t), 0, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
        ids = ids.to(self.device)
        positions = torch.arange(t, device=self.device).expand(len(reqs), t).contiguous()
        hidden = self._forward(r0, ids, positions, t)
        last = hidden[torch.arange(len(reqs), device=self.device), torch.tensor(lens, device=self.device) - 1]
        logits = self._head(last).float()

        # place every choice in a slot: choice 0 uses the prefill row, others get copies
        row_of: dict[int, int] = {}
        new: list[_Sequence] = []
        extra = r0 + len(reqs)
        for i, r in enumerate(reqs):
            for seq in r.seqs:
                if seq.index == 0:
                    seq.slot = r0 + i
                else:
                    seq.slot, extra = extra, extra + 1
                    self._copy_slot(r0 + i, seq.slot, lens[i])
                seq.cached = lens[i]
                row_of[id(seq)] = i
                new.append(seq)
        new.sort(key=lambda s: s.slot)
        self._active.extend(new)
        rows = torch.tensor([row_of[id(s)] for s in new], device=self.device)
        self._sample_and_record(new, logits[rows])
        self._retire()

    def _decode(self) -> None:
        seqs = self._active
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[s.cached] for s in seqs], dtype=torch.long, device=self.device)
        kv_len = max(s.cached for s in seqs) + 1
        hidden = self._forward(0, ids, positions, kv_len)
        logits = self._head(hidden[:, -1]).float()
        for s in seqs:
            s.cached += 1
        self._sample_and_record(seqs, logits)
        self._retire()

    # ------------------------------------------------------------------ sampling

    def _sample_and_record(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        draw = sample(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs], self._rng)
        tokens, logps, tops = draw.tokens, draw.logprobs, draw.top_logprobs
        version = self.version
        now = time.monotonic()
        streams: dict[int, tuple[_Request, list[TokenEvent]]] | None = None  # id(request) -> step's events
        for k, s in enumerate(seqs):
            tok = tokens[k]
            s.token_ids.append(tok)
            s.logprobs.append(logps[k])
            s.versions.append(version)
            s.support.append(draw.support[k])
            if tops is not None:
                s.top_logprobs.append(tops[k])
            self._check_finished(s, tok)
            if s.request.on_tokens is not None:
                if streams is None:
                    streams = {}
                if s.finish_reason is not None and s.text is None:
                    s.text = self._detokenize(s.token_ids)  # _result reuses it
                ev = TokenEvent(s.index, tok, logps[k], version, tops[k] if tops is not None else None, s.finish_reason,
                                s.text if s.finish_reason is not None else None, draw.support[k])  # fmt: skip
                streams.setdefault(id(s.request), (s.request, []))[1].append(ev)
        if streams is not None:
            self._emit(streams)
        with self._cv:
            self.total_generated += len(seqs)
            self._token_times.append((now, len(seqs)))
            while self._token_times and now - self._token_times[0][0] > 10.0:
                self._token_times.popleft()

    @staticmethod
    def _emit(streams: dict[int, tuple[_Request, list[TokenEvent]]]) -> None:
        """Hand each streaming request its step's events (one callback per request)."""
        for req, events in streams.values():
            try:
                req.on_tokens(events)
            except Exception:  # the consumer is gone (e.g. its event loop closed): abort
                req.future.cancel()

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _check_finished(self, s: _Sequence, tok: int) -> None:
        sp = s.request.sampling
        if (tok in self.eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            s.finish_reason = "stop"
            return
        if sp.stop:
            text = self._detokenize(s.token_ids)
            window = max(len(x) for x in sp.stop) + 16
            tail_start = max(0, len(text) - window)
            for stop in sp.stop:
                pos = text.find(stop, tail_start)
                if pos >= 0:
                    s.finish_reason = "stop"
                    s.text = text[: pos + len(stop)] if sp.include_stop_str_in_output else text[:pos]
                    return
        if len(s.token_ids) >= sp.max_tokens or len(s.request.prompt_ids) + len(s.token_ids) >= self.max_model_len:
            s.finish_reason = "length"

    def _retire(self) -> None:
        """Drop finished sequences, compact live ones into slots 0..B-1, resolve requests."""
        live = [s for s in self._active if s.finish_reason is None]
        done = [s for s in self._active if s.finish_reason is not None]
        if not done:
            return
        b = len(live)
        occupied = {s.slot for s in live}
        holes = [slot for slot in range(b) if slot not in occupied]
        movers = sorted((s for s in live if s.slot >= b), key=lambda s: s.slot)
        for hole, s in zip(holes, movers, strict=True):
            self._copy_slot(s.slot, hole, s.cached)
            s.slot = hole
        self._active = sorted(live, key=lambda s: s.slot)
        for s in done:
            req = s.request
            if all(x.finish_reason is not None for x in req.seqs) and not req.future.done():
                try:
                    req.future.set_result([self._result(x) for x in req.seqs])
                except concurrent.futures.InvalidStateError:  # cancelled by its client meanwhile
                    pass

    def _copy_slot(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self._k[:, dst, :, :length] = self._k[:, src, :, :length]
            self._v[:, dst, :, :length] = self._v[:, src, :, :length]

    def _result(self, s: _Sequence) -> SequenceResult:
        text = s.text if s.text is not None else self._detokenize(s.token_ids)
        return SequenceResult(
            token_ids=s.token_ids,
            logprobs=s.logprobs,
            versions=s.versions,
            top_logprobs=s.top_logprobs,
            text=text,
            finish_reason=s.finish_reason or "length",
            support=s.support,
        )
