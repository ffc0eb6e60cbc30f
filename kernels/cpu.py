"""Float linears on the CPU, whether it computes bf16 natively (`native_bf16`), and memory on 2 MB
pages for the weights a kernel lays out at load (`HugePageArena`, `WEIGHTS`).

bf16: oneDNN's matmul on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile's CPU
  freezing uses), where `F.linear` hands oneDNN the plain layout on every call. Bit-identical to
  `F.linear` in bf16 (tested); smollm2's shapes, one thread: 1.8× at one token, 1.1× at
  64, 1.06× at 2048.
fp32: the same reorder and matmul (`prepack_fp32`), a candidate of `kernels/dense`'s float linear
  for engines that batch sequences: on the Zen 4 EPYC 1.2-2.2× MKL's `F.linear` at 8-64 rows, but
  0.76-1.06× at one row; its sums run in another order than MKL's (fp32 rounding, ~1e-5 relative).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import warnings

import torch

# oneDNN's bf16 reorder needs a CPU with native bf16 support (AVX512-BF16/AMX; not AVX2-only CPUs)
_HAS_PREPACK = (
    hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)
_HAS_FP32_PREPACK = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively through oneDNN (AVX512-BF16 or AMX): bf16 GEMMs are
    then about twice as fast as fp32; on AVX2-only CPUs they are several times slower."""
    return _HAS_PREPACK


def prepack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 CPU weight [N, K] reordered for `packed_linear`, or None where torch cannot."""
    if not _HAS_PREPACK or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:  # a torch built without oneDNN's bf16 support
        return None


def prepack_fp32(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 CPU weight [N, K] reordered for `packed_linear`, or None where torch cannot."""
    if not _HAS_FP32_PREPACK or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:
        return None


def fp32_prepack_available() -> bool:
    """Whether this torch reorders fp32 linear weights for oneDNN (`prepack_fp32`)."""
    return _HAS_FP32_PREPACK


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] and `prepack_bf16(weight)` or `prepack_fp32(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# ---------------------------------------------------------------- weights on 2 MB pages

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20  # the arena's mappings: 16 huge pages each


class HugePageArena:
    """Memory for weights built at load (a kernel's own layout), on 2 MB pages where Linux allows
    them (transparent huge pages with `madvise`, the default of most distributions): anonymous
    mappings of `CHUNK` bytes with MADV_HUGEPAGE, handed out one after another (64-byte
    aligned), so that a model's small weights (smollm2's are 0.2–1.1 MB each) lie in one stream
    of huge pages in the order they are built, which is the order a decode step reads them.

    Why: a decode step streams every weight once; on 4 KB pages the core takes a TLB miss and its
    L2 prefetcher stops at every 4 KB boundary. On 2 MB pages the AVX int4 kernel reads a
    decode step's 66 MB of smollm2 weights 1.13× (AVX2) to 1.32× (AVX-512) faster; torch's fp32
    GEMV gains ~1% (docs/benchmarks.md), so the float weights are left where they are.

    A mapping is freed when no tensor in it is left; the arena holds the current one (at most
    `CHUNK` bytes of address space; only pages written to take memory). Where the pages cannot
    be asked for (not Linux, or QUANTKIT_HUGE_PAGES=0), `copy` returns its argument (contiguous)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk, self._lock = chunk, threading.Lock()
        self._buffer: torch.Tensor | None = None  # uint8 view of the current mapping
        self._used = 0

    @staticmethod
    def available() -> bool:
        return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("QUANTKIT_HUGE_PAGES", "1") != "0"

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._buffer is None or self._used + nbytes > self._buffer.numel():
                self._buffer, self._used = _huge_mapping(max(self.chunk, nbytes)), 0
            start = self._used
            self._used = -(-(start + nbytes) // 64) * 64
            return self._buffer[start : start + nbytes]

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor `t` in the arena (`t.contiguous()` where it cannot be made)."""
        if not self.available() or t.device.type != "cpu" or t.numel() == 0:
            return t.contiguous()
        out = self._take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


WEIGHTS = HugePageArena()  # the kernels' layouts built at load (`WEIGHTS.copy(layout)`)


def _huge_mapping(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes rounded up to 2 MB], starting on a 2 MB boundary, in an anonymous mapping
    (zeros) with MADV_HUGEPAGE (a huge page needs an aligned 2 MB of the mapping, and Linux
    aligns only some mappings: one page more is mapped, and the aligned part handed out). The
    tensor keeps the mapping alive; it is unmapped with the last tensor over it."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    with warnings.catch_warnings():  # "non-writable buffer": an anonymous mapping is writable
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer[start : start + size]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on the CPU in a mapping of its own on 2 MB pages where
    Linux allows (as `HugePageArena`): for the KV cache, which a decode step streams block by block
    from scattered places. On 4 KB pages each 48 KB block (smollm2, fp32, 64 tokens) crosses 12
    page boundaries, where the core takes a TLB miss and its L2 prefetcher stops: smollm2's fp32
    decode attention at 64 sequences takes 0.95x the time on 2 MB pages (67.2 -> 63.9 CPU ms a
    step on the Zen 4, `benchmarks/attention.py --part decode-fp32`). Every page is taken here, as
    torch.zeros does: taken on first write while serving, a huge-page fault can stall in the
    kernel's compaction, which cost the engine 4% of its bf16 throughput on the AMX Xeon
    (`benchmarks/ab_bench.sh`, 2026-12-06; 1.03x torch.zeros' once the pages are taken here)."""
    device, nbytes = torch.device(device), math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not HugePageArena.available():
        return torch.zeros(shape, dtype=dtype, device=device)
    out = _huge_mapping(nbytes)
    out.zero_()  # take every page now, as torch.zeros does, not while serving
    return out[:nbytes].view(dtype).view(shape)
