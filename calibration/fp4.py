"""The NVFP4 global scales that vLLM needs shared: where it fuses linears into one GEMM (q/k/v
into qkv_proj, gate/up into gate_up_proj, an expert's gate/up into w13) it keeps one weight
global scale (and one input global scale) per fused layer, taking the first member's or
the smallest and warning that "the global scale for input or weight are different for
parallel layers" / "w1_weight_global_scale must match w3_weight_global_scale"; for all the
experts of a MoE layer it takes one input global scale (the smallest: `w13_input_global_scale.min()`).
So the weight global scale is computed once per fusion group (an `ArchSpec.sequential`
group: q/k/v, gate/up, each expert's gate/up) from the group's largest |w|, and the input
global scale once per pass (`ArchSpec.stages`: q/k/v, o, gate/up of every expert and the
shared one, every down) from the largest |x| any of its linears sees on the calibration text.
A shared scale is the smallest of the members' own (448 · 6 / the largest amax), so no
member's group scales overflow fp8."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.calibration.hooks import input_amax, weight_args
from quantkit.models.arch import ArchSpec, get_module
from quantkit.primitives import nvfp4_global_scale
from quantkit.scheme import QuantScheme


def _nvfp4(scheme: QuantScheme, prefix: str, name: str) -> bool:
    return weight_args(scheme, prefix, name).strategy == "tensor_group"


def weight_global_scales(spec: ArchSpec, scheme: QuantScheme, prefix: str, block: nn.Module, names) -> dict:
    """name -> the float32 [1] weight global scale of each NVFP4 linear of `names` (inside
    the block at `prefix`), shared by its fusion group."""
    out = {}
    for group in spec.sequential:
        members = [n for n in group if n in names and _nvfp4(scheme, prefix, n)]
        if members:
            amax = torch.stack([get_module(block, n).weight.detach().abs().amax().float() for n in members]).max()
            out |= dict.fromkeys(members, nvfp4_global_scale(amax))
    return out


def static_nvfp4_inputs(scheme: QuantScheme, prefix: str, names) -> list[str]:
    """The linears of `names` whose NVFP4 activations take a calibrated global scale (`nvfp4`)."""
    out = []
    for name in names:
        acts = scheme.scheme_for(f"{prefix}.{name}").input_activations
        if acts is not None and acts.strategy == "tensor_group" and acts.dynamic == "local":
            out.append(name)
    return out


def input_global_scales(spec: ArchSpec, prefix: str, block: nn.Module, names, inputs) -> dict:
    """name -> the float32 [1] input global scale of each linear of `names`, shared by its
    pass (all the experts of a MoE layer together), from the calibration inputs' largest |x|."""
    amax = input_amax(block, {n: get_module(block, n) for n in names}, inputs)
    out = {}
    for stage in spec.stages:
        members = [n for group in stage for n in group if n in amax]
        if members:
            out |= dict.fromkeys(members, nvfp4_global_scale(torch.stack([amax[n] for n in members]).max()))
    return out


def record_input_global_scales(spec: ArchSpec, scheme: QuantScheme, prefix: str, block, names, inputs, results) -> None:
    """After a block's weights are quantized: the input global scale of each of its NVFP4
    linears with calibrated activations (`nvfp4`) into its `QParams.input_scale`."""
    static = static_nvfp4_inputs(scheme, prefix, names)
    if static:
        for name, gs in input_global_scales(spec, prefix, block, static, inputs).items():
            results[f"{prefix}.{name}"].input_scale = gs
