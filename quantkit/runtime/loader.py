"""`quantkit.load`: a float model or a packed checkpoint as a torch model whose
quantized linears compute through `quantkit.ops`.

Two phases, as gpt-fast does it: the checkpoint on disk is the plain interoperable
layout; the module tree is built empty (parameters on the meta device), the targeted
linears are swapped for packed modules, and the file's tensors are assigned in place.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from quantkit import ops
from quantkit.errors import QuantkitError
from quantkit.formats import int_quantized, interop
from quantkit.formats.checkpoint import read_tensors
from quantkit.models import kv_cache
from quantkit.models.arch import arch_for
from quantkit.models.loading import (
    assign_weights,
    check_causal_lm,
    empty_model,
    load_float_model,
    missing_and_unexpected,
    resolve_model,
)
from quantkit.runtime import qlinear_float
from quantkit.runtime.qlinear import Fp8Linear, Int8Linear, PackedInt4Linear, PackedInt8Linear, dtype_name
from quantkit.scheme import CheckpointConfig, from_quantization_config

SUPPORTED = (
    "compressed-tensors pack-quantized (int4, int8; int4 on fp8 activations, w4afp8; other widths dequantized at load)",
    "compressed-tensors float-quantized (fp8)",
    "compressed-tensors int-quantized (W8A8 int8; int4 on fp8 activations, repacked at load)",
    "compressed-tensors float-quantized block (fp8 128x128), nvfp4-pack-quantized, mxfp4-pack-quantized, "
    "mxfp8-quantized (dequantized at load)",
    "compressed-tensors mixed-precision (config groups of the formats above)",
    "AutoAWQ GEMM (int4)",
    "GPTQ v1 (int4)",
)
# dense: float weights (e.g. KV-cache scales only)
FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "dense", "mixed-precision", *qlinear_float.FORMATS[1:])
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or one of `DTYPES`; None for "auto" (or None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise QuantkitError(f"dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
    return None if dtype == "auto" else getattr(torch, dtype)


def serving_dtype(config, dtype: torch.dtype | None, device: str = "cpu") -> tuple[torch.dtype, str | None]:
    """The dtype the engine runs a checkpoint in, and a note when it is not the checkpoint's.
    An explicit `dtype` is kept. "auto" follows vLLM: the checkpoint's dtype, except that a
    float32 or float16 checkpoint runs in bfloat16 where the device computes it natively (a GPU,
    or a CPU with AVX512-BF16 or AMX; on AVX2-only CPUs float32 stays the fast one, and float16
    becomes float32 there)."""
    if dtype is not None:
        return dtype, None
    saved = getattr(config, "dtype", None) or torch.float32
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    if saved == torch.bfloat16:
        return saved, None
    fast = torch.bfloat16 if ops.native_bf16(device) else torch.float32
    if fast == saved:
        return saved, None
    return fast, (
        f"the {dtype_name(saved)} checkpoint runs in {dtype_name(fast)}, the faster of the two on this {device} "
        f"(--dtype {dtype_name(saved)} keeps it)."
    )


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _quantized_linear(linear: nn.Linear, scheme, dtype: torch.dtype, path: Path) -> nn.Module:
    w, acts = scheme.weights, scheme.input_activations
    shape = (linear.in_features, linear.out_features, linear.bias is not None)
    if w.type == "float":
        return Fp8Linear(*shape, w, acts is not None and not acts.dynamic, dtype)
    if w.num_bits == 4 and (acts is None or _fp8_per_token(acts)):
        return PackedInt4Linear(*shape, w, dtype, acts)
    if w.num_bits == 8 and acts is None:
        return PackedInt8Linear(*shape, w, dtype)
    if w.type == "int" and acts is not None:
        why = int_quantized.unsupported(scheme)
        if why:
            raise QuantkitError(
                f"{path} is int-quantized, but {why}; quantkit runs int8 weights (per channel or tensor) "
                "with int8 activations quantized per token at run time."
            )
        return Int8Linear(*shape, w, acts, dtype)
    raise QuantkitError(
        f"{path} quantizes weights to int{w.num_bits}"
        f"{' with quantized activations' if acts else ''}; quantkit loads {', '.join(SUPPORTED)}."
    )


def _repack_int_quantized(tensors: dict, name: str, scheme, path: Path) -> None:
    try:
        int_quantized.as_pack_quantized(tensors, name, scheme.weights)
    except ValueError as e:
        raise QuantkitError(
            f"checkpoint {path} is int-quantized with int{scheme.weights.num_bits} weights, but {e}; re-create it."
        ) from None


def _fp8_per_token(acts) -> bool:
    """w4afp8's activations: fp8 per token, taken at run time."""
    return acts.type == "float" and acts.num_bits == 8 and acts.strategy == "token" and acts.dynamic is True


