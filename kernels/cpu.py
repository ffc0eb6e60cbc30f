"""torch's own CPU weight-only matmuls, with the layouts they need built at load time.

- int4: `aten._weight_int4pack_mm_for_cpu` ("tinygemm" on CPU), bf16 activations.
- int8: `aten._weight_int8pack_mm`, per-output-channel symmetric int8 (for W8A16).
- bf16: oneDNN's matmul on a weight reordered once into its blocked layout
  (`mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch.compile's CPU
  freezing uses), where `F.linear` hands oneDNN the plain layout on every call. Bit-identical to
  `F.linear` in bf16 (tested); smollm2's shapes, one thread: 1.8× at one token, 1.1× at
  64, 1.06× at 2048. Not for fp32, whose oneDNN path rounds differently from `F.linear`.

What the int4pack kernel computes (torch 2.13, checked against its source and numerically
in tests/kernels/test_cpu_int4.py):

    w[n, k] = (u[n, k] - 8) * S[k // G, n, 0] + S[k // G, n, 1]     u in 0..15 (unsigned nibble)

with S = scales_and_zeros, in bf16, accumulated in fp32, output in bf16. Ours (pack-quantized)
is w = (q - z) * s with q = u - 8 and z the signed zero point, so

    S[..., 0] = bf16(s),   S[..., 1] = bf16(-z * bf16(s))   (0 when symmetric).

Shapes torch takes (`supports` says yes to exactly these): group size G in {32, 64, 128, 256};
in_features K % G == 0; out_features N % 16 == 0. Per-channel scales ([N, 1]) run as groups of
the largest G above that divides K. Act-order (`g_idx`) runs when sorting the input columns by
group leaves every group contiguous and G wide (GPTQ's "group" act-order does): the weight's
columns are permuted at load, and x's at each call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.errors import QuantkitError
from quantkit.packing import unpack

INT4_GROUP_SIZES = (32, 64, 128, 256)
_HAS_INT4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
_HAS_INT8 = hasattr(torch, "_weight_int8pack_mm")
# oneDNN's bf16 reorder needs a CPU with native bf16 support (AVX512-BF16/AMX; not AVX2-only CPUs)
_HAS_PREPACK = (
    hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and torch.backends.mkldnn.is_available()
    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively through oneDNN (AVX512-BF16 or AMX): bf16 GEMMs are
    then about twice as fast as fp32; on AVX2-only CPUs they are several times slower."""
    return _HAS_PREPACK


@dataclass(frozen=True, slots=True)
class Int4CpuWeight:
    """An int4 linear weight [N, K] in the layout of torch's CPU int4pack kernel.

    `packed` uint8 [N, K/2]: `aten._convert_weight_to_int4pack_for_cpu` of the unsigned
    nibbles u = q + 8 (int32 [N, K]). Rows go in blocks of BLOCK_N output channels (64 with
    AVX-512, 32 with AVX2 or no vector unit), each block a [K, BLOCK_N/2] byte array. AVX-512,
    full block: byte d (d < 16) of row k holds channels d (low nibble) and d+32 (high nibble),
    byte 16+d holds d+16 and d+48; AVX2: byte d holds d and d+16; a last partial block (16, 32
    or 48 channels) holds channels 2i and 2i+1 in byte i. The layout depends on the CPU
    capability of the machine that built it: build it at load, never save it.
    `scales_and_zeros` bf16 [K/G, N, 2]: [..., 0] the scale, [..., 1] the additive term
    -z * scale (see the module docstring).
    `perm` int64 [K] or None: the input column order (act-order), x[..., perm] is multiplied.
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of weight data one matmul reads (nibbles, scales and zero terms)."""
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


def _group_for(in_features: int, group_size: int | None) -> int | None:
    """The kernel group size: `group_size`, or for per-channel scales the largest that divides K."""
    if group_size:
        return group_size
    return next((g for g in reversed(INT4_GROUP_SIZES) if in_features % g == 0), None)


