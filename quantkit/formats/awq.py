"""The AutoAWQ GEMM layout (`quant_method: awq`, `version: gemm`), which AutoAWQ,
transformers, vLLM (awq and awq_marlin) and SGLang read.

Per quantized linear `<name>` (W [out, in], G = in / group_size groups):

| tensor | dtype | shape | content |
|---|---|---|---|
| `qweight` | int32 | [in, out / 8] | unsigned values q + 8 in 0..15; word c of row r holds output columns 8c..8c+7, column 8c + ORDER[k] in bits 4k..4k+3 |
| `qzeros` | int32 | [G, out / 8] | unsigned zero points z + 8, packed like `qweight` (same ORDER) |
| `scales` | float16 | [G, out] | |

ORDER = (0, 2, 4, 6, 1, 3, 5, 7): AutoAWQ's `WQLinear_GEMM.from_linear` ORs
`intweight[:, 8c + order_map[k]] << 4k` into word c, and readers undo it with the
inverse (0, 4, 1, 5, 2, 6, 3, 7) (AutoAWQ `packing_utils.reverse_awq_order`, vLLM's
`awq_dequantize` Triton kernel). w = (q_unsigned - z_unsigned) * scale, which equals our
signed (q - z) * scale.

`zero_point` is always written true: AutoAWQ's GEMM packer requires zero points, vLLM's
`awq` kernel always reads `qzeros`, and vLLM converts 4-bit AWQ to its faster
`awq_marlin` (which then reads `qzeros` too) only when `zero_point` is true. A symmetric
checkpoint is therefore stored with every zero point 8, and on import a checkpoint whose
zero points are all 8 becomes symmetric again; a missing `qzeros` reads as 8. AWQ has no
act-order (`g_idx`).
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.packing import pack, unpack

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _order(n: int) -> torch.Tensor:
    """perm such that packed column j holds logical column perm[j] (n a multiple of 8)."""
    j = torch.arange(n)
    return j // 8 * 8 + torch.tensor(ORDER)[j % 8]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Signed int4 values [rows, n] (int8) -> int32 [rows, n / 8] in the AWQ nibble order."""
    return pack(values[:, _order(values.shape[1])], 4, dim=1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_awq`: int8 signed values [rows, 8 * words]."""
    n = packed.shape[1] * 8
    v = unpack(packed, n, 4, dim=1)
    return v[:, torch.argsort(_order(n))]


def to_awq(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, name: str) -> dict[str, torch.Tensor]:
    """AWQ tensors of one linear from signed int4 values q [out, in], scale [out, G] and
    signed zero points [out, G] (None: symmetric, stored as unsigned 8)."""
    out_f, in_f = q.shape
    if out_f % 8:
        raise QuantkitError(f"{name} has {out_f} outputs; the AWQ layout needs a multiple of 8.")
    zero = torch.zeros(scale.shape, dtype=torch.int8) if zero is None else zero
    return {
        "qweight": pack_awq(q.t().contiguous()),  # [in, out / 8]
        "qzeros": pack_awq(zero.t().contiguous()),  # [G, out / 8]
        "scales": fp16_scales(scale, name, "AWQ").t().contiguous(),  # [G, out]
    }


def zero_points(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Signed zero points int8 [out, G] of one linear's AWQ tensors (no `qzeros`: all 8 unsigned)."""
    zeros, scales = tensors.get("qzeros"), tensors["scales"]
    if zeros is None:
        return torch.zeros(scales.shape[::-1], dtype=torch.int8)
    if scales.dim() != 2 or zeros.shape != (scales.shape[0], scales.shape[1] // 8):
        raise QuantkitError(
            f"{name} has qzeros {tuple(zeros.shape)} and scales {tuple(scales.shape)}, which do not "
            "fit the AutoAWQ GEMM layout; the checkpoint is damaged or uses another layout."
        )
    return unpack_awq(zeros).t().contiguous()


def decode(tensors: dict[str, torch.Tensor], name: str):
    """(q int8 [out, in], scale fp16 [out, G], signed zero int8 [out, G], None) of one
    linear's `qweight`, `qzeros` and `scales` (the None: AWQ has no act-order `g_idx`)."""
    qweight, scales = tensors["qweight"], tensors["scales"]
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    if scales.dim() != 2 or scales.shape[1] != out_f or in_f % scales.shape[0]:
        raise QuantkitError(
            f"{name} has qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)}, which "
            "do not fit the AutoAWQ GEMM layout; the checkpoint is damaged or uses another layout."
        )
    return unpack_awq(qweight).t().contiguous(), scales.t().contiguous(), zero_points(tensors, name), None


def fp16_scales(scale: torch.Tensor, name: str, layout: str) -> torch.Tensor:
    """The scales in float16, which the AWQ and GPTQ layouts store, or a `QuantkitError`
    when a value falls outside float16's range."""
    s = scale.to(torch.float16)
    if not torch.isfinite(s).all() or ((s == 0) & (scale != 0)).any():
        raise QuantkitError(
            f"{name} has scales outside float16's range, which the {layout} layout cannot store; "
            "keep the compressed-tensors checkpoint."
        )
    return s


def awq_config(group_size: int | None, modules_to_not_convert: list[str]) -> dict:
    """The `quantization_config` of an AutoAWQ GEMM checkpoint (group_size None: per channel)."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size or -1,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert or None,
    }


def unsupported(qc: dict) -> str | None:
    """Why an AWQ `quantization_config` is not one quantkit reads (completes "<path> ..."), or None."""
    bits = qc.get("bits", qc.get("w_bit"))
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if bits != 4:
        return f"is an AWQ checkpoint with {bits}-bit weights"
    if version != "gemm":
        return f"is an AWQ checkpoint in the {version!r} layout, not GEMM"
    return None


def group_size(qc: dict) -> int | None:
    """The group size of an AWQ `quantization_config` (None: per output channel)."""
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return None if group in (None, -1) else int(group)
