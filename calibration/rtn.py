"""Round-to-nearest: min-max qparams per group, no calibration data. The baseline
every other algorithm is judged against. NVFP4 weights take a global scale shared by
each fusion group, and NVFP4 activations (`nvfp4`) a global scale calibrated per pass
(`calibration/fp4.py`)."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calibration import fp4
from quantkit.calibration.hooks import targets, weight_args
from quantkit.calibration.method import QParams
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import compute_qparams, fake_quantize
from quantkit.scheme import QuantArgs, QuantScheme


def quantize_weight(
    weight: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
):
    """(fake-quantized weight in weight's dtype, scale, zero point or None) of a [out, in] weight."""
    scale, zero_point = compute_qparams(weight, args, scale_dtype, global_scale)
    return fake_quantize(weight, args, scale, zero_point), scale, zero_point


def rtn_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log=None):
    """Runner step: round every targeted linear of a block to nearest (no calibration data,
    except for NVFP4 activations' global scales)."""

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        block_spec = spec.for_block(block)
        names = targets(scheme, prefix, block_spec.linears)
        shared = fp4.weight_global_scales(block_spec, scheme, prefix, block, names)
        for name in names:
            linear = get_module(block, name)
            w, scale, zero = quantize_weight(
                linear.weight.data, weight_args(scheme, prefix, name), scale_dtype, shared.get(name)
            )
            linear.weight.data.copy_(w)  # in place: see quantkit.malloc
            results[f"{prefix}.{name}"] = QParams(scale, zero, global_scale=shared.get(name))
        fp4.record_input_global_scales(block_spec, scheme, prefix, block, names, inputs, results)

    return step
