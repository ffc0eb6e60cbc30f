"""Float linears on the CPU, and whether it computes bf16 natively (`native_bf16`).

bf16: oneDNN's matmul on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile's CPU
  freezing uses), where `F.linear` hands oneDNN the plain layout on every call. Bit-identical to
  `F.linear` in bf16 (tested); smollm2's shapes, one thread: 1.8× at one token, 1.1× at
  64, 1.06× at 2048. Not for fp32, whose oneDNN path rounds differently from `F.linear`.
"""

from __future__ import annotations

import torch

# oneDNN's bf16 reorder needs a CPU with native bf16 support (AVX512-BF16/AMX; not AVX2-only CPUs)
_HAS_PREPACK = (
    hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively through oneDNN (AVX512-BF16 or AMX): bf16 GEMMs are
    then about twice as fast as fp32; on AVX2-only CPUs they are several times slower."""
    return _HAS_PREPACK


def prepack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 CPU weight [N, K] reordered for `bf16_linear`, or None where torch cannot."""
    if not _HAS_PREPACK or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:  # a torch built without oneDNN's bf16 support
        return None


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] bf16 and `prepack_bf16(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
