"""The FP8 block-wise, NVFP4, MXFP4, MXFP8 and 3-bit (`w3a16`) checkpoints on the CPU, by the honest path: each
linear's weight is dequantized once, at load, to the serving dtype (`dequantize_linear`), and
the activations a scheme quantizes are fake-quantized as compressed-tensors does before the
float GEMM (`FloatQDQLinear`): fp8 per token and group of 128 (`fp8-block`), NVFP4 in groups
of 16 under the stored input global scale (`nvfp4`), MX in groups of 32 (`mxfp4`, `mxfp8`).
Weight-only schemes (`nvfp4a16`, `mxfp4a16`, `w3a16`) become plain `nn.Linear`s, which the engine
fuses and prepacks like any float model. No memory is saved over the float model and no fp4 / fp8
/ int3 kernel runs: the GPU kernels are `kernels/fp4` and `kernels/fp8`'s; pack-quantized int
weights of other widths than 4 and 8 bits have no kernel anywhere in quantkit.
`fake_quantize_input` also serves `w4afp8`'s fp8 per-token activations (`PackedInt4Linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.formats import float_quantized, fp4_packed, mx_quantized, pack_quantized
from quantkit.primitives import FP4_MAX, FP8_MAX, dequantize, mx_scale, round_e2m1
from quantkit.scheme import QuantArgs, QuantScheme

FORMATS = ("float-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
NOTE = (
    "{n} {kind} linears are dequantized to {dtype} at load and run as float GEMMs"
    "{acts} (no {kernel} kernel on the CPU; memory as the float model's)."
)


def dequantized(scheme: QuantScheme) -> bool:
    """Whether quantkit runs this scheme's linears dequantized (`FORMATS`, except the per
    channel / per tensor fp8 that `Fp8Linear` computes)."""
    w = scheme.weights
    if scheme.format == "pack-quantized":
        return w.num_bits not in (4, 8)  # int3 etc.: no kernel
    return scheme.format in FORMATS and (scheme.format != "float-quantized" or w.strategy == "block")


def dequantize_linear(tensors: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight, in `dtype`, of one linear's stored tensors (keys without the prefix)."""
    args = scheme.weights
    if scheme.format == "float-quantized":
        return float_quantized.decompress(tensors, args, dtype)
    if scheme.format == "mxfp8-quantized":
        return mx_quantized.decompress(tensors, args, dtype)
    if scheme.format == "pack-quantized":
        q, scale, zero_point, g_idx = pack_quantized.decompress_ints(tensors, args)
        return dequantize(q, scale.float(), zero_point, args, g_idx, dtype)  # as transformers: exact, then rounded
    return fp4_packed.decompress(tensors, args, dtype)


def fake_quantize_input(x: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] quantized and dequantized per token and group of `args.group_size` (a last,
    partial group zero-padded; strategy token: the whole row), returned in x's dtype. As
    compressed-tensors computes it (its `forward_quantize`, what transformers runs): each
    group's amax / grid max is taken in x's dtype; fp8 groups are scaled and rounded in x's
    dtype too, fp4 and MX ones in fp32."""
    shape = x.shape
    group = args.group_size or shape[-1]
    x2 = x.reshape(-1, shape[-1])
    if shape[-1] % group:
        x2 = F.pad(x2, (0, -shape[-1] % group))
    g = x2.unflatten(-1, (-1, group))
    amax = g.abs().amax(dim=-1, keepdim=True)
    if args.is_mx:
        scale = mx_scale(amax.float(), args.num_bits)
    elif args.strategy == "tensor_group":
        gs = global_scale.float()
        s8 = ((amax / FP4_MAX).float() * gs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(s8 == 0, 0.125, s8) / gs
    else:  # fp8 groups (fp8-block's activations), in x's dtype
        scale = amax / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        y = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale
        return y.flatten(-2)[:, : shape[-1]].reshape(shape)
    y = g.float() / scale
    y = round_e2m1(y) if args.is_fp4 else y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (y * scale).flatten(-2)[:, : shape[-1]].reshape(shape).to(x.dtype)


class FloatQDQLinear(nn.Module):
    """A linear whose weight was dequantized at load and whose input is fake-quantized per
    `acts` (see the module docstring); `input_global_scale` for NVFP4 activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool, acts: QuantArgs, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.acts = in_features, out_features, acts
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta"), False) if bias else None
        gs = torch.empty(1, dtype=torch.float32, device="meta") if acts.dynamic == "local" else None
        self.register_buffer("input_global_scale", gs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fake_quantize_input(x, self.acts, self.input_global_scale)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        a = self.acts
        kind = "fp4" if a.is_fp4 else "fp8"
        acts = f"{kind} activations per group of {a.group_size}"
        return f"in={self.in_features}, out={self.out_features}, dequantized weights, {acts}"


def make_linear(linear: nn.Linear, scheme: QuantScheme, dtype: torch.dtype) -> nn.Module:
    """The empty module a dequantized linear of `scheme` loads into."""
    bias = linear.bias is not None
    if scheme.input_activations is None:
        return nn.Linear(linear.in_features, linear.out_features, bias, device="meta", dtype=dtype)
    return FloatQDQLinear(linear.in_features, linear.out_features, bias, scheme.input_activations, dtype)


def load_notes(counts: dict[tuple[str, str | None], int], dtype: torch.dtype) -> list[str]:
    """The engine's notes for the dequantized linears: {(format, activations' kind or None): count}."""
    name = str(dtype).removeprefix("torch.")
    return [
        NOTE.format(
            n=n,
            kind=fmt,
            dtype=name,
            acts=f" on {acts} activations fake-quantized as stored" if acts else "",
            kernel=fmt.split()[-1] if fmt.startswith("pack-quantized") else "fp4/fp8",
        )
        for (fmt, acts), n in counts.items()
    ]


def kind(scheme: QuantScheme) -> tuple[str, str | None]:
    """(format, activations' kind or None): how `load_notes` counts a dequantized linear."""
    a = scheme.input_activations
    if scheme.format == "pack-quantized":
        return f"pack-quantized int{scheme.weights.num_bits}", None
    return scheme.format, None if a is None else f"{'fp4' if a.is_fp4 else 'fp8'} (groups of {a.group_size})"
