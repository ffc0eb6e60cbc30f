"""Linear modules that hold packed weights as they are on disk and compute through the kernel
each chooses once, at load, from its GEMM's candidates (`quantkit.kernels.int4`, `.int8`, `.fp8`)."""

from __future__ import annotations

import torch
from torch import nn

from quantkit import ops, packing
from quantkit.formats import float_quantized, int_quantized, pack_quantized
from quantkit.kernels import choice, fp8, int4, int8
from quantkit.kernels.choice import Choice, Problem
from quantkit.runtime.qlinear_float import fake_quantize_input
from quantkit.scheme import QuantArgs


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


class _Prepared(nn.Module):
    """A quantized linear whose `prepare(dtype, device, backend)` chooses its kernel once, from
    its operation's candidates (`quantkit.kernels.choice`; the engine calls it at load, a first
    call does otherwise, and again only if the activations' dtype or device change), and sets
    `run` (x -> y, bias added: what the engine calls), `kernel` (the `Choice`: which, and why)
    and `runtime_weight` (the kernel's own layout of the weight, where it builds one)."""

    kernel: Choice | None = None
    runtime_weight = None
    _prepared_for: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._prepared_for != (x.dtype, x.device):
            self.prepare(x.dtype, x.device)
        return self.run(x)

    def _choose(self, op: str, candidates: list, problem: Problem) -> Choice:
        self._prepared_for = (problem.dtype, problem.device)
        self.kernel = choice.choose(op, candidates, problem)
        self.runtime_weight = getattr(self.kernel.fn, "weight", None)
        self.run = self.kernel.fn if self.bias is None else _plus_bias(self.kernel.fn, self.bias)
        return self.kernel


def _plus_bias(run, bias: torch.Tensor):
    def run_plus_bias(x: torch.Tensor) -> torch.Tensor:
        y = run(x)
        return y + bias.to(y.dtype)

    return run_plus_bias


