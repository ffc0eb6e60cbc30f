"""Conversions between the three int4 layouts quantkit reads and writes: compressed-
tensors `pack-quantized`, AutoAWQ GEMM (`formats/awq.py`) and GPTQ v1 (`formats/gptq.py`).

Every checkpoint is read into one in-memory form, `Int4Checkpoint`, whose linears decode
one at a time to (q int8 [out, in] in [-8, 7], scale [out, G], signed zero point int8
[out, G] or None, act-order g_idx int32 [in] or None), and every layout is written from
it, so any layout converts to any other with identical values, zero points and scales
(scales become float16 where the target stores float16).

Read from AWQ or GPTQ, a checkpoint is symmetric when every zero point is 8 (unsigned),
and uses act-order `group` when some linear's `g_idx` is not i // group_size. Its
compressed-tensors `ignore` lists every module whose weight is stored unquantized (and
`lm_head` unless it is quantized); the AWQ `modules_to_not_convert` is the same list.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import awq, gptq
from quantkit.formats.checkpoint import check_output, read_provenance, read_tensors, save_checkpoint
from quantkit.formats.pack_quantized import decompress_ints
from quantkit.packing import pack
from quantkit.scheme import QuantArgs, QuantScheme, from_quantization_config, to_quantization_config

FORMATS = ("compressed-tensors", "awq", "gptq")
SIDECARS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}  # older AutoGPTQ / AutoAWQ folders
LAYOUTS = {"awq": awq, "gptq": gptq}  # each has unsupported, group_size, zero_points, decode
KEYS = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}


@dataclass(frozen=True)
class Int4Checkpoint:
    """A 4-bit checkpoint in memory: its on-disk tensors split into the quantized linears'
    `parts` (keys without the module prefix) and the `others`, plus the scheme they follow."""

    path: Path
    format: str  # one of FORMATS
    config: dict  # config.json
    args: QuantArgs
    parts: dict[str, dict[str, torch.Tensor]]
    others: dict[str, torch.Tensor]
    decode: Callable  # (part, name) -> (q, scale, zero, g_idx) in the layout's own terms

    def linears(self) -> Iterator[tuple[str, tuple]]:
        """(name, (q, scale, zero or None, g_idx or None)) of each quantized linear, under `args`."""
        group = self.args.group_size if self.args.strategy == "group" else None
        for name, part in self.parts.items():
            q, scale, zero, g_idx = self.decode(part, name)
            if self.args.actorder == "group" and g_idx is None:
                g_idx = _trivial_g_idx(q.shape[1], group)
            yield (
                name,
                (
                    q,
                    scale,
                    None if self.args.symmetric else zero,
                    g_idx.to(torch.int32) if self.args.actorder == "group" else None,
                ),
            )

    def unquantized(self) -> list[str]:
        """Modules whose weight is stored as a plain 2-D tensor, plus `lm_head` unless quantized."""
        names = {k.removesuffix(".weight") for k, t in self.others.items() if k.endswith(".weight") and t.dim() == 2}
        return sorted(names | ({"lm_head"} - set(self.parts)))


def _trivial_g_idx(in_features: int, group_size: int | None) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int32) // (group_size or in_features)


def sidecar_config(folder: Path) -> dict | None:
    """The `quantization_config` of an older AutoGPTQ `quantize_config.json` / AutoAWQ
    `quant_config.json` beside a `config.json` that has none; None if there is neither."""
    for name, method in SIDECARS.items():
        if (Path(folder) / name).is_file():
            return {"quant_method": method, **json.loads((Path(folder) / name).read_text())}
    return None


def unsupported(qc: dict) -> str | None:
    """Why a checkpoint with this `quantization_config` is not an int4 one quantkit converts
    (a phrase completing "<path> ..."), or None."""
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method in LAYOUTS:
        return LAYOUTS[method].unsupported(qc)
    if method == "compressed-tensors" and fmt == "pack-quantized":
        return None
    return f"is a {method!r} checkpoint " + (f"in format {fmt!r}" if fmt else "from another tool")


def _split(tensors: dict[str, torch.Tensor], keys: tuple[str, ...]):
    """({module: {key: tensor}} of the quantized linears, every other tensor by full name)."""
    parts = {k.rsplit(".", 1)[0]: {} for k in tensors if k.endswith("." + keys[0])}
    others = {}
    for k, t in tensors.items():
        module, _, leaf = k.rpartition(".")
        if module in parts and leaf in keys:
            parts[module][leaf] = t
        else:
            others[k] = t
    return parts, others


def _ct_args(folder: Path, qc: dict) -> QuantArgs:
    ckpt = from_quantization_config(qc)
    schemes = {s.weights for s in ckpt.schemes}
    if len(schemes) != 1 or next(iter(schemes)).num_bits != 4:
        raise QuantkitError(f"{folder} mixes schemes or is not 4-bit; conversion takes one int4 scheme.")
    if ckpt.kv_cache is not None:
        raise QuantkitError(
            f"{folder} carries KV-cache scales, which the AWQ and GPTQ layouts cannot record; "
            "convert the checkpoint made without --kv-cache."
        )
    return next(iter(schemes))


def _derived_args(parts: dict, zero_points: Callable, group_size: int | None) -> QuantArgs:
    """The scheme of an AWQ or GPTQ checkpoint, from its zero points and g_idx."""
    symmetric = all(bool((zero_points(part, name) == 0).all()) for name, part in parts.items())
    act_order = any(
        not torch.equal(part["g_idx"].to(torch.int32), _trivial_g_idx(len(part["g_idx"]), group_size))
        for part in parts.values()
        if "g_idx" in part
    )
    return QuantArgs(
        num_bits=4,
        symmetric=symmetric,
        strategy="group" if group_size else "channel",
        group_size=group_size,
        actorder="group" if act_order else None,
    )


def read_int4(folder: str | Path) -> Int4Checkpoint:
    """A compressed-tensors pack-quantized, AWQ (GEMM) or GPTQ (v1) int4 checkpoint, or a
    `QuantkitError` saying why it is none of them."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    qc = config.get("quantization_config") or sidecar_config(folder)
    if not qc:
        raise QuantkitError(
            f"{folder} is not a compressed-tensors pack-quantized checkpoint (nor an AWQ or GPTQ one); "
            "quantize the model first (quantkit rtn, awq or gptq)."
        )
    reason = unsupported(qc)
    if reason:
        raise QuantkitError(
            f"{folder} {reason}; quantkit converts compressed-tensors pack-quantized, "
            "AutoAWQ GEMM and GPTQ v1 int4 checkpoints."
        )
    method = qc["quant_method"]
    ct_args = _ct_args(folder, qc) if method == "compressed-tensors" else None
    parts, others = _split(read_tensors(folder), KEYS[method])
    if not parts:
        raise QuantkitError(
            f"{folder} declares {method} quantization but holds no {KEYS[method][0]} tensors; it is incomplete."
        )
    if ct_args is not None:

        def decode(part, name):
            return decompress_ints(part, ct_args)

        return Int4Checkpoint(folder, method, config, ct_args, parts, others, decode)
    layout = LAYOUTS[method]
    group_size = layout.group_size(qc)
    zero_points, decode = layout.zero_points, layout.decode
    if method == "gptq" and gptq.borrows(qc):  # GPTQModel's v1 words (formats/gptq.py)
        zero_points, decode = partial(zero_points, borrows=True), partial(decode, borrows=True)
    args = _derived_args(parts, zero_points, group_size)
    return Int4Checkpoint(folder, method, config, args, parts, others, _checked(decode, group_size))


