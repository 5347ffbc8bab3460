"""Decode attention over the slot cache on a CPU, in a small C kernel built on first use.

A ragged step's decode rows each bring one query token (plus their draft tokens) against
their own slot's keys.  torch has no call for that shape: SDPA (and ``bmm``) run one tiny
matrix product per (row, head), ~3-4 µs of fixed cost each, so on the tiny model (4 layers,
64 rows) attention was ~1.1 ms a layer and half of a decode step, ~7x what its arithmetic and
memory traffic need; on SmolLM2-135M it was ~1.3 ms of a layer's ~8 ms.  The kernel here
reads each row's keys and values once, in order, for all the query heads that share them
(grouped-query attention) and all the row's queries (its decode token and drafts), and
computes the softmax in float32 as SDPA's CPU kernel does (float32 results differ by summation
order only, relative ~1e-6).

The C source below is compiled with the system's C compiler (``$CC`` or ``cc``) for this
CPU (``-march=native``) into a private cache directory (``$XDG_CACHE_HOME/agentrl/kernels``,
mode 0700, keyed by the source, the compiler and the CPU) and loaded with ctypes, which drops
the GIL during the call.  No compiler, a failed build, or a cache directory that another user
could write to: :func:`kernel` returns None with the reason in :func:`unavailable_reason`,
and the engine keeps SDPA.

Covered: float32 or bf16 queries, keys and values (bf16 widened to float32 and computed there,
the attention weights included, the output rounded once) with a contiguous last dimension, causal attention with
an optional sliding window, the default or the model's own scaling.  Anything else
(softcapping, attention sinks, dropout, float16) stays with the model's own attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentrl.auth import check_private_path

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* e^x for x <= 0 (0 below -87): Cody-Waite reduction and a degree-7 polynomial, ~1 ulp.
   Written out so the compiler vectorizes the softmax loop (libm's expf is a call per lane). */
static inline float exp_nonpos(float x) {
    x = fmaxf(x, -88.0f);  /* keeps n in int range (-inf included); the result is 0 there anyway */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t)n + 127;
    union { int32_t i; float f; } s;
    s.i = (e > 0 ? e : 1) << 23;
    return x < -87.0f ? 0.0f : p * s.f;  /* NaN stays NaN, as in SDPA */
}

/* bf16 is the top half of a float32: widening is a shift; narrowing rounds to nearest even */
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays a quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* element i of a float32 (bf = 0) or bf16 (bf = 1) array */
static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Rows r in [r_begin, r_end): slot slot0 + r; its queries are the flat tokens index[r, t] at
   positions pos[r, t] (t < t_max; padding repeats a real query, which writes the same output).
   A query at position p sees its slot's keys j with lo <= j <= p, lo = p - window + 1 (window
   > 0) or 0.  q[token, head, d], out[token, head, d]; k and v [slot, kv_head, position, d];
   strides in elements, the last dimension contiguous; all float32, or all bf16 (computed in
   float32, the output rounded once).  Returns 0, or 1 when out of memory. */
static inline __attribute__((always_inline))
int attend(const void *restrict q, int64_t q_tok, int64_t q_head,
           const void *restrict k, const void *restrict v, int64_t c_slot, int64_t c_head, int64_t c_pos,
           void *restrict out, int64_t o_tok, int64_t o_head,
           const int64_t *index, const int64_t *pos, int64_t t_max, int64_t slot0,
           int64_t r_begin, int64_t r_end, int64_t heads, int64_t kv_heads, const int64_t dim,
           int64_t window, float scale, const int bf) {
    const int64_t size = bf ? 2 : 4;
    int64_t group = heads / kv_heads, span = 1;
    for (int64_t r = r_begin; r < r_end; r++)
        for (int64_t t = 0; t < t_max; t++)
            if (pos[r * t_max + t] + 1 > span) span = pos[r * t_max + t] + 1;
    float *restrict row = (float *)malloc(sizeof(float) * (size_t)(span + 2 * dim));
    if (!row) return 1;
    float *restrict acc = row + span, *restrict qv = acc + dim;
    for (int64_t r = r_begin; r < r_end; r++)
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            int64_t kv0 = (slot0 + r) * c_slot + kh * c_head;  /* this (row, head)'s first element */
            /* the next (row, head)'s keys and values are fetched while this one computes: each
               block is a few KB, too short for the hardware prefetcher to reach full speed */
            int64_t nr = kh + 1 < kv_heads ? r : r + 1, nh = kh + 1 < kv_heads ? kh + 1 : 0;
            const char *nk = (const char *)k + ((slot0 + nr) * c_slot + nh * c_head) * size;
            const char *nv = (const char *)v + ((slot0 + nr) * c_slot + nh * c_head) * size;
            int fetch = nr < r_end;
            /* one query at a time: its keys stay in L1/L2 for the next query of the same K/V head */
            for (int64_t t = 0; t < t_max; t++) {
                int64_t p = pos[r * t_max + t];
                int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
                for (int64_t g = 0; g < group; g++) {
                    int64_t q0 = index[r * t_max + t] * q_tok + (kh * group + g) * q_head;
                    for (int64_t d = 0; d < dim; d++) qv[d] = ld(q, q0 + d, bf);
                    float m = -INFINITY;
                    for (int64_t j = lo; j <= p; j++) {
                        int64_t kj = kv0 + j * c_pos;
                        if (fetch) {
                            for (int64_t b = 0; b < dim * size; b += 64) {
                                __builtin_prefetch(nk + j * c_pos * size + b, 0, 2);  /* into L2: L1 prefetches measured slower */
                                __builtin_prefetch(nv + j * c_pos * size + b, 0, 2);
                            }
                        }
                        float s = 0.0f;
                        #pragma omp simd reduction(+:s)
                        for (int64_t d = 0; d < dim; d++) s += qv[d] * ld(k, kj + d, bf);
                        s *= scale;
                        row[j] = s;
                        m = s > m ? s : m;
                    }
                    fetch = 0;
                    float sum = 0.0f;
                    #pragma omp simd reduction(+:sum)
                    for (int64_t j = lo; j <= p; j++) { float e = exp_nonpos(row[j] - m); row[j] = e; sum += e; }
                    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
                    for (int64_t j = lo; j <= p; j++) {
                        int64_t vj = kv0 + j * c_pos;
                        float w = row[j];
                        #pragma omp simd
                        for (int64_t d = 0; d < dim; d++) acc[d] += w * ld(v, vj + d, bf);
                    }
                    float inv = 1.0f / sum;
                    int64_t o0 = index[r * t_max + t] * o_tok + (kh * group + g) * o_head;
                    if (bf) {
                        for (int64_t d = 0; d < dim; d++) ((uint16_t *)out)[o0 + d] = to_bf16(acc[d] * inv);
                    } else {
                        #pragma omp simd
                        for (int64_t d = 0; d < dim; d++) ((float *)out)[o0 + d] = acc[d] * inv;
                    }
                }
            }
        }
    free(row);
    return 0;
}

/* the head size and the element type as constants where the head size is a common one: the
   per-key loops unroll and each type gets its own code */
int decode_attention(const void *q, int64_t q_tok, int64_t q_head,
                     const void *k, const void *v, int64_t c_slot, int64_t c_head, int64_t c_pos,
                     void *out, int64_t o_tok, int64_t o_head,
                     const int64_t *index, const int64_t *pos, int64_t t_max, int64_t slot0,
                     int64_t r_begin, int64_t r_end, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t window, float scale, int64_t bf16) {
#define ATTEND(D, BF) attend(q, q_tok, q_head, k, v, c_slot, c_head, c_pos, out, o_tok, o_head, index, pos, \
                             t_max, slot0, r_begin, r_end, heads, kv_heads, D, window, scale, BF)
    if (bf16) {
        switch (dim) {
            case 32: return ATTEND(32, 1);
            case 64: return ATTEND(64, 1);
            case 128: return ATTEND(128, 1);
            default: return ATTEND(dim, 1);
        }
    }
    switch (dim) {
        case 32: return ATTEND(32, 0);
        case 64: return ATTEND(64, 0);
        case 128: return ATTEND(128, 0);
        default: return ATTEND(dim, 0);
    }
}
"""

