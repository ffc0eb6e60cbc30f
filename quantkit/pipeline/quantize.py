"""The quantization pipeline: load the float model, run a method (after any transforms,
such as smoothing) block by block through the calibration runner, pack the result and
write the checkpoint. What a method needs and makes comes from its registry entry."""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from quantkit.calibration.datasets import Calibration, calibration_samples, load_documents
from quantkit.calibration.method import Method, QParams
from quantkit.calibration.registry import method as method_entry
from quantkit.calibration.runner import run_blocks
from quantkit.errors import QuantkitError
from quantkit.formats import float_quantized, pack_quantized
from quantkit.formats.checkpoint import check_output, save_checkpoint
from quantkit.malloc import trim_freed_memory
from quantkit.models import kv_cache
from quantkit.models.arch import ArchSpec, arch_for, get_module
from quantkit.models.loading import load_float_model
from quantkit.primitives import check_group_size
from quantkit.progress import Track, no_progress
from quantkit.scheme import PRESETS, QuantScheme, fit_group_size, to_quantization_config
from quantkit.version import __version__

__all__ = ["Calibration", "quantize", "pack_model", "quantized_linears", "check_method"]


def quantized_linears(model: nn.Module, spec: ArchSpec, scheme: QuantScheme) -> dict[str, nn.Linear]:
    """Full name -> module of every block linear the scheme quantizes, group sizes checked."""
    found = {}
    for i, block in enumerate(get_module(model, spec.blocks)):
        for name in spec.linears:
            full = f"{spec.blocks}.{i}.{name}"
            args = scheme.scheme_for(full)
            if args is None:
                continue
            linear = get_module(block, name)
            if args.weights.strategy == "group":
                check_group_size(full, linear.in_features, args.weights.group_size)
            found[full] = linear
    return found


def pack_model(
    model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype: torch.dtype, release: bool = False
) -> dict:
    """The checkpoint's tensors: packed quantized linears, everything else in `dtype`. With
    `release` the model is spent: each quantized linear's float weight is dropped as soon as
    it is packed, so packing needs little memory beyond the packed tensors themselves."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {}
    for key in list(state):
        t = state.pop(key)
        module = key.rsplit(".", 1)[0]
        if module in results and key.endswith(".weight"):
            p, args = results[module], scheme.scheme_for(module).weights
            if scheme.format == "float-quantized":
                packed = float_quantized.compress(t, p.scale, args, p.input_scale)
            else:
                packed = pack_quantized.compress(t, p.scale, p.zero_point, args, p.g_idx)
            tensors.update({f"{module}.{k}": v for k, v in packed.items()})
            if release:
                get_module(model, module).weight = None
        else:
            keep = not t.is_floating_point() or key.endswith("_scale")  # KV-cache scales stay fp32
            tensors[key] = t if keep else t.to(dtype)
    return tensors


def checkpoint_config(model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype) -> dict:
    """config.json of the quantized model: the float config plus `quantization_config`."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ignore = tuple(n for n in linears if n not in results)
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = to_quantization_config(scheme.replace(ignore=ignore))
    return config


def _observe_kv_after(step, spec: ArchSpec):
    """Record K/V maxima only in the runner's pass over the quantized block, not in the
    algorithm's own forwards."""

    def wrapped(index, prefix, block, inputs):
        state = getattr(get_module(block, spec.attention), kv_cache.STATE_ATTR)
        state.recording = False
        step(index, prefix, block, inputs)
        state.recording = True

    return wrapped


def check_scaled_together(spec: ArchSpec, blocks: int, linears: list[str]) -> None:
    """AWQ and SmoothQuant fold one scale into the op before each mapping's linears and
    compensate only the quantized ones, so a mapping must be quantized whole or not at all."""
    for i in range(blocks):
        for m in spec.awq:
            names = [f"{spec.blocks}.{i}.{n}" for n in m.linears]
            left_out = [n for n in names if n not in linears]
            if left_out and len(left_out) < len(names):
                raise QuantkitError(
                    f"{left_out[0]} is ignored but shares the scales folded into "
                    f"{spec.blocks}.{i}.{m.prev} with {', '.join(m.linears)}; with awq or fp8 "
                    "smoothing ignore all of them or none."
                )


def check_method(
    method: Method, scheme: QuantScheme, transforms: list[tuple[Method, object]] = (), path: str | None = None
) -> None:
    """A `QuantkitError` when the scheme (or a per-module override) does not fit the weight
    method or a transform run before it; `path` (a recipe key) names where the mistake is."""
    where = path or "scheme"
    folding = [m.name for m in (method, *(t for t, _ in transforms)) if m.folds_scales]
    if scheme.overrides and folding:
        raise QuantkitError(
            f"{where}.overrides: {folding[0]} folds one scale into the op before several linears, so "
            "it cannot give some of them other args; use rtn, gptq or fp8 without smoothing, or "
            "only ignore: true overrides."
        )
    for p, s in [(where, scheme)] + [(f"{where}.overrides[{i}]", o) for i, o in enumerate(scheme.overrides)]:
        if s.weights is None or s.format != method.format:
            fits = " or ".join(name for name, ps in PRESETS.items() if ps.weights and ps.format == method.format)
            raise QuantkitError(
                f"{p}: the {method.name} step cannot make {s.format} weights; use {fits}."
                if path
                else f"scheme {scheme.name!r} does not fit {method.name}; use {fits}."
            )
        if s.weights.actorder and not method.actorder:
            raise QuantkitError(
                f"{p}.actorder: {s.weights.actorder!r} is not allowed; use null with the "
                f"{method.name} step (act-order is GPTQ's)."
            )
    for t, _ in transforms:
        if method.name not in t.before:
            raise QuantkitError(f"steps: {t.name} runs before {' or '.join(t.before)}, not before {method.name}.")
        if t.needs_activations and scheme.input_activations is None:
            raise QuantkitError(
                f"{where}: {t.name} balances activation against weight quantization, but "
                f"{scheme.name!r} keeps activations in float; use fp8-dynamic or fp8."
            )


