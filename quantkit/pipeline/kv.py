"""`quantkit kv`: add calibrated KV-cache scales to a float model or an existing
checkpoint, leaving its weights untouched."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantkit.calibration.datasets import Calibration, calibration_samples, load_documents
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import check_output, read_provenance, read_tensors, save_checkpoint
from quantkit.models import kv_cache
from quantkit.models.arch import arch_for
from quantkit.models.loading import load_tokenizer, read_config, resolve_model
from quantkit.progress import Track, no_progress
from quantkit.runtime.loader import load
from quantkit.scheme import QuantArgs, QuantScheme, to_quantization_config
from quantkit.version import __version__


def kv_scale_names(config, layer: int) -> tuple[str, str]:
    spec = arch_for(config)
    base = f"{spec.blocks}.{layer}.{spec.attention}"
    return f"{base}.k_scale", f"{base}.v_scale"


@torch.no_grad()
def add_kv_scales(
    model_name: str,
    args: QuantArgs,
    out: Path,
    calibration: Calibration = Calibration(),
    overwrite: bool = False,
    track: Track = no_progress,
    recipe: dict | None = None,
) -> dict:
    """Calibrate per-layer k_scale / v_scale on `calibration` and write `out`: the source's
    tensors unchanged plus the scales, and `kv_cache_scheme` in its quantization_config
    (`recipe`, the `quantkit run` recipe this call carries out, goes into the provenance)."""
    start = time.perf_counter()
    path = resolve_model(model_name)
    out = Path(out)
    check_output(out, overwrite)
    config = read_config(path)
    qc = config.get("quantization_config")
    if qc and qc.get("kv_cache_scheme") and not overwrite:
        raise QuantkitError(f"{path} already has KV-cache scales; pass --overwrite to replace them.")
    model = load(path)
    kv_cache.enable(model)  # refuses architectures the table does not know
    c = calibration
    samples = calibration_samples(
        load_tokenizer(path), load_documents(c.dataset, "calib"), c.samples, c.seq_len, c.seed
    )
    batches = samples.split(c.batch_size)
    with kv_cache.record_kv_amax(model):
        for batch in track(batches, "kv calibration", len(batches)):
            model(batch, use_cache=False)
    scales = kv_cache.calibrated_scales(model, args)
    tensors = {k: v for k, v in read_tensors(path).items() if not k.endswith((".k_scale", ".v_scale"))}
    for layer, (k_scale, v_scale) in scales.items():
        k_name, v_name = kv_scale_names(model.config, layer)
        tensors[k_name], tensors[v_name] = k_scale, v_scale
    if qc:
        qc = dict(qc, kv_cache_scheme=args.to_dict())
    else:
        qc = to_quantization_config(QuantScheme(f"kv-{args.type}", None, ignore=(), kv_cache=args))
    config["quantization_config"] = qc
    provenance = dict(read_provenance(path) or {})
    provenance["kv_cache"] = {
        "quantkit_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "args": dataclasses.asdict(args),
        "calibration": dataclasses.asdict(c),
        "wall_time_s": round(time.perf_counter() - start, 2),
        "recipe": recipe,
    }
    save_checkpoint(out, tensors, config, provenance, path, overwrite)
    return provenance
