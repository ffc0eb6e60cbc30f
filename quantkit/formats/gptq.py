"""The GPTQ v1 layout (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), which vLLM,
transformers (through gptqmodel/optimum) and many other runtimes read.

Per quantized linear `<name>` (W [out, in], G groups):

| tensor | dtype | shape | content |
|---|---|---|---|
| `qweight` | int32 | [in / 8, out] | unsigned values q + 8 in 0..15, eight consecutive *input* rows per word, row 8i + k in bits 4k..4k+3 |
| `qzeros` | int32 | [G, out / 8] | unsigned zero points minus one (z + 8 - 1), eight consecutive outputs per word, same nibble order |
| `scales` | float16 | [G, out] | |
| `g_idx` | int32 | [in] | group of each input row (i // group_size without act-order) |

w = (q_unsigned - (qzeros_nibble + 1)) * scale. Symmetric checkpoints store zero 8 (7 on disk).
v1 cannot store an unsigned zero point of 0 (nor read one of 16); quantkit refuses to write one.
GPTQModel writes one anyway: its v2 -> v1 export subtracts 0x11111111 from each int32 word, so a
zero of 0 becomes nibble 15 and borrows 1 from the nibble above (the next output's zero), and its
loader adds the word back. Checkpoints whose `meta.quantizer` names gptqmodel are read that way
(`borrows=True`), as GPTQModel computes them; nibble-wise readers (AutoGPTQ, vLLM's GPTQ kernels)
read such a group's zero as 16 and its neighbour's one too low. Any other nibble of 15 is refused.
On import, a non-trivial `g_idx` becomes compressed-tensors act-order `group` with
`weight_g_idx`, and zero points that are all 8 make the checkpoint symmetric, whatever
`sym` and `desc_act` say (the tensors are what every kernel computes with).
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.awq import fp16_scales
from quantkit.packing import pack, unpack
from quantkit.scheme import QuantArgs


def to_gptq(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int | None,
    g_idx: torch.Tensor | None,
    name: str,
) -> dict[str, torch.Tensor]:
    """GPTQ tensors of one linear from signed int4 values q [out, in], scale [out, G], zero [out, G] or None."""
    out_f, in_f = q.shape
    if out_f % 8 or in_f % 8:
        raise QuantkitError(f"{name} is {out_f}×{in_f}; the GPTQ layout needs both sizes divisible by 8.")
    zero = torch.zeros_like(scale, dtype=torch.int8) if zero is None else zero
    if (zero == -8).any():
        raise QuantkitError(
            f"{name} has a zero point of 0 (unsigned), which GPTQ v1 cannot store (it keeps zero - 1); "
            "export a symmetric checkpoint or use the compressed-tensors checkpoint as is."
        )
    if g_idx is None:
        g_idx = torch.arange(in_f) // (group_size or in_f)
    return {
        "qweight": pack(q.t().contiguous(), 4, dim=0),  # [in / 8, out]: pack adds 8 -> unsigned
        "qzeros": pack((zero.to(torch.int16) - 1).to(torch.int8).t().contiguous(), 4, dim=1),  # z + 8 - 1
        "scales": fp16_scales(scale, name, "GPTQ").t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def zero_points(tensors: dict[str, torch.Tensor], name: str, borrows: bool = False) -> torch.Tensor:
    """Signed zero points int8 [out, G] of one linear's GPTQ v1 `qzeros` (nibble + 1 - 8); with
    `borrows`, each int32 word plus 0x11111111 (GPTQModel's reading), nibble - 8."""
    qzeros = tensors["qzeros"]
    if borrows:  # unpack keeps the low 32 bits of each sum
        zero = unpack(qzeros.to(torch.int64) + 0x11111111, qzeros.shape[1] * 8, 4, dim=1).to(torch.int16)
    else:
        zero = unpack(qzeros, qzeros.shape[1] * 8, 4, dim=1).to(torch.int16) + 1  # [G, out]
    if (zero > 7).any():
        raise QuantkitError(
            f"{name} stores a qzeros nibble of 15 (unsigned zero point 16), which no 4-bit format "
            "holds; the checkpoint is damaged or its zero points of 0 wrapped around."
        )
    return zero.to(torch.int8).t().contiguous()


def decode(tensors: dict[str, torch.Tensor], name: str, borrows: bool = False):
    """(q int8 [out, in], scale fp16 [out, G], signed zero int8 [out, G], g_idx int32 [in] or
    None) of one linear's `qweight`, `qzeros`, `scales` and `g_idx` (`borrows`: `zero_points`)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != out_f or qzeros.shape != (scales.shape[0], out_f // 8):
        raise QuantkitError(
            f"{name} has qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)}, which do not fit the GPTQ v1 layout; the checkpoint is damaged."
        )
    g_idx = tensors.get("g_idx")
    if g_idx is not None and (g_idx.shape != (in_f,) or g_idx.min() < 0 or g_idx.max() >= scales.shape[0]):
        raise QuantkitError(
            f"{name} has a g_idx that does not index its {scales.shape[0]} groups; the checkpoint is damaged."
        )
    q = unpack(qweight.t(), in_f, 4, dim=1)  # [out, in]
    return q, scales.t().contiguous(), zero_points(tensors, name, borrows), g_idx


def gptq_config(args: QuantArgs, damp: float | None = None) -> dict:
    """The `quantization_config` of a GPTQ v1 checkpoint with int4 weights `args`; `damp`, the
    dampening GPTQ ran with (a fraction of the Hessian's mean diagonal), None for weights from
    another method (then no `damp_percent` is written)."""
    config = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": 4,
        "group_size": args.group_size if args.strategy == "group" else -1,
        "desc_act": args.actorder == "group",
        "sym": args.symmetric,
        "true_sequential": True,
        "static_groups": False,
        "modules_in_block_to_quantize": None,
    }
    if damp is not None:
        config["damp_percent"] = damp
    return config


def unsupported(qc: dict) -> str | None:
    """Why a GPTQ `quantization_config` is not one quantkit reads (completes "<path> ..."), or None."""
    bits = qc.get("bits")
    fmt = "marlin" if qc.get("is_marlin_format") else str(qc.get("checkpoint_format") or qc.get("format") or "gptq")
    if bits != 4:
        return f"is a GPTQ checkpoint with {bits}-bit weights"
    if fmt.lower() != "gptq":
        return f"is a GPTQ checkpoint in format {fmt!r}, not v1 (checkpoint_format gptq)"
    return None


def borrows(qc: dict) -> bool:
    """Whether GPTQModel wrote this checkpoint (its zeros of 0 borrow across nibbles, above)."""
    meta = qc.get("meta")
    quantizers = meta.get("quantizer", []) if isinstance(meta, dict) else []
    return any(str(q).lower().startswith("gptqmodel") for q in quantizers)


def group_size(qc: dict) -> int | None:
    """The group size of a GPTQ `quantization_config` (None: per output channel)."""
    group = qc.get("group_size", 128)
    return None if group in (None, -1) else int(group)