def _options(method: Method, options) -> object:
    """The method's options dataclass from a dict (or the dataclass itself)."""
    if isinstance(options, method.options):
        return options
    known = {f.name for f in dataclasses.fields(method.options)}
    unknown = [k for k in (options or {}) if k not in known]
    if unknown:
        raise QuantkitError(
            f"{method.name} has no option {unknown[0]!r}; its options are {', '.join(sorted(known)) or 'none'}."
        )
    return method.options(**{k: str(v) if isinstance(v, os.PathLike) else v for k, v in (options or {}).items()})


def _make_step(
    method: Method,
    options,
    transforms,
    spec: ArchSpec,
    scheme: QuantScheme,
    linears: list[str],
    dtype,
    results: dict,
    log,
):
    """The runner step: each transform's step, then the method's; with per-module overrides,
    one method step per scheme, each blind to the other schemes' linears."""
    steps = [t.make_step(spec, scheme, o, results, dtype, log) for t, o in transforms]
    if not scheme.overrides:
        steps.append(method.make_step(spec, scheme, options, results, dtype, log))
    else:
        parts = [(s, [n for n in linears if scheme.scheme_for(n) is s]) for s in (scheme, *scheme.overrides)]
        steps += [
            method.make_step(
                spec,
                s.replace(ignore=scheme.ignore + tuple(n for n in linears if n not in names), overrides=()),
                options,
                results,
                dtype,
                log,
            )
            for s, names in parts
            if names
        ]

    def step(index, prefix, block, inputs):
        for s in steps:
            s(index, prefix, block, inputs)

    step.finish = lambda: [s.finish() for s in steps if hasattr(s, "finish")]
    return step


def quantize(
    model_name: str,
    scheme: QuantScheme,
    out: Path,
    method: str = "rtn",
    calibration: Calibration | None = None,
    options: dict | object | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    recipe: dict | None = None,
    transforms: list[tuple[str, dict | object]] = (),
) -> dict:
    """Quantize `model_name` with `method` (rtn, awq, gptq, fp8; see the registry) and write
    the checkpoint to `out`. `options` are the method's (a dict or its options dataclass);
    `transforms` (name, options) run on each block first (smooth). `recipe` (the
    `quantkit run` recipe this call carries out) is recorded in the provenance. Returns the
    provenance it recorded."""
    m = method_entry(method)
    if m.role != "weights":
        raise QuantkitError(f"{method} does not quantize weights; use rtn, awq, gptq or fp8.")
    transforms = [(method_entry(name), _options(method_entry(name), o)) for name, o in transforms]
    check_method(m, scheme, transforms)
    options = _options(m, options)
    calibration = calibration or Calibration()
    out = Path(out)
    check_output(out, overwrite)
    start = time.perf_counter()
    model, tokenizer, source = load_float_model(model_name, owned=True)
    trim_freed_memory()  # what loading left behind
    spec = arch_for(model.config)
    dtype = model.dtype
    scheme = _fit_groups(model, spec, scheme, log)
    linears = list(quantized_linears(model, spec, scheme))  # validates group sizes before any work
    if any(x.folds_scales for x in (m, *(t for t, _ in transforms))):
        check_scaled_together(spec, len(get_module(model, spec.blocks)), linears)
    results: dict[str, QParams] = {}
    kv = scheme.kv_cache
    step = _make_step(m, options, transforms, spec, scheme, linears, dtype, results, log)
    needs_data = m.needs_data(scheme, options) or any(t.needs_data(scheme, o) for t, o in transforms)
    samples = None
    if needs_data or kv is not None:
        c = calibration
        samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    model.float()
    if kv is None:
        run_blocks(model, spec, step, samples, batch_size=calibration.batch_size, device=device, track=track)
    else:
        with kv_cache.record_kv_amax(model):
            run_blocks(model, spec, _observe_kv_after(step, spec), samples, calibration.batch_size, device, track)
        kv_cache.quantize_kv(model, kv_cache.calibrated_scales(model, kv), kv)
    step.finish()
    tensors = pack_model(model, scheme, results, dtype, release=True)
    provenance = {
        "quantkit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_name),
        "algorithm": method,
        "scheme": scheme.name,
        "weights": dataclasses.asdict(scheme.weights),
        "input_activations": dataclasses.asdict(scheme.input_activations) if scheme.input_activations else None,
        "kv_cache": dataclasses.asdict(kv) if kv else None,
        "calibration": dataclasses.asdict(calibration) if samples is not None else None,
        "options": dataclasses.asdict(options),
        "transforms": {t.name: dataclasses.asdict(o) for t, o in transforms},
        "quantized_linears": len(results),
        "wall_time_s": round(time.perf_counter() - start, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "recipe": recipe,
    }
    save_checkpoint(out, tensors, checkpoint_config(model, scheme, results, dtype), provenance, source, overwrite)
    return provenance


def _fit_groups(model: nn.Module, spec: ArchSpec, scheme: QuantScheme, log) -> QuantScheme:
    """Resolve an automatic group size against the input widths of the linears it covers."""
    widths = {
        f"{spec.blocks}.{i}.{n}": get_module(block, n).in_features
        for i, block in enumerate(get_module(model, spec.blocks))
        for n in spec.linears
    }
    scheme, notes = fit_group_size(scheme, widths)
    for note in notes:
        if log:
            log(note)
    return scheme
