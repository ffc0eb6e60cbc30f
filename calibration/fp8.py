"""FP8 e4m3 weights (amax / 448 per output channel, per tensor, per 128x128 block or, MXFP8,
a power of two per group of 32) and, for static
activations, a per-tensor input scale from the max |x| each linear sees on the
calibration set, observed after the block's weights are quantized."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantkit.calibration.hooks import input_amax, targets, weight_args
from quantkit.calibration.method import QParams
from quantkit.calibration.registry import static_activations
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import FP8_MAX, compute_qparams, fake_quantize
from quantkit.scheme import QuantScheme


def fp8_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log: Callable | None = None):
    """Runner step: quantize every targeted linear's weight to fp8 and, for static
    activations, record each linear's input scale."""

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        names = targets(scheme, prefix, spec.for_block(block).linears)
        for name in names:
            linear = get_module(block, name)
            args = weight_args(scheme, prefix, name)
            # block scales in the checkpoint's dtype, as llm-compressor stores them (transformers reads them so)
            scale, _ = compute_qparams(
                linear.weight.data, args, scale_dtype if args.strategy == "block" else torch.float32
            )
            linear.weight.data.copy_(fake_quantize(linear.weight.data, args, scale))
            results[f"{prefix}.{name}"] = QParams(scale)
        if static_activations(scheme):
            amax = input_amax(block, {f"{prefix}.{n}": get_module(block, n) for n in names}, inputs)
            for full, value in amax.items():
                results[full].input_scale = (value.clamp_min(1e-12) / FP8_MAX).reshape(1)

    return step
