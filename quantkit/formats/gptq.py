"""Export to the GPTQ v1 layout (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), which
vLLM, transformers (through gptqmodel/optimum) and many other runtimes read.

Per quantized linear `<name>` (W [out, in], G groups):

| tensor | dtype | shape | content |
|---|---|---|---|
| `qweight` | int32 | [in / 8, out] | unsigned values q + 8 in 0..15, eight consecutive *input* rows per word, row 8i + k in bits 4k..4k+3 |
| `qzeros` | int32 | [G, out / 8] | unsigned zero points minus one (z + 8 - 1), eight consecutive outputs per word, same nibble order |
| `scales` | float16 | [G, out] | |
| `g_idx` | int32 | [in] | group of each input row (i // group_size without act-order) |

w = (q_unsigned - (qzeros_nibble + 1)) * scale. Symmetric checkpoints store zero 8 (7 on disk).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_provenance, read_tensors, save_checkpoint
from quantkit.formats.pack_quantized import decompress_ints, pack
from quantkit.scheme import from_quantization_config


def to_gptq(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int | None,
            g_idx: torch.Tensor | None, name: str) -> dict[str, torch.Tensor]:
    """GPTQ tensors of one linear from signed int4 values q [out, in], scale [out, G], zero [out, G] or None."""
    out_f, in_f = q.shape
    if out_f % 8 or in_f % 8:
        raise QuantkitError(f"{name} is {out_f}×{in_f}; the GPTQ layout needs both sizes divisible by 8.")
    zero = torch.zeros_like(scale, dtype=torch.int8) if zero is None else zero
    if (zero == -8).any():
        raise QuantkitError(f"{name} has a zero point of 0 (unsigned), which GPTQ v1 cannot store (it keeps zero - 1); "
                            "export a symmetric checkpoint or use the compressed-tensors checkpoint as is.")
    if g_idx is None:
        g_idx = torch.arange(in_f) // (group_size or in_f)
    return {
        "qweight": pack(q.t().contiguous(), 4, dim=0),  # [in / 8, out]: pack adds 8 -> unsigned
        "qzeros": pack((zero.to(torch.int16) - 1).to(torch.int8).t().contiguous(), 4, dim=1),  # z + 8 - 1
        "scales": scale.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def export_gptq(src: Path, out: Path, overwrite: bool = False) -> Path:
    """Write the GPTQ v1 checkpoint of a compressed-tensors int4 `pack-quantized` one."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise QuantkitError(f"{src} is not a compressed-tensors pack-quantized checkpoint; export one made by "
                            "quantkit rtn, awq or gptq.")
    ckpt = from_quantization_config(qc)
    schemes = {s.weights for s in ckpt.schemes}
    if len(schemes) != 1 or next(iter(schemes)).num_bits != 4:
        raise QuantkitError(f"{src} mixes schemes or is not 4-bit; GPTQ export takes one int4 scheme.")
    args = next(iter(schemes))
    tensors = read_tensors(src)
    modules = sorted(k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed"))
    exported = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules or k.endswith(".bias")}
    for m in modules:
        part = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == m}
        q, scale, zero, g_idx = decompress_ints(part, args)
        group = args.group_size if args.strategy == "group" else None
        exported.update({f"{m}.{k}": v for k, v in to_gptq(q, scale, zero, group, g_idx, m).items()})
    config["quantization_config"] = {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": 4,
        "group_size": args.group_size if args.strategy == "group" else -1,
        "desc_act": args.actorder == "group", "sym": args.symmetric, "true_sequential": True,
        "static_groups": False, "damp_percent": 0.01, "modules_in_block_to_quantize": None,
    }
    provenance = dict(read_provenance(src) or {}, exported_from=str(src), export_format="gptq")
    return save_checkpoint(out, exported, config, provenance, src, overwrite)