def _act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Column order that makes the groups contiguous and `group_size` wide, or None."""
    g_idx = g_idx.long().cpu()
    perm = torch.argsort(g_idx, stable=True)
    expected = torch.arange(g_idx.numel()) // group_size
    return perm if torch.equal(g_idx[perm], expected) else None


def int4_unsupported(
    out_features: int, in_features: int, group_size: int | None, g_idx: torch.Tensor | None = None
) -> str | None:
    """Why `int4_gemm_cpu` cannot run an [out, in] int4 weight with these group settings
    (group_size None: per-channel scales), or None when it can."""
    g = _group_for(in_features, group_size)
    if not _HAS_INT4:
        return "this torch has no CPU int4pack kernel"
    if g not in INT4_GROUP_SIZES or in_features % g:
        return f"torch's CPU int4 kernel takes groups of {', '.join(map(str, INT4_GROUP_SIZES))}, not {group_size}"
    if out_features % 16:
        return f"torch's CPU int4 kernel needs a multiple of 16 outputs, not {out_features}"
    if g_idx is not None and (g_idx.numel() != in_features or _act_order_perm(g_idx, g) is None):
        return "its act-order groups are not contiguous runs of the group size"
    return None


def supports(out_features: int, in_features: int, group_size: int | None, g_idx: torch.Tensor | None = None) -> bool:
    """True when `int4_gemm_cpu` can run an [out, in] int4 weight with these group settings
    (group_size None: per-channel scales); False sends the caller to the torch twin."""
    return int4_unsupported(out_features, in_features, group_size, g_idx) is None


def repack_int4_cpu(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None = None,
) -> Int4CpuWeight:
    """Pack-quantized int4 -> `Int4CpuWeight`.

    w_packed int32 [N, K/8] (values + 8 in nibbles, see `quantkit.packing`);
    scales [N, K/group] or [N, 1] (group_size None), any float dtype; zeros int8 [N, K/group]
    signed zero points or None (symmetric); g_idx int32 [K] or None. Raises `QuantkitError`
    for shapes `supports` rejects.
    """
    n, k = w_packed.shape[0], w_packed.shape[1] * 8
    if not supports(n, k, group_size, g_idx):
        raise QuantkitError(
            f"torch's CPU int4 kernel cannot take a [{n}, {k}] weight with group size {group_size}"
            f"{' and this act-order' if g_idx is not None else ''}; it needs out % 16 == 0, a group of "
            "32/64/128/256 dividing the input width and contiguous groups; use the torch twin."
        )
    g = _group_for(k, group_size)
    u = unpack(w_packed.cpu(), k).to(torch.int32) + 8  # [N, K] in 0..15
    s = scales.cpu().to(torch.bfloat16).float().expand(n, k // g)  # [N, K/G]
    term = torch.zeros_like(s) if zeros is None else -zeros.cpu().float().expand(n, k // g) * s
    perm = None
    if g_idx is not None:
        perm = _act_order_perm(g_idx, g)
        u = u[:, perm]
    sz = torch.stack([s, term], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/G, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)  # inner_k_tiles unused on CPU
    return Int4CpuWeight(packed, sz, g, n, k, perm)


def int4_gemm_cpu(x: torch.Tensor, weight: Int4CpuWeight) -> torch.Tensor:
    """y = x · dequant(W)ᵀ. x [..., K] any float dtype (multiplied in bf16, accumulated in
    fp32); returns [..., N] in x's dtype."""
    if x.shape[-1] != weight.in_features:
        raise QuantkitError(f"int4_gemm_cpu: x has {x.shape[-1]} features, the weight takes {weight.in_features}.")
    x2 = x.reshape(-1, weight.in_features)
    if weight.perm is not None:
        x2 = x2.index_select(1, weight.perm)
    x2 = x2.to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, weight.group_size, weight.scales_and_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


@dataclass(frozen=True, slots=True)
class Int8CpuWeight:
    """A per-channel int8 weight for `aten._weight_int8pack_mm`: `weight` int8 [N, K] row-major
    (no repacking), `scales` fp32 [N]; w = weight * scales[:, None]."""

    weight: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4


def supports_int8(out_features: int, in_features: int) -> bool:
    """True when `int8_gemm_cpu` can run an [out, in] weight. torch 2.13 needs K % 16 == 0
    (other K crash the process rather than raise)."""
    return _HAS_INT8 and in_features % 16 == 0 and out_features > 0


def int8_unsupported(out_features: int, in_features: int) -> str | None:
    """Why `int8_gemm_cpu` cannot run an [out, in] weight, or None when it can."""
    if supports_int8(out_features, in_features):
        return None
    return f"torch's CPU int8-weight kernel needs K % 16 == 0, not {in_features}"


def repack_int8_cpu(w_int8: torch.Tensor, scales: torch.Tensor) -> Int8CpuWeight:
    """int8 [N, K] symmetric values and per-channel scales [N] or [N, 1] -> `Int8CpuWeight`."""
    n, k = w_int8.shape
    if not supports_int8(n, k) or w_int8.dtype != torch.int8 or scales.numel() != n:
        raise QuantkitError(
            f"torch's CPU int8 kernel needs an int8 [N, K] weight with K % 16 == 0 and N per-channel "
            f"scales (got {w_int8.dtype} [{n}, {k}] and {scales.numel()} scales); use the torch twin."
        )
    return Int8CpuWeight(w_int8.cpu().contiguous(), scales.cpu().float().reshape(n).contiguous())