class PackedInt4Linear(_Prepared):
    """A linear with compressed-tensors `pack-quantized` int4 weights (buffers named
    as in the checkpoint, so its state dict loads as is). With `acts` (w4afp8: fp8 per token,
    dynamic) the input is fake-quantized as compressed-tensors does before the int4 GEMM."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        args: QuantArgs,
        dtype: torch.dtype,
        acts: QuantArgs | None = None,
    ):
        super().__init__()
        if args.num_bits != 4:
            raise ValueError("PackedInt4Linear holds 4-bit weights only")
        self.in_features, self.out_features, self.args, self.acts = in_features, out_features, args, acts
        info = pack_quantized.param_info(out_features, in_features, args, dtype)
        for name, (shape, dt) in info.items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.weight_zero_point = getattr(self, "weight_zero_point", None)
        self.weight_g_idx = getattr(self, "weight_g_idx", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None
        self._zeros = None  # the unpacked zero points, built on the first call

    def zeros(self) -> torch.Tensor | None:
        if self.weight_zero_point is None:
            return None
        if self._zeros is None or self._zeros.device != self.weight_zero_point.device:
            self._zeros = packing.unpack(self.weight_zero_point, self.out_features, 4, dim=0)
        return self._zeros

    def prepare(self, dtype: torch.dtype, device: torch.device | str, backend: str = "auto") -> Choice:
        """Choose the kernel once, for activations of `dtype` on `device` (what the engine does at
        load; a first call does it otherwise), from `quantkit.kernels.int4.CANDIDATES`: the
        Triton kernel on a GPU; on the CPU the AMX kernel for bf16, the AVX2/AVX-512 kernel for
        fp32, else torch's int4pack (bf16); else the torch twin, which dequantizes the weight on
        every call. `self.kernel` says which, and why."""
        group = self.args.group_size if self.args.strategy == "group" else None
        weight = (self.weight_packed, self.weight_scale, self.zeros(), group, self.weight_g_idx)
        kernel = self._choose("int4 GEMM", int4.CANDIDATES, Problem(device, dtype, backend, weight=weight))
        if self.acts is not None:
            self.run = _on_fake_quantized_input(self.run, self.acts)
        return kernel

    def extra_repr(self) -> str:
        a = self.args
        acts = ", fp8 per-token activations" if self.acts is not None else ""
        return (
            f"in={self.in_features}, out={self.out_features}, int4 {a.strategy} {a.group_size or ''} sym={a.symmetric}"
            + acts
        )


def _on_fake_quantized_input(run, acts: QuantArgs):
    def run_on_fake_quantized(x: torch.Tensor) -> torch.Tensor:
        return run(fake_quantize_input(x, acts, None))

    return run_on_fake_quantized


class PackedInt8Linear(_Prepared):
    """A linear with compressed-tensors `pack-quantized` int8 weights (w8a16; buffers named as
    in the checkpoint). Symmetric per-channel weights on the CPU compute through the AVX2/AVX-512
    kernel for fp32 activations (`kernels/int4/avx.py`) or torch's int8-weight GEMM
    (`kernels/int8/int8pack.py`), chosen at load; any other layout or device dequantizes its
    weight once, into the activations' dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, args: QuantArgs, dtype: torch.dtype):
        super().__init__()
        if args.num_bits != 8 or args.type != "int":
            raise ValueError("PackedInt8Linear holds int8 weights only")
        self.in_features, self.out_features, self.args = in_features, out_features, args
        for name, (shape, dt) in pack_quantized.param_info(out_features, in_features, args, dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.weight_zero_point = getattr(self, "weight_zero_point", None)
        self.weight_g_idx = getattr(self, "weight_g_idx", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None

    def prepare(self, dtype: torch.dtype, device: torch.device | str, backend: str = "auto") -> Choice:
        """Choose the kernel once (see `PackedInt4Linear.prepare`) from
        `quantkit.kernels.int8.W8A16`: for symmetric per-channel weights on the CPU the AVX kernel
        (fp32 activations) or torch's int8-weight GEMM, else the weight dequantized once into `dtype`."""
        zeros = self.weight_zero_point
        zeros = None if zeros is None else packing.unpack(zeros, self.out_features, 8, dim=0)
        problem = Problem(
            device, dtype, backend, ints=self._ints(), scales=self.weight_scale, zeros=zeros, args=self.args,
            g_idx=self.weight_g_idx,
        )  # fmt: skip
        return self._choose("int8 GEMM", int8.W8A16, problem)

    def _ints(self) -> torch.Tensor:
        return packing.unpack(self.weight_packed, self.in_features, 8)  # int8 [out, in]

    def extra_repr(self) -> str:
        a = self.args
        return (
            f"in={self.in_features}, out={self.out_features}, int8 {a.strategy} {a.group_size or ''} sym={a.symmetric}"
        )


class Fp8Linear(_Prepared):
    """A linear with compressed-tensors `float-quantized` fp8 weights; activations are
    quantized to fp8 per token at run time (dynamic) or with the stored `input_scale`."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, args: QuantArgs, static_input: bool, dtype: torch.dtype
    ):
        super().__init__()
        self.in_features, self.out_features, self.args = in_features, out_features, args
        for name, (shape, dt) in float_quantized.param_info(out_features, in_features, args, static_input).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.input_scale = getattr(self, "input_scale", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None

    def prepare(self, dtype: torch.dtype, device: torch.device | str, backend: str = "auto") -> Choice:
        """Choose the kernel once (see `PackedInt4Linear.prepare`) from
        `quantkit.kernels.fp8.CANDIDATES`: the Triton fp8 GEMM on a GPU, else the torch twin."""
        weight = {"weight": self.weight, "scales": self.weight_scale, "input_scale": self.input_scale}
        problem = Problem(device, dtype, backend, **weight)
        return self._choose("fp8 GEMM", fp8.CANDIDATES, problem)

    def extra_repr(self) -> str:
        kind = "static" if self.input_scale is not None else "dynamic per-token"
        return f"in={self.in_features}, out={self.out_features}, fp8 {self.args.strategy} weights, {kind} activations"


class PrepackedLinear(nn.Module):
    """A bf16 `nn.Linear` on the CPU whose weight is reordered once for oneDNN
    (`ops.float_cpu_weight`): the same outputs as the linear, bit for bit, faster."""

    def __init__(self, linear: nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = weight  # opaque oneDNN layout: only `ops.float_gemm_cpu` reads it
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.float_gemm_cpu(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bf16 prepacked for oneDNN"


def prepack(module: nn.Module) -> nn.Module:
    """`module` as a `PrepackedLinear` when it is a bf16 `nn.Linear` on the CPU and torch can
    reorder its weight; otherwise `module` itself."""
    if type(module) is not nn.Linear:
        return module
    weight = ops.float_cpu_weight(module.weight)
    return module if weight is None else PrepackedLinear(module, weight)


def fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One module computing torch.cat([m(x) for m in linears], -1) for linears that read the
    same input (q/k/v, gate/up), so a block runs fewer, wider GEMMs; None when they cannot
    be fused. Takes float `nn.Linear`s (the originals' weights become views of the fused
    weight, so nothing is stored twice), `PackedInt4Linear`s of one scheme, and per-channel
    `Fp8Linear`s with dynamic activations."""
    first, kinds = linears[0], {type(m) for m in linears}
    if len(kinds) > 1 or any(m.in_features != first.in_features for m in linears):
        return None
    bias = _fused_bias(linears)
    if kinds == {nn.Linear}:
        return _fuse_float(linears, bias)
    if kinds == {PackedInt4Linear} and _same_int4_layout(linears):
        fused = PackedInt4Linear(
            first.in_features,
            sum(m.out_features for m in linears),
            bias is not None,
            first.args,
            first.weight_scale.dtype,
            first.acts,
        )
        for name in ("weight_packed", "weight_scale"):
            setattr(fused, name, _concat_and_share(linears, name))
        fused.weight_shape = torch.tensor([fused.out_features, fused.in_features])
        fused.weight_g_idx = first.weight_g_idx
        if first.weight_zero_point is not None:
            zeros = torch.cat([m.zeros() for m in linears])  # int8 [out, groups]
            fused.weight_zero_point = packing.pack(zeros, 4, dim=0)
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return fused
    if kinds == {Fp8Linear} and all(m.input_scale is None and m.args.strategy == "channel" for m in linears):
        fused = Fp8Linear(
            first.in_features,
            sum(m.out_features for m in linears),
            bias is not None,
            first.args,
            False,
            torch.float32 if bias is None else bias.dtype,
        )
        fused.weight = _concat_and_share(linears, "weight")
        fused.weight_scale = _concat_and_share(linears, "weight_scale")
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return fused
    if kinds == {Int8Linear}:
        return _fuse_int8(linears, bias)
    return None


def _fused_bias(linears: list[nn.Module]) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    ref = next(m.bias for m in linears if m.bias is not None)
    return torch.cat([m.bias.detach() if m.bias is not None else ref.new_zeros(m.out_features) for m in linears])


def _fuse_float(linears: list[nn.Linear], bias: torch.Tensor | None) -> nn.Linear:
    weight = _concat_and_share(linears, "weight")
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return fused


def _same_int4_layout(linears: list[PackedInt4Linear]) -> bool:
    first = linears[0]
    g = first.weight_g_idx
    return all(
        m.args == first.args
        and m.acts == first.acts
        and m.weight_scale.dtype == first.weight_scale.dtype
        and (g is None) == (m.weight_g_idx is None)
        and (g is None or torch.equal(g, m.weight_g_idx))
        for m in linears
    )


@torch.no_grad()
def _concat_and_share(linears: list[nn.Module], name: str) -> torch.Tensor:
    """torch.cat of each module's tensor `name` along dim 0; each module then holds a view of it."""
    fused = torch.cat([getattr(m, name).detach() for m in linears])
    start = 0
    for m in linears:
        n = getattr(m, name).shape[0]
        part = fused[start : start + n]
        setattr(m, name, nn.Parameter(part, requires_grad=False) if name in m._parameters else part)
        start += n
    return fused


class Int8Linear(_Prepared):
    """A W8A8 linear with compressed-tensors `int-quantized` weights (int8 [out, in] `weight`,
    `weight_scale` [out, 1] or [1]; buffers named as in the checkpoint). Activations are
    quantized to int8 per token when it runs, and the GEMM is int8 with int32 sums."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, args: QuantArgs, acts: QuantArgs, dtype: torch.dtype
    ):
        super().__init__()
        self.in_features, self.out_features, self.args, self.acts = in_features, out_features, args, acts
        for name, (shape, dt) in int_quantized.param_info(out_features, in_features, args, dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt, device="meta"))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None

    def prepare(self, dtype: torch.dtype, device: torch.device | str, backend: str = "auto") -> Choice:
        """Choose the kernel once (see `PackedInt4Linear.prepare`) from
        `quantkit.kernels.int8.W8A8`: `torch._int_mm` on a GPU, oneDNN's int8 GEMM on a prepacked
        weight on the CPU (AMX or VNNI where the CPU has them; the activations quantized in C++
        where it builds), else the torch twin, which dequantizes on every call."""
        problem = Problem(device, dtype, backend, weight=self.weight, scales=self.weight_scale)
        return self._choose("W8A8 int8 GEMM", int8.W8A8, problem)

    def extra_repr(self) -> str:
        shape = f"in={self.in_features}, out={self.out_features}"
        return f"{shape}, int8 {self.args.strategy} weights, int8 per-token activations"


def _fuse_int8(linears: list[Int8Linear], bias: torch.Tensor | None) -> Int8Linear | None:
    """Int8Linears of one scheme with per-channel scales (of one dtype) as one."""
    first = linears[0]
    if any(m.args != first.args or m.weight_scale.dtype != first.weight_scale.dtype for m in linears):
        return None
    if first.args.strategy != "channel":
        return None
    dtype = first.weight_scale.dtype if bias is None else bias.dtype
    fused = Int8Linear(
        first.in_features, sum(m.out_features for m in linears), bias is not None, first.args, first.acts, dtype
    )
    fused.weight = _concat_and_share(linears, "weight")
    fused.weight_scale = _concat_and_share(linears, "weight_scale")
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return fused
