"""What a checkpoint stores for each entry of a model's state, whatever the on-disk format:
a quantized linear's weight as its format's tensors (`compress`), anything else in the
checkpoint's float dtype (integers and scales as they are); and their sizes
(`tensor_bytes`, `linear_bytes`, `entry_bytes`), read from each format's `param_info`. The
quantize pipeline packs with the one and checks the disk with the other, `plan` counts
memory and mixed precision counts bits with it too, so a format's sizes are written down
once, next to its layout."""

from __future__ import annotations

import math

import torch

from quantkit.formats import float_quantized, fp4_packed, int_quantized, mx_quantized, pack_quantized
from quantkit.scheme import QuantArgs

FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
FLOAT_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}  # a float width's stand-in


def compress(fmt: str, weight: torch.Tensor, args: QuantArgs, p) -> dict[str, torch.Tensor]:
    """The stored tensors of one linear in format `fmt` (keys without the module prefix),
    from its float weight and the `QParams` its method chose."""
    if fmt == "float-quantized":
        return float_quantized.compress(weight, p.scale, args, p.input_scale)
    if fmt in FP4_FORMATS:
        return fp4_packed.compress(weight, p.scale, args, p.global_scale, p.input_scale)
    if fmt == "mxfp8-quantized":
        return mx_quantized.compress(weight, p.scale, args)
    if fmt == "int-quantized":
        return int_quantized.compress(weight, p.scale, args)
    return pack_quantized.compress(weight, p.scale, p.zero_point, args, p.g_idx)


def tensor_bytes(fmt: str, out: int, inp: int, args: QuantArgs, float_bytes: int, static_input=False) -> dict:
    """Tensor name (without the module prefix) -> bytes, of one [out, in] linear stored in
    format `fmt` with weights `args` in a checkpoint whose float tensors take `float_bytes`
    each; `static_input`: a calibrated activation scale is stored too."""
    dtype = FLOAT_DTYPES[float_bytes]
    if fmt == "float-quantized":
        info = float_quantized.param_info(out, inp, args, static_input, dtype)
    elif fmt in FP4_FORMATS:
        info = fp4_packed.param_info(out, inp, args, static_input)
    elif fmt == "mxfp8-quantized":
        info = mx_quantized.param_info(out, inp, args)
    elif fmt == "int-quantized":
        info = int_quantized.param_info(out, inp, args, dtype)
    else:
        info = pack_quantized.param_info(out, inp, args, dtype)
    return {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in info.items()}


def linear_bytes(fmt: str, out: int, inp: int, args: QuantArgs | None, float_bytes: int, static_input=False) -> int:
    """Bytes of one [out, in] linear in the checkpoint: its stored tensors, or its float
    weight when `args` is None."""
    if args is None:
        return out * inp * float_bytes
    return sum(tensor_bytes(fmt, out, inp, args, float_bytes, static_input).values())


def _kept(key: str, t: torch.Tensor) -> bool:
    """Whether a state entry keeps its own dtype (integers; scales, such as KV-cache scales, stay fp32)."""
    return not t.is_floating_point() or key.endswith("_scale")


def pack_entry(key: str, t: torch.Tensor, schemes: dict, results: dict, dtype) -> dict:
    """What the checkpoint holds for the state entry `key`: a quantized linear's weight
    packed in its scheme's format with its weights' arguments (`schemes`, by module: a
    mixed-precision checkpoint holds several formats) and its `QParams` (`results`), under
    its name's tensors; anything else in `dtype` unless `_kept`."""
    module = key.rsplit(".", 1)[0]
    if module in results and key.endswith(".weight"):
        s = schemes[module]
        packed = compress(s.format, t, s.weights, results[module])
        return {f"{module}.{k}": v for k, v in packed.items()}
    return {key: t if _kept(key, t) else t.to(dtype)}


def entry_bytes(key: str, t: torch.Tensor, schemes: dict, dtype: torch.dtype) -> int:
    """Bytes the checkpoint holds for the state entry `key` (`t` may be on the meta device),
    a linear in `schemes` (module -> scheme) quantized."""
    module = key.rsplit(".", 1)[0]
    s = schemes.get(module)
    if s is not None and key.endswith(".weight"):
        static = s.input_activations is not None and s.input_activations.dynamic is not True  # "local": a global scale
        return linear_bytes(s.format, *t.shape, s.weights, dtype.itemsize, static)
    return t.numel() * (t.element_size() if _kept(key, t) else dtype.itemsize)