def load(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """A model in eval mode on the CPU: float models through transformers, compressed-
    tensors `pack-quantized` checkpoints (and AutoAWQ GEMM / GPTQ v1 ones, converted to
    pack-quantized in memory) with `PackedInt4Linear` modules and `float-quantized` ones
    with `Fp8Linear` modules."""

    path = resolve_model(path)
    config = check_causal_lm(path)
    qc = getattr(config, "quantization_config", None) or interop.sidecar_config(path)
    if qc is None:
        return load_float_model(path, dtype)[0]
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    ckpt, tensors = _packed_checkpoint(path, qc)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model, dtype = empty_model(config, dtype)
    dequantized = {}
    for name, module in list(model.named_modules()):
        scheme = ckpt.scheme_for(name) if isinstance(module, nn.Linear) else None
        if scheme is not None and qlinear_float.dequantized(scheme):
            _replace(model, name, qlinear_float.make_linear(module, scheme, dtype))
            dequantized[name] = scheme
        elif scheme is not None:
            if ckpt.format == "int-quantized" and scheme.format == "pack-quantized":  # e.g. llm-compressor's W4AFP8
                _repack_int_quantized(tensors, name, scheme, path)
            _replace(model, name, _quantized_linear(module, scheme, dtype, path))
    _dequantize(tensors, dequantized, dtype, path)
    model.load_notes = qlinear_float.load_notes(Counter(map(qlinear_float.kind, dequantized.values())), dtype)
    model.load_notes += _fp8_activation_notes(model)
    kv_tensors = {k: tensors.pop(k) for k in list(tensors) if k.endswith((".k_scale", ".v_scale"))}
    missing, unexpected = missing_and_unexpected(model, tensors)
    for k in [k for k in unexpected if k.endswith(".bias") and not tensors[k].any()]:  # older AutoGPTQ saves these
        unexpected.discard(k)
        del tensors[k]
    if missing or unexpected:
        what = f"lacks {sorted(missing)[:3]}" if missing else f"has unexpected {sorted(unexpected)[:3]}"
        raise QuantkitError(f"checkpoint {path} {what}; it is truncated or was made for another model.")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    tensors = {k: v.to(dtype) if v.dtype in floats and not k.endswith("_scale") else v for k, v in tensors.items()}
    assign_weights(model, tensors)
    if ckpt.kv_cache is not None:
        _quantize_kv(model, kv_tensors, ckpt.kv_cache, path)
    return model.eval()


def _fp8_activation_notes(model: nn.Module) -> list[str]:
    n = sum(isinstance(m, PackedInt4Linear) and m.acts is not None for m in model.modules())
    if not n:
        return []
    return [
        f"{n} w4afp8 linears run the int4 kernels on fp8 (e4m3) activations fake-quantized per token as "
        "compressed-tensors does (no fp8 x int4 kernel on the CPU)."
    ]


def _dequantize(tensors: dict, schemes: dict, dtype: torch.dtype, path: Path) -> None:
    """Replace the stored tensors of each linear of `schemes` (name -> scheme) by its weight
    dequantized to `dtype` (`qlinear_float`); bias and input global scale stay."""
    for name, scheme in schemes.items():
        parts = {}
        for suffix in (
            "weight", "weight_packed", "weight_scale", "weight_global_scale", "weight_shape", "weight_zero_point",
            "weight_g_idx",
        ):  # fmt: skip
            if f"{name}.{suffix}" in tensors:
                parts[suffix] = tensors.pop(f"{name}.{suffix}")
        try:
            tensors[f"{name}.weight"] = qlinear_float.dequantize_linear(parts, scheme, dtype)
        except (KeyError, RuntimeError) as e:
            raise QuantkitError(
                f"checkpoint {path} holds {name} unlike its {scheme.format} config ({e}); re-create it."
            ) from None


def _packed_checkpoint(path: Path, qc: dict) -> tuple[CheckpointConfig, dict[str, torch.Tensor]]:
    """The scheme and tensors of a compressed-tensors checkpoint, or of an AWQ / GPTQ one
    converted in memory to compressed-tensors pack-quantized."""
    if qc.get("quant_method") == "compressed-tensors" and qc.get("format") in FORMATS:
        return from_quantization_config(qc), read_tensors(path)
    reason = interop.unsupported(qc)
    if reason:
        raise QuantkitError(f"{path} {reason}; quantkit loads {', '.join(SUPPORTED)}.")
    qc, tensors = interop.as_pack_quantized(path)
    return from_quantization_config(qc), tensors


def _quantize_kv(model: nn.Module, tensors: dict, args, path: Path) -> None:
    """K and V are fake-quantized with the checkpoint's scales, as serving will store them."""
    spec = arch_for(model.config)
    scales = {}
    for i in range(len(model.get_submodule(spec.blocks))):
        names = [f"{spec.blocks}.{i}.{spec.attention}.{n}" for n in ("k_scale", "v_scale")]
        if any(n not in tensors for n in names):
            raise QuantkitError(
                f"checkpoint {path} declares a KV-cache scheme but lacks {names[0]}; re-run quantkit kv on it."
            )
        scales[i] = tuple(tensors[n] for n in names)
    kv_cache.quantize_kv(model, scales, args)
