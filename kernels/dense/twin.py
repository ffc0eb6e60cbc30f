"""The twin of the float linear: torch's own `F.linear` (MKL's fp32 GEMM on the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · weightᵀ (+ bias) for x [..., K] and weight [N, K]."""
    return F.linear(x, weight, bias)
