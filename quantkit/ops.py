"""The one place that chooses a kernel: `backend="auto"|"torch"` (Triton kernels join
here as they land). Nothing else calls a kernel directly."""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import reference

BACKENDS = ("auto", "torch")


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise QuantkitError(f"backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}.")


def int4_gemm(x, w_packed, scales, zeros, group_size, g_idx=None, backend: str = "auto") -> torch.Tensor:
    """W4A16 matmul; see `quantkit.kernels.reference.int4_gemm` for shapes and dtypes."""
    _check(backend)
    return reference.int4_gemm(x, w_packed, scales, zeros, group_size, g_idx)


def fp8_gemm(x, w_fp8, w_scale, x_scale=None, backend: str = "auto") -> torch.Tensor:
    """W8A8 fp8 matmul; see `quantkit.kernels.reference.fp8_gemm` for shapes and dtypes."""
    _check(backend)
    return reference.fp8_gemm(x, w_fp8, w_scale, x_scale)
