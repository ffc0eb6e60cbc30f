"""Round-to-nearest: min-max qparams per group, no calibration data. The baseline
every other algorithm is judged against."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calibration.hooks import targets, weight_args
from quantkit.calibration.method import QParams
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs, QuantScheme


def quantize_weight(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype = torch.float32):
    """(fake-quantized weight in weight's dtype, scale, zero point or None) of a [out, in] weight."""
    scale, zero_point = compute_qparams(weight, args, scale_dtype)
    return fake_quantize(weight, args, scale, zero_point), scale, zero_point


def rtn_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log=None):
    """Runner step: round every targeted linear of a block to nearest (no calibration data)."""

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        for name in targets(scheme, prefix, spec.for_block(block).linears):
            linear = get_module(block, name)
            w, scale, zero = quantize_weight(linear.weight.data, weight_args(scheme, prefix, name), scale_dtype)
            linear.weight.data.copy_(w)  # in place: see quantkit.malloc
            results[f"{prefix}.{name}"] = QParams(scale, zero)

    return step