DTYPES = (torch.float32, torch.bfloat16)  # what the kernel takes (bf16 is computed in float32)
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno"]
_lock = threading.Lock()
_lib: Any = None
_reason: str | None = None  # why the kernel is unavailable, once a build was tried
_tried = False
_executor: ThreadPoolExecutor | None = None
MIN_ROWS_PER_THREAD = 8  # fewer rows per thread than this: the hand-off costs more than it saves


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentrl" / "kernels"


def _cpu_key() -> str:
    """The CPU's model and instruction sets (``-march=native`` code runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700); refuse it where another user could write to it (:func:`agentrl.auth.check_private_path`)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_path(path)


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "")) or [next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), "")]
    if not cc[0]:
        raise FileNotFoundError("no C compiler (cc, gcc or clang; or set CC)")
    return cc


def _build(cc: list[str], lib: Path) -> None:
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, built = Path(tmp) / "decode_attention.c", Path(tmp) / "decode_attention.so"
        src.write_text(_SOURCE)
        done = subprocess.run([*cc, *_FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        os.replace(built, lib)  # atomic: a concurrent build of the same key writes the same bytes


def _load(lib: Path) -> Any:
    """Load ``lib`` if it is a plain file of ours that nobody else can write (not a link).  Its
    directory and every one above were checked (:func:`agentrl.auth.check_private_path`): nobody else can swap it."""
    st = os.lstat(lib)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{lib} is not a file only this user can write")
    return ctypes.CDLL(str(lib))


def _open() -> Any:
    cc = _compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_FLAGS), version, _cpu_key()]).encode()).hexdigest()[:20]
    root = _cache_root()
    _private_dir(root)
    lib = root / f"decode_attention-{key}.so"
    if not lib.exists():
        _build(cc, lib)
    try:
        return _load(lib)
    except OSError:  # a truncated or corrupt file from an interrupted copy: build it again, once
        _build(cc, lib)
        return _load(lib)


def kernel() -> Any:
    """The loaded kernel (a ctypes function), building it on first use; None where it cannot be
    built or loaded (:func:`unavailable_reason` says why)."""
    global _lib, _reason, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                if sys.platform == "win32":
                    raise OSError("not built on Windows")
                fn = _open().decode_attention
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64,
                               i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]  # fmt: skip
                fn.restype = ctypes.c_int
                _lib = fn
            except Exception as exc:  # no compiler, a failed build, an unsafe cache: SDPA stays
                _reason = f"{type(exc).__name__}: {exc}"
            _tried = True
    return _lib


def unavailable_reason() -> str | None:
    return _reason


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Can :func:`attend` take these tensors: on a CPU, all float32 or all bf16, last dimension
    contiguous, one head size, keys and values laid out alike?"""
    return (query.dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == query.dtype and t.stride(-1) == 1
                                          for t in (query, key, value))
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and key.stride() == value.stride())  # fmt: skip


