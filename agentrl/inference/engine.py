"""The embedded inference engine: continuous batching over a slot KV cache, live weights.

One background thread owns the model.  Each loop iteration ("step"):

1. admits waiting requests into free slots and copies each prompt's cached prefix
   (:mod:`agentrl.inference.prefix_cache`) into its slot (a request with ``n`` choices is
   prefilled once; its slot is copied after the forward);
2. runs one forward (:mod:`agentrl.inference.ragged`) over every running sequence's next
   token, its n-gram draft tokens if speculation is on (:mod:`agentrl.inference.speculation`),
   and the uncached rest of each new prompt, then samples every position: a sequence keeps its
   drafts while each equals the token sampled at its position.  A model that cannot run ragged
   forwards takes two padded ones instead (the prompts, then one token per sequence);
3. retires finished sequences at once (their K/V go to the prefix cache, their slots are
   refilled by compaction), so a long request never holds short ones back.

Running sequences occupy slots ``0..B-1`` of the slot cache (:mod:`agentrl.inference.kv_cache`).
Each forward is the model's own, unchanged (:mod:`agentrl.inference.forwards`).  A model
whose path the engine cannot reproduce is refused at load
(:mod:`agentrl.inference.model_support`).  (transformers' own continuous batching was
considered; it has no per-request sampling parameters, sampling-distribution logprobs, or
pause-and-swap weight updates with per-token version tags, which training needs.)

Sampling and logprobs: :mod:`agentrl.inference.sampling` (the μ contract the trainer
mirrors).  Every sampled token is returned with its μ, its support size and the weight
version that sampled it.

Streaming: ``submit(..., on_tokens=cb)`` makes the engine thread call ``cb(events)`` once per
step for that request, with one :class:`TokenEvent` per token a choice sampled in the step
(several with kept drafts, in order; the last event of a choice carries its ``finish_reason`` and final ``text``), always
before the request's future resolves.  ``cb`` runs on the engine thread, so it must only
hand the batch off (e.g. ``loop.call_soon_threadsafe``).  Requests without a callback do
no per-token streaming work.

Weights: :meth:`Engine.update_weights` waits for the current step to end, swaps the
tensors, bumps ``version``, clears the prefix cache and lets the loop continue.  In-flight
sequences keep their KV cache (vLLM ``pause(mode="keep")`` semantics) and every token
records the version that produced it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentrl.cpu_gemm import invalidate_packs
from agentrl.errors import EngineStartError
from agentrl.inference import cpu_decode_attention, model_support, ragged
from agentrl.inference.engine_args import EngineArgs
from agentrl.inference.forwards import Forwards
from agentrl.inference.kv_cache import SlotCache
from agentrl.inference.prefix_cache import Block, PrefixCache
from agentrl.inference.requests import (  # noqa: F401  (TokenEvent, TokenCallback: re-exported)
    Recorder,
    SequenceResult,
    TokenCallback,
    TokenEvent,
    _Request,
    _Sequence,
    check_request,
    resolve_device,
)
from agentrl.inference.sampling import EngineSampling, sample
from agentrl.inference.speculation import NgramDrafter, Speculation

log = logging.getLogger(__name__)


class Engine:
    """A batched generator over one HF causal LM. Thread-safe ``submit``; see module doc."""

    def __init__(self, model_dir: str | Path, args: EngineArgs | None = None, **overrides: Any):
        """``args`` (or keyword overrides of its fields): :class:`EngineArgs`.

        Raises :class:`~agentrl.errors.EngineStartError` (one line) for a model it cannot
        load or cannot serve exactly (:mod:`agentrl.inference.model_support`).
        """
        from dataclasses import replace

        args = replace(args or EngineArgs(), **overrides)
        self.args = args
        self.model_dir = Path(model_dir)
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # what a library puts on "the current GPU" lands here, not on GPU 0
        self.model, self.tokenizer = model_support.load_model(self.model_dir, args.dtype, self.device, args.cpu_linear)
        cfg = self.model.config.get_text_config()
        self.max_batch_size = args.max_batch_size
        self.vocab_size: int = self.model.config.vocab_size
        limit = getattr(cfg, "max_position_embeddings", None) or args.max_model_len
        self.max_model_len = min(args.max_model_len, limit)
        model_support.check_servable(self.model, self.max_model_len)
        self.prefill_token_budget = max(args.prefill_token_budget, self.max_model_len)
        self.eos_ids = model_support.eos_ids(self.model, self.tokenizer)

        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.dtype = next(self.model.parameters()).dtype
        self._cache = SlotCache(cfg.num_hidden_layers, self.max_batch_size, kv_heads, self.max_model_len, head_dim,
                                self.dtype, self.device)  # fmt: skip
        forwards = Forwards(self.model, self._cache, self.dtype, self.device, self._decode_kernel(args.cpu_attention))
        # instance attributes: the self-check runs them, a test wraps one
        self._prefill_logits, self._decode_logits = forwards.prefill, forwards.decode
        self._ragged_logits = forwards.ragged
        self.prefix: PrefixCache | None = None
        if args.prefix_block_size < 1:
            raise EngineStartError(f"prefix_block_size must be >= 1, got {args.prefix_block_size}")
        if args.enable_prefix_caching:
            tokens = args.prefix_cache_tokens or self.max_batch_size * self.max_model_len
            self.prefix = PrefixCache(self._cache, max(1, tokens // args.prefix_block_size), args.prefix_block_size)
        self._epoch = 0  # bumped when cached K/V go stale (weights changed)
        drafts = args.num_speculative_tokens > 0
        if drafts and args.speculative_ngram < 1:
            raise EngineStartError(f"speculative_ngram must be >= 1, got {args.speculative_ngram}")
        if drafts and not args.ragged_batches:
            raise EngineStartError("num_speculative_tokens needs ragged batches (draft tokens ride in their "
                                   "forwards): set ragged_batches = true or num_speculative_tokens = 0")  # fmt: skip
        self.ragged = False  # one ragged forward per step (agentrl.inference.ragged), else padded forwards
        self.self_check_delta = model_support.self_check(self)
        self.ragged_check_delta: float | None = None
        if args.ragged_batches:
            self._use_ragged()
        drafter = None
        if drafts and self.ragged:
            drafter = NgramDrafter(args.speculative_ngram, args.num_speculative_tokens)
        elif drafts:  # ragged batches refused for this model: it still serves
            log.warning("engine: num_speculative_tokens = %d is ignored: draft tokens need ragged batches, which "
                        "this model cannot run (see above)", args.num_speculative_tokens)  # fmt: skip
        self.speculation = Speculation(drafter, self.max_model_len)

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
        self.prompt_tokens = 0  # prompt tokens of admitted requests (each prompt once, whatever its n)
        self.prefill_tokens = 0  # of those, run through a prefill forward
        self.prefix_hit_tokens = 0  # of those, copied from the prefix cache instead
        # called on the engine thread after every step (an engine core sends the step's results in one message)
        self.on_step: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def submit(
        self, prompt_ids: list[int], sampling: EngineSampling, n: int = 1, on_tokens: TokenCallback | None = None
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to ``list[SequenceResult]`` (one per choice).

        ``on_tokens``: called on the engine thread with each step's :class:`TokenEvent` batch
        for this request (see the module docstring); cancel the future to abort.
        """
        check_request(prompt_ids, n, self.vocab_size, self.max_model_len, self.max_batch_size)
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
        """Run ``apply(model)`` between steps, then set the version (default: +1). Returns it.

        The prefix cache is cleared (K/V of older weights would be reused as if current) unless
        ``EngineArgs.keep_prefix_cache_on_weight_update``; sequences in flight keep their K/V.
        """
        def swap() -> int:
            invalidate_packs(self.model)  # packed weight copies (agentrl.cpu_gemm) go before apply stages new ones
            try:
                apply(self.model)
            finally:  # and whatever apply wrote is packed afresh (apply writes through .data: no version moves)
                invalidate_packs(self.model)
            if not self.args.keep_prefix_cache_on_weight_update:
                self._invalidate_prefix_cache()
            self.version = self.version + 1 if version is None else int(version)
            return self.version

        return self._between_steps(swap)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's ``/reset_prefix_cache``)."""
        self._between_steps(self._invalidate_prefix_cache)

    def _invalidate_prefix_cache(self) -> None:
        self._epoch += 1  # running sequences' K/V will not be stored either
        if self.prefix is not None:
            self.prefix.clear()

    def _between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the caller's thread while the engine loop is parked between steps."""
        with self._cv:
            while self._updating:
                self._cv.wait()
            self._updating = True
            while self._busy:
                self._cv.wait()
        try:
            with torch.no_grad():
                return fn()
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
                "prompt_tokens": self.prompt_tokens,
                "prefill_tokens": self.prefill_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_cache_hit_rate": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prefix_cache_blocks": self.prefix.used_blocks if self.prefix is not None else 0,
                "prefix_cache_capacity_blocks": self.prefix.num_blocks if self.prefix is not None else 0,
                "prefix_cache_evicted_blocks": self.prefix.evicted_blocks if self.prefix is not None else 0,
                "ragged_batches": self.ragged,
                "cpu_attention": self.cpu_attention if self.ragged else "sdpa",
                "num_speculative_tokens": self.speculation.k,
                "draft_tokens": self.speculation.draft_tokens,
                "accepted_draft_tokens": self.speculation.accepted_draft_tokens,
                "version": self.version,
                "paused": self._paused,
                "max_batch_size": self.max_batch_size,
                "max_model_len": self.max_model_len,
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
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
                if self.on_step is not None:
                    self.on_step()
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _fail_all(self, exc: Exception) -> None:
        reqs = {id(s.request): s.request for s in self._active}
        self._active = []
        for req in reqs.values():
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"engine step failed: {exc!r}"))

    def _decode_kernel(self, setting: str) -> bool:
        """Does a ragged step's decode attention run the CPU kernel (agentrl.inference.cpu_decode_attention)?"""
        if setting not in ("kernel", "sdpa"):
            raise EngineStartError(f"cpu_attention must be kernel | sdpa; got {setting!r}")
        self.cpu_attention = "sdpa"
        sdpa = getattr(self.model.config, "_attn_implementation", None) == "sdpa"  # eager models keep their own
        if setting == "kernel" and self.device.type == "cpu" and self.dtype in cpu_decode_attention.DTYPES and sdpa:
            if cpu_decode_attention.kernel() is None:
                log.warning("engine: cpu_attention = kernel unavailable (%s); decode attention runs torch's sdpa",
                            cpu_decode_attention.unavailable_reason())  # fmt: skip
            else:
                self.cpu_attention = "kernel"
        return self.cpu_attention == "kernel"

    def _use_ragged(self) -> None:
        """Switch to ragged batches if the model's attention can, and a self-check through them passes."""
        original, ref = None, None
        if ragged.switchable(self.model):
            ref = model_support.reference(self)  # the model's own attention, before the switch
            original = ragged.switch(self.model)
        if original is None:
            log.warning("engine: %s runs attention %r; ragged batches need sdpa or eager, so prefill and decode "
                        "take separate padded forwards", type(self.model).__name__,
                        getattr(self.model.config, "_attn_implementation", None))  # fmt: skip
            return
        self.ragged = True
        try:
            self.ragged_check_delta = model_support.self_check(self, ref=ref)
        except EngineStartError as e:
            ragged.unswitch(self.model, original)
            self.ragged = False
            log.warning("engine: ragged batches refused for this model (%s); prefill and decode take separate "
                        "padded forwards", e)  # fmt: skip

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
        if self.ragged:
            if admitted or self._active:
                self._ragged_step(admitted)
        else:
            if admitted:
                self._prefill(admitted)
            if self._active:
                self._decode()
        self.steps += 1

    def _take_admissible(self) -> list[tuple[_Request, list[Block]]]:
        """FIFO requests that fit the free slots and the prefill budget, each with its cached prefix.

        A request whose first uncached block an earlier request of this step will compute (a
        group's episodes, a shared system prompt) waits one step and then reuses it.
        """
        out: list[tuple[_Request, list[Block]]] = []
        free = self.max_batch_size - len(self._active)
        budget = self.prefill_token_budget
        computing: set = set()  # first new block of each request admitted this step
        with self._cv:
            while self._waiting:
                req = self._waiting[0]
                if req.future.cancelled():
                    self._waiting.popleft()
                    self.requests_aborted += 1
                    continue
                if req.n > free:
                    break
                chain = self.prefix.match(req.prompt_ids) if self.prefix is not None else []
                new = len(req.prompt_ids) - self._hit(req, chain)
                nxt = self.prefix.next_key(req.prompt_ids, chain) if self.prefix is not None else None
                if out and (new > budget or nxt in computing):
                    break
                self._waiting.popleft()
                out.append((req, chain))
                free -= req.n
                budget -= new
                if nxt is not None:
                    computing.add(nxt)
        return out

    def _hit(self, req: _Request, chain: list[Block]) -> int:
        """Prompt tokens served from the cache: at least the last one is prefilled (its logits start decoding)."""
        return min(len(chain) * self.prefix.block_size, len(req.prompt_ids) - 1) if chain else 0

    def _load_prefixes(self, admitted: list[tuple[_Request, list[Block]]], r0: int) -> list[int]:
        """Copy each admitted request's cached prefix into slot ``r0 + i``; the prompt tokens each hit."""
        for i, (_, chain) in enumerate(admitted):
            if chain:
                self.prefix.load(chain, r0 + i)
        return [self._hit(r, chain) for r, chain in admitted]

    def _place(self, reqs: list[_Request], hits: list[int], r0: int) -> tuple[list[_Sequence], list[int]]:
        """After the prefill forward: count, cache the prompts, and give every choice a slot (choice
        0 its prefill row's, the others copies).  The new sequences in slot order, each one's prefill row."""
        lens = [len(r.prompt_ids) for r in reqs]
        self.prompt_tokens += sum(lens)
        self.prefix_hit_tokens += sum(hits)
        self.prefill_tokens += sum(lens) - sum(hits)
        if self.prefix is not None:  # so the rest of a group (or the next turn) starts from here
            for i, r in enumerate(reqs):
                self.prefix.store(r.prompt_ids, r0 + i, lens[i])
        row_of: dict[int, int] = {}
        new: list[_Sequence] = []
        extra = r0 + len(reqs)
        for i, r in enumerate(reqs):
            for seq in r.seqs:
                if seq.index == 0:
                    seq.slot = r0 + i
                else:
                    seq.slot, extra = extra, extra + 1
                    self._cache.copy_slot(r0 + i, seq.slot, lens[i])
                seq.cached = lens[i]
                seq.epoch = self._epoch
                row_of[id(seq)] = i
                new.append(seq)
        new.sort(key=lambda s: s.slot)
        return new, [row_of[id(s)] for s in new]

    def _prefill(self, admitted: list[tuple[_Request, list[Block]]]) -> None:
        r0 = len(self._active)
        reqs = [r for r, _ in admitted]
        hits = self._load_prefixes(admitted, r0)
        logits = self._prefill_logits(r0, [r.prompt_ids[h:] for r, h in zip(reqs, hits, strict=True)], hits)
        new, rows = self._place(reqs, hits, r0)
        self._active.extend(new)
        self._sample_and_record(new, logits[torch.tensor(rows, device=self.device)])
        self._retire()

    def _decode(self) -> None:
        seqs = self._active
        logits = self._decode_logits(0, [[s.token_ids[-1]] for s in seqs], [s.cached for s in seqs])
        for s in seqs:
            s.cached += 1
        self._sample_and_record(seqs, logits)
        self._retire()

    # ------------------------------------------------------------------ ragged steps

    def _ragged_step(self, admitted: list[tuple[_Request, list[Block]]]) -> None:
        """Decode every running sequence (with its draft tokens) and prefill the admitted requests, in one forward."""
        active = self._active
        segments: list[tuple[int, list[int], int]] = []
        keep: list[int] = []  # flat index of each logits row
        drafts = self.speculation.drafts(active)
        flat = len(active)
        for i, d in enumerate(drafts):
            keep.append(i)
            keep += range(flat, flat + len(d))
            flat += len(d)
        decoded = len(keep)
        r0 = len(active)
        reqs = [r for r, _ in admitted]
        hits = self._load_prefixes(admitted, r0)
        for i, r in enumerate(reqs):
            segments.append((r0 + i, r.prompt_ids[hits[i] :], hits[i]))
            flat += len(r.prompt_ids) - hits[i]
            keep.append(flat - 1)
        logits = self._ragged_logits([(s.token_ids[-1], s.cached) for s in active], drafts, segments, keep)
        new, rows = self._place(reqs, hits, r0)
        seqs = [s for s, d in zip(active, drafts, strict=True) for _ in range(1 + len(d))] + new
        if new:
            logits = torch.cat([logits[:decoded], logits[torch.tensor(rows, device=self.device) + decoded]])
        states = self.speculation.generator_states(active, drafts)
        draw = sample(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs], self._rng)
        rec = Recorder(draw, self.version, self._check_finished, self._detokenize)
        k = self.speculation.keep(active, drafts, rec, states)
        for s in new:
            rec.add(s, k)
            k += 1
        self._active.extend(new)
        self._recorded(rec)
        self._retire()

    # ------------------------------------------------------------------ sampling

    def _sample_and_record(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        draw = sample(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs], self._rng)
        rec = Recorder(draw, self.version, self._check_finished, self._detokenize)
        for k, s in enumerate(seqs):
            rec.add(s, k)
        self._recorded(rec)

    def _recorded(self, rec: Recorder) -> None:
        """Hand each streaming request its step's events (one callback each), then count the tokens."""
        for req, events in rec.streams.values():
            try:
                req.on_tokens(events)
            except Exception:  # the consumer is gone (e.g. its event loop closed): abort
                req.future.cancel()
        now = time.monotonic()
        with self._cv:
            self.total_generated += rec.count
            self._token_times.append((now, rec.count))
            while self._token_times and now - self._token_times[0][0] > 10.0:
                self._token_times.popleft()

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
        self.speculation.learn(done)
        if self.prefix is not None:  # keep what they computed for the next turn, before slots are reused
            for s in done:
                if s.epoch == self._epoch:
                    self.prefix.store(s.request.prompt_ids + s.token_ids, s.slot, s.cached)
        b = len(live)
        occupied = {s.slot for s in live}
        holes = [slot for slot in range(b) if slot not in occupied]
        movers = sorted((s for s in live if s.slot >= b), key=lambda s: s.slot)
        for hole, s in zip(holes, movers, strict=True):
            self._cache.copy_slot(s.slot, hole, s.cached)
            s.slot = hole
        self._active = sorted(live, key=lambda s: s.slot)
        for s in done:
            req = s.request
            if all(x.finish_reason is not None for x in req.seqs) and not req.future.done():
                try:
                    req.future.set_result([self._result(x) for x in req.seqs])
                except concurrent.futures.InvalidStateError:  # cancelled by its client meanwhile
                    pass

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
