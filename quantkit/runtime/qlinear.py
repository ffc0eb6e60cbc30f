"""Linear modules that hold packed weights as they are on disk and compute through
`quantkit.ops`."""

from __future__ import annotations

import torch
from torch import nn

from quantkit import ops
from quantkit.formats import float_quantized, pack_quantized
from quantkit.scheme import QuantArgs


class PackedInt4Linear(nn.Module):
    """A linear with compressed-tensors `pack-quantized` int4 weights (buffers named
    as in the checkpoint, so its state dict loads as is)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, args: QuantArgs, dtype: torch.dtype):
        super().__init__()
        if args.num_bits != 4:
            raise ValueError("PackedInt4Linear holds 4-bit weights only")
        self.in_features, self.out_features, self.args = in_features, out_features, args
        info = pack_quantized.param_info(out_features, in_features, args, dtype)
        for name, (shape, dt) in info.items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.weight_zero_point = getattr(self, "weight_zero_point", None)
        self.weight_g_idx = getattr(self, "weight_g_idx", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None
        self._cpu_weight = None  # torch's int4pack layout, built on the first bf16 call on the CPU
        self._zeros = None  # the unpacked zero points, built on the first call

    def zeros(self) -> torch.Tensor | None:
        if self.weight_zero_point is None:
            return None
        if self._zeros is None or self._zeros.device != self.weight_zero_point.device:
            self._zeros = pack_quantized.unpack(self.weight_zero_point, self.out_features, 4, dim=0)
        return self._zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.args.group_size if self.args.strategy == "group" else None
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:  # torch's fast CPU path needs bf16
            if self._cpu_weight is None:
                self._cpu_weight = ops.int4_cpu_weight(self.weight_packed, self.weight_scale, self.zeros(), group,
                                                       self.weight_g_idx) or False
            if self._cpu_weight:
                y = ops.int4_gemm_cpu(x, self._cpu_weight)
                return y if self.bias is None else y + self.bias.to(y.dtype)
        y = ops.int4_gemm(x, self.weight_packed, self.weight_scale, self.zeros(), group, self.weight_g_idx)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        a = self.args
        return f"in={self.in_features}, out={self.out_features}, int4 {a.strategy} {a.group_size or ''} sym={a.symmetric}"


class Fp8Linear(nn.Module):
    """A linear with compressed-tensors `float-quantized` fp8 weights; activations are
    quantized to fp8 per token at run time (dynamic) or with the stored `input_scale`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, args: QuantArgs, static_input: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.args = in_features, out_features, args
        for name, (shape, dt) in float_quantized.param_info(out_features, in_features, args, static_input).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.input_scale = getattr(self, "input_scale", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.fp8_gemm(x, self.weight, self.weight_scale, self.input_scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        kind = "static" if self.input_scale is not None else "dynamic per-token"
        return f"in={self.in_features}, out={self.out_features}, fp8 {self.args.strategy} weights, {kind} activations"