def int8_gemm_cpu(x: torch.Tensor, weight: Int8CpuWeight) -> torch.Tensor:
    """y = x · (W · s)ᵀ. x [..., K] bf16, fp16 or fp32 (computed in x's dtype, scales cast to
    it); returns [..., N] in x's dtype."""
    n, k = weight.weight.shape
    if x.shape[-1] != k:
        raise QuantkitError(f"int8_gemm_cpu: x has {x.shape[-1]} features, the weight takes {k}.")
    x2 = x.reshape(-1, k).contiguous()
    y = torch._weight_int8pack_mm(x2, weight.weight, weight.scales.to(x2.dtype))
    return y.reshape(*x.shape[:-1], n)


def prepack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 CPU weight [N, K] reordered for `bf16_linear`, or None where torch cannot."""
    if not _HAS_PREPACK or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:  # a torch built without oneDNN's bf16 support
        return None


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] bf16 and `prepack_bf16(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# --- W8A8: int8 weights and per-token int8 activations, oneDNN's int8 GEMM (AMX / VNNI) ---

_HAS_QLINEAR = hasattr(torch.ops.onednn, "qlinear_prepack") and torch.backends.mkldnn.is_available()


@dataclass(frozen=True, slots=True)
class W8A8CpuWeight:
    """A symmetric int8 weight [N, K] for `w8a8_gemm_cpu`: `packed` is oneDNN's blocked layout
    (`onednn.qlinear_prepack`, the one inductor's x86 int8 path builds; opaque, built at load,
    never saved), `scales` fp32 [N] (a per-tensor scale repeated), `zero_points` int64 zeros [N].
    `elementwise` is `torch.ops.quantkit_w8a8` (the C++ quantization and row scaling of
    `kernels/csrc/w8a8.cpp`) or None, when the same math runs as torch ops."""

    packed: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    out_features: int
    in_features: int
    elementwise: object | None = None


def w8a8_unsupported(out_features: int, in_features: int) -> str | None:
    """Why `w8a8_gemm_cpu` cannot run an [out, in] weight, or None when it can."""
    if not _HAS_QLINEAR:
        return "this torch has no oneDNN int8 linear (onednn.qlinear_pointwise)"
    if out_features < 1 or in_features < 1:
        return f"the weight [{out_features}, {in_features}] is empty"
    return None


def prepack_w8a8(w_int8: torch.Tensor, scales: torch.Tensor, elementwise: bool = True) -> W8A8CpuWeight:
    """int8 [N, K] weight and its scales ([N, 1], [N] or [1]) -> `W8A8CpuWeight`, with the C++
    element-wise passes when `elementwise` and they build here (`quantkit.kernels.cpu_w8a8`)."""
    n, k = w_int8.shape
    why = w8a8_unsupported(n, k)
    if why or w_int8.dtype != torch.int8 or scales.numel() not in (1, n):
        raise QuantkitError(
            f"oneDNN's int8 linear takes an int8 [N, K] weight with N or 1 scales (got {w_int8.dtype} "
            f"[{n}, {k}] and {scales.numel()} scales{'; ' + why if why else ''}); use the torch twin."
        )
    from quantkit.kernels import cpu_w8a8

    packed = torch.ops.onednn.qlinear_prepack(w_int8.cpu().contiguous(), None)
    s = scales.cpu().float().reshape(-1).expand(n).contiguous()
    ext = cpu_w8a8.load() if elementwise else None
    return W8A8CpuWeight(packed, s, torch.zeros(n, dtype=torch.int64), n, k, ext)


def w8a8_gemm_cpu(x: torch.Tensor, weight: W8A8CpuWeight) -> torch.Tensor:
    """y = (Q(x) · W_intᵀ) · s_x · s_w with x [..., K] quantized to int8 per token (scale
    max|x| / 127.5, as `int8_gemm.quantize_per_token`), products summed in int32 by oneDNN, which
    applies s_w and writes bf16 (x bf16) or fp32 (any other x); then each row times its s_x.
    Returns [..., N] in x's dtype."""
    from quantkit.kernels.int8_gemm import quantize_per_token

    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise QuantkitError(f"w8a8_gemm_cpu: x has {x.shape[-1]} features, the weight takes {k}.")
    x2 = x.reshape(-1, k)
    out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    ext = weight.elementwise if x.dtype in (torch.bfloat16, torch.float32) else None
    q, s = ext.quantize_per_token(x2.contiguous()) if ext is not None else quantize_per_token(x2)
    y = torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 0, weight.packed, weight.scales, weight.zero_points, None, 1.0, 0, out, "none", [], ""
    )
    if ext is not None and out == torch.bfloat16:
        ext.scale_rows_(y, s)
    else:
        y.mul_(s.to(out))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
