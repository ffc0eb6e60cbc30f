"""SmoothQuant-style outlier migration for W8A8 (Xiao et al., ICML 2023): per input
channel, divide the activations by s and multiply the weights by s, with
s = max|x|^α / max|W|^(1-α), so activation outliers move into the weights where
per-channel scales absorb them. α is searched on a grid against the output error of
the quantized matmul; s = 1 (no smoothing) is always a candidate, so the search never
loses to plain quantization on its inputs. `search_smooth_scales` is the math;
`smooth_step` runs it on a block before the weight method (`awq.fold_scales` applies s)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration.awq import fold_scales
from quantkit.calibration.hooks import mapping_input, mapping_inputs, mappings, scaled_inputs, targets
from quantkit.errors import QuantkitError
from quantkit.models.arch import ArchSpec
from quantkit.primitives import fake_quantize
from quantkit.scheme import QuantArgs, QuantScheme


@dataclass(slots=True)
class SmoothResult:
    scales: torch.Tensor  # [ci], fp32; ones when smoothing did not help
    alpha: float | None  # None: s = 1 won
    loss: float
    plain_loss: float  # s = 1


def search_smooth_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    w_args: QuantArgs,
    x_args: QuantArgs,
    grid: int = 10,
    name: str = "linears",
) -> SmoothResult:
    """Scales for the linears `weights` [co_i, ci] that all read x [n, ci], minimising the
    MSE of Q(x / s) · Q(W·s)ᵀ against x · Wᵀ over α ∈ {0, 1/grid, ..., 1}."""
    if not torch.isfinite(x).all():
        raise QuantkitError(f"the calibration activations of {name} contain NaN or inf; try other calibration text.")
    x = x.float()  # x [n, ci]
    W = torch.cat([w.float() for w in weights])  # W [co, ci]
    ref = x @ W.t()  # [n, co]
    x_max = x.abs().amax(0).clamp_min(1e-5)  # [ci]
    w_max = W.abs().amax(0).clamp_min(1e-5)  # [ci]

    def loss(s: torch.Tensor) -> float:
        y = fake_quantize(x / s, x_args) @ fake_quantize(W * s, w_args).t()
        return (y - ref).pow(2).mean().item()

    plain = loss(torch.ones_like(x_max))
    best = SmoothResult(torch.ones_like(x_max), None, plain, plain)
    for i in range(grid + 1):
        alpha = i / grid
        s = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp_min(1e-5)
        value = loss(s)
        if value < best.loss:
            best = SmoothResult(s, alpha, value, plain)
    return best


SEARCH_TOKENS = 2048  # captured inputs per sequential group that α is scored on


def smooth_step(spec: ArchSpec, scheme: QuantScheme, options, results: dict, scale_dtype, log: Callable | None = None):
    """Runner step: for every mapping of the architecture table whose shapes allow it,
    search s on the block's calibration inputs and fold it into the previous op and the
    linears (the float function is unchanged); records no qparams."""

    def step(index: int, prefix: str, block: nn.Module, inputs) -> None:
        bspec = spec.for_block(block)
        names = targets(scheme, prefix, bspec.linears)
        feats = mapping_inputs(bspec, block, names, inputs, SEARCH_TOKENS)
        for b in mappings(bspec, block, names):
            m, linears = b.mapping, b.linears
            x = feats[mapping_input(bspec, m)]
            r = search_smooth_scales(
                x,
                [lin.weight.data for lin in linears],
                scheme.weights,
                scheme.input_activations,
                options.grid,
                name=f"{prefix}.{m.prev}",
            )
            weights = [lin.weight.data for lin in linears] + b.readers
            fold_scales(b.prev_weight, b.prev_bias, weights, r.scales, b.offset)
            scaled_inputs(bspec, feats, m, r.scales)

    return step
