"""torch's CPU int8 weight-only matmul, `aten._weight_int8pack_mm`: per-output-channel symmetric
int8 weights (W8A16), activations in their own dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError

_HAS_INT8 = hasattr(torch, "_weight_int8pack_mm")


@dataclass(frozen=True, slots=True)
class Int8CpuWeight:
    """A per-channel int8 weight for `aten._weight_int8pack_mm`: `weight` int8 [N, K] row-major
    (no repacking), `scales` fp32 [N]; w = weight * scales[:, None]."""

    weight: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4


def supports_int8(out_features: int, in_features: int) -> bool:
    """True when `int8_gemm_cpu` can run an [out, in] weight. torch 2.13 needs K % 16 == 0
    (other K crash the process rather than raise)."""
    return _HAS_INT8 and in_features % 16 == 0 and out_features > 0


def int8_unsupported(out_features: int, in_features: int) -> str | None:
    """Why `int8_gemm_cpu` cannot run an [out, in] weight, or None when it can."""
    if supports_int8(out_features, in_features):
        return None
    return f"torch's CPU int8-weight kernel needs K % 16 == 0, not {in_features}"


def repack_int8_cpu(w_int8: torch.Tensor, scales: torch.Tensor) -> Int8CpuWeight:
    """int8 [N, K] symmetric values and per-channel scales [N] or [N, 1] -> `Int8CpuWeight`."""
    n, k = w_int8.shape
    if not supports_int8(n, k) or w_int8.dtype != torch.int8 or scales.numel() != n:
        raise QuantkitError(
            f"torch's CPU int8 kernel needs an int8 [N, K] weight with K % 16 == 0 and N per-channel "
            f"scales (got {w_int8.dtype} [{n}, {k}] and {scales.numel()} scales); use the torch twin."
        )
    return Int8CpuWeight(w_int8.cpu().contiguous(), scales.cpu().float().reshape(n).contiguous())


def int8_gemm_cpu(x: torch.Tensor, weight: Int8CpuWeight) -> torch.Tensor:
    """y = x · (W · s)ᵀ. x [..., K] bf16, fp16 or fp32 (computed in x's dtype, scales cast to
    it); returns [..., N] in x's dtype."""
    n, k = weight.weight.shape
    if x.shape[-1] != k:
        raise QuantkitError(f"int8_gemm_cpu: x has {x.shape[-1]} features, the weight takes {k}.")
    x2 = x.reshape(-1, k).contiguous()
    y = torch._weight_int8pack_mm(x2, weight.weight, weight.scales.to(x2.dtype))
    return y.reshape(*x.shape[:-1], n)