def _checked(decode: Callable, group_size: int | None) -> Callable:
    """`decode`, refusing a linear whose scale groups disagree with the config's group size."""

    def run(part, name):
        q, scale, zero, g_idx = decode(part, name)
        if scale.shape[1] != (q.shape[1] // group_size if group_size else 1) or q.shape[1] % (group_size or 1):
            raise QuantkitError(
                f"{name} has {scale.shape[1]} scale groups for {q.shape[1]} inputs, which does not "
                f"match group_size {group_size or -1} in quantization_config; "
                "the checkpoint is damaged."
            )
        return q, scale, zero, g_idx

    return run


def _pack_ct(q, scale, zero, g_idx) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors of one linear (keys without the prefix)."""
    tensors = {
        "weight_packed": pack(q, 4),
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if zero is not None:
        tensors["weight_zero_point"] = pack(zero, 4, dim=0)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


def _convert(ck: Int4Checkpoint, pack_linear: Callable) -> dict[str, torch.Tensor]:
    tensors = dict(ck.others)
    for name, linear in ck.linears():
        tensors.update({f"{name}.{k}": v for k, v in pack_linear(name, *linear).items()})
    return tensors


def to_pack_quantized(ck: Int4Checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    """(quantization_config, tensors) of the compressed-tensors pack-quantized checkpoint."""
    qc = to_quantization_config(QuantScheme("group_0", ck.args, ignore=tuple(ck.unquantized())))
    return qc, _convert(ck, lambda name, q, scale, zero, g_idx: _pack_ct(q, scale, zero, g_idx))


def to_awq_checkpoint(ck: Int4Checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    """(quantization_config, tensors) of the AutoAWQ GEMM checkpoint."""
    if ck.args.actorder == "group":
        raise QuantkitError(
            f"{ck.path} uses act-order groups (g_idx), which the AWQ layout cannot store; "
            "export it to gptq or keep it as compressed-tensors."
        )
    group = ck.args.group_size if ck.args.strategy == "group" else None
    qc = awq.awq_config(group, ck.unquantized())
    return qc, _convert(ck, lambda name, q, scale, zero, g_idx: awq.to_awq(q, scale, zero, name))


def to_gptq_checkpoint(ck: Int4Checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    """(quantization_config, tensors) of the GPTQ v1 checkpoint."""
    group = ck.args.group_size if ck.args.strategy == "group" else None
    made = read_provenance(ck.path) or {}
    damp = (made.get("options") or {}).get("damp") if made.get("algorithm") == "gptq" else None  # as GPTQ ran
    return gptq.gptq_config(ck.args, damp), _convert(
        ck, lambda name, q, scale, zero, g_idx: gptq.to_gptq(q, scale, zero, group, g_idx, name)
    )


WRITERS = {"compressed-tensors": to_pack_quantized, "awq": to_awq_checkpoint, "gptq": to_gptq_checkpoint}


def export(src: str | Path, out: str | Path, fmt: str, overwrite: bool = False) -> Path:
    """Write `src` (compressed-tensors pack-quantized, AWQ or GPTQ) to `out` in layout `fmt`,
    atomically, with its tokenizer files and unquantized tensors."""
    if fmt not in WRITERS:
        raise QuantkitError(f"export format {fmt!r} is unknown; use awq, gptq, compressed-tensors or gguf.")
    src, out = Path(src), Path(out)
    check_output(out, overwrite)
    ck = read_int4(src)
    if ck.format == fmt:
        raise QuantkitError(f"{src} is already a {fmt} checkpoint; use it as is.")
    qc, tensors = WRITERS[fmt](ck)
    provenance = dict(read_provenance(src) or {}, exported_from=str(src), export_format=fmt)
    return save_checkpoint(out, tensors, dict(ck.config, quantization_config=qc), provenance, src, overwrite)


def as_pack_quantized(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """An AWQ or GPTQ checkpoint converted in memory: (compressed-tensors quantization_config, tensors)."""
    return to_pack_quantized(read_int4(folder))