def _forget_pool() -> None:
    global _executor
    _executor = None  # a forked child has none of its threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool(workers: int) -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None or _executor._max_workers < workers:
            _executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentrl-attention")
        return _executor


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, index: torch.Tensor,
           positions: torch.Tensor, slot0: int, window: int | None, scale: float) -> None:  # fmt: skip
    """Write ``out[token, head]`` for the queries ``query[token, head]`` named by ``index`` ``[R, T]``
    (int64; padding repeats a row's query), at ``positions`` ``[R, T]``, over slot ``slot0 + r``'s
    keys and values (``key``/``value`` ``[slots, kv_heads, columns, dim]``, the same strides):
    causal, within ``window`` positions when given.

    With more than one torch thread the rows are split across that many threads (ctypes drops
    the GIL; torch's own threads are idle meanwhile)."""
    fn = kernel()
    if (fn is None or not supported(query, key, value) or out.dtype != query.dtype or out.stride(-1) != 1
            or index.dtype != torch.int64 or positions.dtype != torch.int64):  # fmt: skip
        raise ValueError("decode_attention: the kernel is unavailable or does not cover these tensors (see supported())")
    index, positions = index.contiguous(), positions.contiguous()
    rows, t_max = index.shape
    heads, dim = query.shape[1], query.shape[2]

    def run(r0: int, r1: int) -> int:
        return fn(query.data_ptr(), query.stride(0), query.stride(1),
                  key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
                  out.data_ptr(), out.stride(0), out.stride(1), index.data_ptr(), positions.data_ptr(), t_max, slot0,
                  r0, r1, heads, key.shape[1], dim, window or 0, scale, int(query.dtype == torch.bfloat16))  # fmt: skip

    threads = min(torch.get_num_threads(), rows // MIN_ROWS_PER_THREAD)
    if threads <= 1:
        status = run(0, rows)
    else:
        cuts = [rows * i // threads for i in range(threads + 1)]
        futures = [_pool(threads - 1).submit(run, cuts[i], cuts[i + 1]) for i in range(1, threads)]
        status = max([run(cuts[0], cuts[1]), *(f.result() for f in futures)])
    if status != 0:
        raise MemoryError("decode_attention: out of memory for its score buffer")
