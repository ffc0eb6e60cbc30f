"""`quantkit inspect`: what a checkpoint holds and what it saves against the float model."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_provenance, weight_files
from quantkit.models.loading import read_config, resolve_model

_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1, "F64": 8}


def _shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for f in weight_files(path):
        try:
            with safe_open(f, "pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    out[key] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:
            raise QuantkitError(
                f"{f} is unreadable or truncated ({e}); re-create or re-download the checkpoint."
            ) from None
    if not out:
        raise QuantkitError(f"{path} has no .safetensors files; it is not a complete checkpoint.")
    return out


def describe(model_name: str) -> dict:
    """Scheme, quantized/ignored modules, bytes on disk vs the float model, bits per
    quantized weight, and provenance."""
    path = resolve_model(model_name)
    config = read_config(path)
    qc = config.get("quantization_config") or {}
    float_bytes = _BYTES.get(
        {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(
            str(config.get("dtype") or config.get("torch_dtype") or "float32"), "F32"
        ),
        4,
    )
    shapes = _shapes(path)
    packed = (".weight_packed", ".qweight")  # compressed-tensors; AutoAWQ and GPTQ
    quantized = sorted(k.rsplit(".", 1)[0] for k in shapes if k.endswith(packed) or _stored_quantized(k, shapes))
    groups = qc.get("config_groups") or (
        {"group_0": {"weights": _int4_args(qc)}} if qc.get("quant_method") in ("awq", "gptq") else {}
    )
    bits = _bits_of(qc, groups)
    q_bytes = q_params = 0
    float_total = 0
    for key, (shape, dtype) in shapes.items():
        n = 1
        for s in shape:
            n *= s
        module = key.rsplit(".", 1)[0]
        if module in quantized:
            q_bytes += n * _BYTES.get(dtype, 4)
            if key.endswith(".weight_shape"):
                continue
            if key.endswith(packed):  # words of (8 * word bytes) // num_bits values, whatever the layout
                numel = shape[0] * shape[1] * 8 * _BYTES.get(dtype, 4) // bits(module)  # fp4: 2 per uint8
                q_params += numel
                float_total += numel * float_bytes
            elif key.endswith(".weight"):  # int-quantized / float-quantized: one 8-bit value per weight
                q_params += n
                float_total += n * float_bytes
        else:
            float_total += n * float_bytes
    disk = sum(f.stat().st_size for f in weight_files(path))
    provenance = read_provenance(path)
    return {
        "path": str(path),
        "quant_method": qc.get("quant_method", "none"),
        "format": qc.get("format", "dense"),
        "weights": {name: g.get("weights") for name, g in groups.items()},
        "input_activations": {name: g.get("input_activations") for name, g in groups.items()},
        "kv_cache_scheme": qc.get("kv_cache_scheme"),
        "quantized_modules": quantized,
        "ignored_modules": qc.get("ignore", qc.get("modules_to_not_convert")) or [],
        "disk_bytes": disk,
        "float_bytes": float_total,
        "compression": float_total / disk if disk else None,
        "bits_per_weight": 8 * q_bytes / q_params if q_params else None,
        "experts": expert_coverage(provenance),
        "provenance": provenance,
    }


def _stored_quantized(key: str, shapes: dict) -> bool:
    """Whether `key` is an 8-bit weight stored as it is (int-quantized int8, float-quantized fp8)."""
    return key.endswith(".weight") and shapes[key][1] in ("I8", "F8_E4M3") and key + "_scale" in shapes


def expert_coverage(provenance: dict | None) -> dict | None:
    """Per sparse block of a mixture-of-experts checkpoint: the calibration tokens routed to
    each expert and the experts calibrated on every token instead (routed fewer than the
    run's min_expert_tokens); None when the run recorded no routing."""
    counts = (provenance or {}).get("expert_tokens")
    if not counts:
        return None
    least = max(1, ((provenance or {}).get("calibration") or {}).get("min_expert_tokens", 1))
    return {
        block: {"tokens": tokens, "all_tokens": [e for e, n in enumerate(tokens) if n < least]}
        for block, tokens in counts.items()
    }


def _bits_of(qc: dict, groups: dict):
    """module name -> the bits per value of its packed weight (the config group that targets it)."""
    if qc.get("quant_method") == "compressed-tensors":
        from quantkit.scheme import from_quantization_config

        ckpt = from_quantization_config(qc)
        return lambda module: ckpt.scheme_for(module).weights.num_bits
    return lambda module: int(groups["group_0"]["weights"]["num_bits"])


def _int4_args(qc: dict) -> dict:
    """The weight args of an AutoAWQ or GPTQ quantization_config, in the scheme vocabulary."""
    awq = qc.get("quant_method") == "awq"
    bits = qc.get("bits", qc.get("w_bit", 4))
    group_size = qc.get("group_size", qc.get("q_group_size"))
    return {
        "type": "int",
        "num_bits": bits,
        "strategy": "group" if group_size and group_size > 0 else "channel",
        "group_size": group_size if group_size and group_size > 0 else None,
        "symmetric": not qc.get("zero_point", True) if awq else bool(qc.get("sym", True)),
        "actorder": "group" if qc.get("desc_act") else None,
    }
