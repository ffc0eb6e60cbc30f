"""glibc's malloc, set for the job at hand (process-wide, like preloading tcmalloc).

glibc serves a large allocation from its own mmap and unmaps it when freed, but only
above a threshold that starts at 128 KiB and rises (up to 32 MiB) each time such a block
is freed; below it blocks come from the heap, where freed memory stays resident until
it is reused or trimmed.

- The engine allocates the same large tensors every step: `keep_freed_memory` keeps them
  in the process, or each step's activations and gathered K/V blocks come back as fresh
  pages that fault in on first touch (up to half a step's time, measured).
- Calibration keeps the heap for its activations (unmapping them on every free costs
  page faults: a forward of smollm2-sized blocks ran 15-25% slower with a fixed 1 MiB
  threshold), writes quantized weights into the weights' own storage (new long-lived
  tensors would leave holes behind: on a 1.1B model under round-to-nearest, 0.93 GiB of
  freed heap stayed resident after 22 blocks) and calls `trim_freed_memory` after
  loading and after each block.

Each returns False where libc is not glibc (nothing is changed there).
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Serve blocks below 32 MiB from the heap and trim its top only past 1 GiB free."""
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def trim_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS now (`malloc_trim(0)`, which also releases
    whole free pages inside the heap, not only at its top)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
