"""The quantization pipeline: load the float model, run an algorithm block by block
through the calibration runner, pack the result and write the checkpoint."""

from __future__ import annotations

import dataclasses
import resource
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from quantkit import __version__
from quantkit.calibration import rtn
from quantkit.calibration.runner import BlockInputs, run_blocks
from quantkit.errors import QuantkitError
from quantkit.formats import pack_quantized
from quantkit.formats.checkpoint import check_output, save_checkpoint
from quantkit.models.arch import ArchSpec, arch_for, get_module
from quantkit.models.loading import load_float_model
from quantkit.primitives import check_group_size
from quantkit.progress import Track, no_progress
from quantkit.scheme import QuantScheme, to_quantization_config


@dataclass(frozen=True)
class Calibration:
    """Which text to calibrate on and how to cut it (see `calibration_samples`)."""

    dataset: str = "news"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 8


@dataclass
class QParams:
    """The quantization parameters an algorithm chose for one linear."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None


def quantized_linears(model: nn.Module, spec: ArchSpec, scheme: QuantScheme) -> dict[str, nn.Linear]:
    """Full name -> module of every block linear the scheme quantizes, group sizes checked."""
    found = {}
    for i, block in enumerate(get_module(model, spec.blocks)):
        for name in spec.linears:
            full = f"{spec.blocks}.{i}.{name}"
            if scheme.is_ignored(full):
                continue
            linear = get_module(block, name)
            if scheme.weights.strategy == "group":
                check_group_size(full, linear.in_features, scheme.weights.group_size)
            found[full] = linear
    return found


def rtn_step(spec: ArchSpec, scheme: QuantScheme, scale_dtype: torch.dtype, results: dict[str, QParams]):
    """A runner step that rounds every targeted linear of a block to nearest."""

    def step(index: int, prefix: str, block: nn.Module, inputs: BlockInputs | None) -> None:
        for name in spec.linears:
            full = f"{prefix}.{name}"
            if scheme.is_ignored(full):
                continue
            linear = get_module(block, name)
            w, scale, zero = rtn.quantize_weight(linear.weight.data, scheme.weights, scale_dtype)
            linear.weight.data = w
            results[full] = QParams(scale, zero)

    return step


def pack_model(model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype: torch.dtype) -> dict:
    """The checkpoint's tensors: packed quantized linears, everything else in `dtype`."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {}
    for key, t in state.items():
        module = key.rsplit(".", 1)[0]
        if module in results and key.endswith(".weight"):
            p = results[module]
            packed = pack_quantized.compress(t, p.scale, p.zero_point, scheme.weights, p.g_idx)
            tensors.update({f"{module}.{k}": v for k, v in packed.items()})
        else:
            tensors[key] = t.to(dtype) if t.is_floating_point() else t
    return tensors


def checkpoint_config(model: nn.Module, scheme: QuantScheme, results: dict[str, QParams], dtype) -> dict:
    """config.json of the quantized model: the float config plus `quantization_config`."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ignore = tuple(n for n in linears if n not in results)
    config = model.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = to_quantization_config(scheme.replace(ignore=ignore))
    return config


def quantize(
    model_name: str,
    scheme: QuantScheme,
    out: Path,
    algorithm: str = "rtn",
    calibration: Calibration | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    track: Track = no_progress,
) -> dict:
    """Quantize `model_name` with `algorithm` and write the checkpoint to `out`; returns its provenance."""
    if algorithm != "rtn":
        raise QuantkitError(f"algorithm {algorithm!r} is unknown; use rtn.")
    if scheme.weights is None or scheme.format != "pack-quantized":
        raise QuantkitError(f"scheme {scheme.name!r} is not an int weight-only scheme; use w4a16 or w4a16-asym.")
    out = Path(out)
    check_output(out, overwrite)
    start = time.perf_counter()
    model, _, source = load_float_model(model_name)
    spec = arch_for(model.config)
    dtype = model.dtype
    quantized_linears(model, spec, scheme)  # validates group sizes before any work
    model.float()
    results: dict[str, QParams] = {}
    run_blocks(model, spec, rtn_step(spec, scheme, dtype, results), None, device=device, track=track)
    tensors = pack_model(model, scheme, results, dtype)
    provenance = {
        "quantkit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_name),
        "algorithm": algorithm,
        "scheme": scheme.name,
        "weights": dataclasses.asdict(scheme.weights),
        "calibration": dataclasses.asdict(calibration) if calibration else None,
        "quantized_linears": len(results),
        "wall_time_s": round(time.perf_counter() - start, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    save_checkpoint(out, tensors, checkpoint_config(model, scheme, results, dtype), provenance, source, overwrite)
    return provenance
