"""torch's CPU int4 weight-only matmul, `aten._weight_int4pack_mm_for_cpu` ("tinygemm" on CPU), bf16
activations, with the layout it needs built at load.

What the int4pack kernel computes (torch 2.13, checked against its source and numerically
in tests/kernels/int4/test_int4pack.py):

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
