"""The quantization pipeline: load the float model, run an algorithm block by block
through the calibration runner, pack the result and write the checkpoint."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from quantkit import __version__
from quantkit.calibration.datasets import calibration_samples, load_documents
from quantkit.calibration.runner import run_blocks
from quantkit.calibration.steps import STEPS, QParams
from quantkit.errors import QuantkitError
from quantkit.formats import float_quantized, pack_quantized
from quantkit.formats.checkpoint import check_output, save_checkpoint
from quantkit.malloc import trim_freed_memory
from quantkit.models.arch import ArchSpec, arch_for, get_module
from quantkit.models.loading import load_float_model
from quantkit.primitives import check_group_size
from quantkit.progress import Track, no_progress
from quantkit.runtime import kv_attention
from quantkit.scheme import QuantScheme, to_quantization_config


@dataclass(frozen=True)
class Calibration:
    """Which text to calibrate on and how to cut it (see `calibration_samples`)."""

    dataset: str = "news"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 8


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


def pack_model(model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype: torch.dtype,
               release: bool = False) -> dict:
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
        state = getattr(get_module(block, spec.attention), kv_attention.STATE_ATTR)
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
                raise QuantkitError(f"{left_out[0]} is ignored but shares the scales folded into "
                                    f"{spec.blocks}.{i}.{m.prev} with {', '.join(m.linears)}; with awq or fp8 "
                                    "smoothing ignore all of them or none.")


def _make_step(algorithm: str, spec: ArchSpec, scheme: QuantScheme, linears: list[str], dtype, results: dict,
               log, options: dict):
    """The algorithm's runner step; with per-module overrides, one step per scheme, each
    blind to the other schemes' linears, run one after the other on every block."""
    if not scheme.overrides:
        return STEPS[algorithm](spec, scheme, dtype, results, log, **options)
    parts = [(s, [n for n in linears if scheme.scheme_for(n) is s]) for s in (scheme, *scheme.overrides)]
    steps = [STEPS[algorithm](spec, s.replace(ignore=scheme.ignore + tuple(n for n in linears if n not in names),
                                               overrides=()), dtype, results, log, **options)
             for s, names in parts if names]

    def step(index, prefix, block, inputs):
        for s in steps:
            s(index, prefix, block, inputs)

    step.needs_data = any(s.needs_data for s in steps)
    return step


def _read_search(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as e:
        raise QuantkitError(f"cannot read the saved search {path} ({e}); pass a file written by --save-search.") from None


def _write_search(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "quantkit-awq-search"})
    tmp.replace(path)


def quantize(
    model_name: str,
    scheme: QuantScheme,
    out: Path,
    algorithm: str = "rtn",
    calibration: Calibration | None = None,
    options: dict | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    recipe: dict | None = None,
) -> dict:
    """Quantize `model_name` with `algorithm` (rtn, gptq, ...) and write the checkpoint to
    `out`; `options` go to the algorithm's step, `recipe` (the `quantkit run` recipe this
    call carries out) is recorded in the provenance. Returns the provenance it recorded."""
    if algorithm not in STEPS:
        raise QuantkitError(f"algorithm {algorithm!r} is unknown; use one of {', '.join(STEPS)}.")
    calibration = calibration or Calibration()
    wanted = "float-quantized" if algorithm == "fp8" else "pack-quantized"
    if any(s.weights is None or s.format != wanted for s in (scheme, *scheme.overrides)):
        hint = "fp8-dynamic or fp8" if algorithm == "fp8" else "w4a16 or w4a16-asym"
        raise QuantkitError(f"scheme {scheme.name!r} does not fit {algorithm}; use {hint}.")
    if scheme.overrides and (algorithm == "awq" or (options or {}).get("smooth_grid")):
        raise QuantkitError(f"{'awq' if algorithm == 'awq' else 'fp8 smoothing'} folds one scale into the op before "
                            "several linears, so it cannot give some of them other args; use per-module overrides "
                            "with rtn, gptq or fp8 without smoothing (ignoring modules works with every algorithm).")
    out = Path(out)
    check_output(out, overwrite)
    start = time.perf_counter()
    model, tokenizer, source = load_float_model(model_name, owned=True)
    trim_freed_memory()  # what loading left behind
    spec = arch_for(model.config)
    dtype = model.dtype
    linears = list(quantized_linears(model, spec, scheme))  # validates group sizes before any work
    if algorithm == "awq" or (options or {}).get("smooth_grid"):
        check_scaled_together(spec, len(get_module(model, spec.blocks)), linears)
    results: dict[str, QParams] = {}
    kv = scheme.kv_cache
    options = dict(options or {})
    save_search, load_search = options.pop("save_search", None), options.pop("load_search", None)
    if load_search:
        options["loaded"] = _read_search(Path(load_search))
    if save_search:
        options["record"] = {}
    step = _make_step(algorithm, spec, scheme, linears, dtype, results, log, options)
    samples = None
    if step.needs_data or kv is not None:
        c = calibration
        samples = calibration_samples(tokenizer, load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed)
    model.float()
    if kv is None:
        run_blocks(model, spec, step, samples, batch_size=calibration.batch_size, device=device, track=track)
    else:
        with kv_attention.record_kv_amax(model):
            run_blocks(model, spec, _observe_kv_after(step, spec), samples, calibration.batch_size, device, track)
        kv_attention.quantize_kv(model, kv_attention.calibrated_scales(model, kv), kv)
    if save_search:
        _write_search(Path(save_search), options["record"])
    tensors = pack_model(model, scheme, results, dtype, release=True)
    provenance = {
        "quantkit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_name),
        "algorithm": algorithm,
        "scheme": scheme.name,
        "weights": dataclasses.asdict(scheme.weights),
        "input_activations": dataclasses.asdict(scheme.input_activations) if scheme.input_activations else None,
        "kv_cache": dataclasses.asdict(kv) if kv else None,
        "calibration": dataclasses.asdict(calibration) if samples is not None else None,
        "options": {k: v for k, v in options.items() if k not in ("loaded", "record")},
        "search": {"saved_to": str(save_search) if save_search else None,
                   "loaded_from": str(load_search) if load_search else None},
        "quantized_linears": len(results),
        "wall_time_s": round(time.perf_counter() - start, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "recipe": recipe,
    }
    save_checkpoint(out, tensors, checkpoint_config(model, scheme, results, dtype), provenance, source, overwrite)
    return provenance
