"""The Python API behind `from quantkit import quantize, evaluate`: the same recipes the
CLI builds, for code (the engine, `LLM` and `SamplingParams`, and `load` live in
`quantkit.runtime`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from quantkit.calibration.method import Calibration
from quantkit.pipeline.options import RunOptions
from quantkit.progress import Track, no_progress


def quantize(
    model: str | Path,
    output: str | Path,
    method: str = "awq",
    scheme: str | None = None,
    *,
    group_size: int | str = "auto",
    actorder: str | None = None,
    calibration: Calibration | None = None,
    kv_cache: str | None = RunOptions.kv_cache,
    kv_per_head: bool = RunOptions.kv_per_head,
    smooth: bool = False,
    rotate: str | None = None,
    overwrite: bool = RunOptions.overwrite,
    resume: bool = RunOptions.resume,
    max_shard_size: int | str = RunOptions.max_shard_size,
    target_bits: float | None = RunOptions.target_bits,
    target_formats: list[str] | None = RunOptions.target_formats,
    target_estimate: str | None = RunOptions.target_estimate,
    lm_head: str | None = RunOptions.lm_head,
    tune_scales: int | None = RunOptions.tune_scales,
    device: str = RunOptions.device,
    track: Track = no_progress,
    log: Callable[[str], None] | None = None,
    **options,
) -> dict:
    """Quantize `model` (built-in name, folder or hub id) with `method` (a weight method of
    `quantkit.calibration.registry`: rtn, awq, gptq or fp8) into the checkpoint folder
    `output`, and return its provenance (what `quantkit.json` records). `scheme` defaults to
    the method's (w4a16, or fp8-dynamic for fp8); `group_size` "auto" takes 128 or the largest
    power of two below it that divides every quantized layer's input width; `actorder` (GPTQ:
    "static", "group" or "none") defaults to the method's ("static" for gptq); `options` are the
    method's own (e.g. grid=10 for awq, damp=0.05 for gptq; see `quantkit.calibration.registry`);
    `smooth` runs SmoothQuant first (fp8, w8a8); `rotate` ("hadamard" or "random-hadamard")
    fuses rotations into the weights first (`quantkit.calibration.rotate`). The run options are `RunOptions`'
    (`quantkit.pipeline.options`): `kv_cache` ("fp8"/"int8") also calibrates KV-cache scales;
    the model streams block by block from its files; `resume` continues a run that was
    interrupted (same arguments) from its last finished block; the checkpoint is written in
    safetensors shards of at most `max_shard_size` (e.g. "5GB", "500MB"). `target_bits` (rtn,
    awq, gptq) gives each layer group its own format (int4 per group of 128/64/32, int8 per
    channel, float) from its measured sensitivity, averaging at most that many bits per weight;
    `target_formats` (e.g. ["int4", "float"]) limits the formats it chooses from; `target_estimate`
    ("fisher", the default, or "exact") is how the sensitivities are found; `lm_head` ("int8") quantizes
    the output projection too (per channel, round to nearest), untied from the input embeddings;
    `tune_scales` (rtn, awq, gptq, autoround; weight-only int schemes) trains the int scales end to end
    on the KL divergence to the float model for that many passes over the calibration rows.

        quantkit.quantize("smollm2-135m", "out/awq", "awq", "w4a16-asym", group_size=64)
    """
    from quantkit.pipeline import options as run_options
    from quantkit.pipeline.recipe import from_dict, run_recipe

    given = locals()
    fields = [f.name for f in dataclasses.fields(run_options.RunOptions)]
    run = run_options.RunOptions(
        **{k: given[k] for k in fields if k in given}, **{k: options.pop(k) for k in fields if k in options}
    )
    raw = run_options.quantize_recipe(
        model,
        output,
        method,
        scheme,
        group=group_size,
        actorder=actorder,
        calibration=calibration,
        transforms=([{"rotate": {"kind": rotate}}] if rotate else []) + (["smooth"] if smooth else []),
        options=options,
        run=run,
    )
    return run_recipe(from_dict(raw), overwrite=run.overwrite, track=track, log=log, resume=run.resume)


def evaluate(
    model: str | Path,
    baseline: str | Path | None = None,
    *,
    ppl: str | None = "wiki",
    tasks: list[str] | tuple[str, ...] = (),
    limit: int | None = None,
    seq_len: int | None = None,
    max_ppl_increase: float | None = None,
    min_recovery: float | None = None,
    max_kld: float | None = None,
    min_top1: float | None = None,
    batch_size: int = 1,
    track: Track = no_progress,
) -> dict:
    """Score `model` (and `baseline`, on the same data) on perplexity of the text `ppl`
    (the papers' protocol: non-overlapping windows of `seq_len` tokens, the first `limit`)
    and on lm-eval `tasks`, and apply the gates. With a baseline and `ppl`, also `kld`
    (mean KL(baseline ‖ model) per position, nats), `kld_p99` and `top1_agreement` on the
    same windows, gated by `max_kld` and `min_top1` (a fraction). Returns the report that
    `quantkit eval --json` writes: `rows` (metric, baseline, candidate, delta, recovery,
    passed), `failures` (one sentence per failed gate), `passed`, and the raw results.

        report = quantkit.evaluate("out/awq", "smollm2-135m", limit=8, max_ppl_increase=0.2, max_kld=0.1)
    """
    from quantkit.eval.gates import evaluate_gates

    return evaluate_gates(
        str(model),
        None if baseline is None else str(baseline),
        ppl=ppl,
        tasks=list(tasks),
        limit=limit,
        seq_len=seq_len,
        max_ppl_increase=max_ppl_increase,
        min_recovery=min_recovery,
        max_kld=max_kld,
        min_top1=min_top1,
        track=track,
        batch_size=batch_size,
    )
