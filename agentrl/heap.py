"""The C heap of a process that computes on the CPU: keep freed buffers for reuse, within a bound.

glibc's defaults cost a CPU engine or trainer dearly.  Every buffer over its mmap threshold
(128 KiB, raised by itself up to 32 MiB) is a fresh mapping, zero-filled page by page on first
touch, and the heap top is trimmed after frees, so a process that allocates the same sizes
every step pays those page faults every step.  :func:`keep_freed_memory` raises the threshold
once (256 MiB) so freed buffers are reused.

A trainer's buffers change shape with every batch (micro-batches are packed to the data), so
freed space left between live chunks can pile up: with glibc's defaults a SmolLM2-135M run
grew ~600 MB per step until the OOM killer ended it.  Returning every free page after every
step (``malloc_trim(0)``) bounded it but made each step fault its whole working set in again
(SmolLM2-135M, one thread: ~420,000 faults and 1-2 s of system time a step, a third of a bf16
step).  :class:`HeapBudget` trims only when the resident size after a step exceeds the live
set plus twice the working set of the first step after the last trim (between steps; within
a step the peak can exceed that by a working set).

Steps run in worker threads (``asyncio.to_thread``), and each thread that allocates gets an
arena of its own, where freed buffers are not reused by the next step's thread and a chunk
over 64 MiB is always a fresh mapping: ``single_arena`` makes every thread share the main
arena.  It only binds threads that have not allocated yet, so the CLI's ``run`` and ``sft``
set it first thing.

Where the C library is not glibc, everything here is a no-op.  Where ``/proc/self/status`` is
absent, or the user set glibc's malloc variables (``MALLOC_*``, ``GLIBC_TUNABLES``: they are
left as they are), every step trims, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "GLIBC_TUNABLES")  # fmt: skip
MIN_KEPT = 64 << 20  # a working set measured near zero would make every step trim on noise


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # the process's own symbols first: find_library needs ldconfig or a compiler at run time
    for name in (None, ctypes.util.find_library("c")):
        try:
            libc = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt"):
            return libc
    return None


def keep_freed_memory(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30,
                      single_arena: bool = False) -> bool:  # fmt: skip
    """Let glibc reuse freed memory instead of returning it to the OS (module docstring).

    The cost is that the process keeps its peak heap.  False where the C library is not glibc
    (or refuses), or where the user set glibc's malloc variables.  ``single_arena``: threads
    that have not allocated yet share the main arena (module docstring)."""
    libc = _libc()
    if libc is None or any(name in os.environ for name in _USER_SETTINGS):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc 2.34 and older refuse a threshold over 32 MiB, so 32 MiB there.  Any of these calls
    # stops glibc raising its threshold by itself, so the trim and pad are never set without a
    # threshold: alone they would leave every tensor over 128 KiB a fresh mmap
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) or mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 32 << 20))):
        return False
    done = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold)) & bool(mallopt(_M_TOP_PAD, 64 << 20))
    return done & bool(mallopt(_M_ARENA_MAX, 1)) if single_arena else done


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS (``malloc_trim(0)``); True if anything was released."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def resident_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), None)
    except OSError:
        return None


class HeapBudget:
    """Call :meth:`after_step` after each CPU optimizer step: it trims the heap only past a bound.

    After a trim the resident size is the live set L; the next step leaves L + W (W: that
    step's freed working set, kept for reuse); later steps trim once the resident size passes
    ``limit`` = L + max(2W, :data:`MIN_KEPT`).  So between steps the process stays under its
    live set plus twice a step's working set, and steps of shapes it has seen fault no pages in."""

    def __init__(self) -> None:
        self.enabled = keep_freed_memory(single_arena=True)
        self.live: int | None = None  # resident bytes right after the last trim
        self.limit: int | None = None  # set by the first step after a trim
        self.trims = 0

    def after_step(self) -> bool:
        """Trim if the bound is passed (or nothing is measured yet); True if this call trimmed."""
        if self.enabled and self.live is not None and (rss := resident_bytes()) is not None:
            if self.limit is None:
                self.limit = self.live + max(2 * (rss - self.live), MIN_KEPT)
                return False
            if rss <= self.limit:
                return False
        release_free_memory()
        self.trims += 1
        self.live, self.limit = resident_bytes(), None
        return True
