"""Round-to-nearest: min-max qparams per group, no calibration data. The baseline
every other algorithm is judged against."""

from __future__ import annotations

import torch

from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs


def quantize_weight(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype = torch.float32):
    """(fake-quantized weight in weight's dtype, scale, zero point or None) of a [out, in] weight."""
    scale, zero_point = compute_qparams(weight, args, scale_dtype)
    return fake_quantize(weight, args, scale, zero_point), scale, zero_point
