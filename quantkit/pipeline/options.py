"""The options of a quantizing run that belong to neither the method nor the calibration
(`RunOptions`, declared once: each field is a flag of every quantizing command, a keyword of
`quantkit.quantize` and, unless `NOT_IN_RECIPE` says otherwise, a recipe key), and the one
recipe builder that the commands and `quantkit.quantize` share. No torch here: the CLI
reads this at start-up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantkit.calibration.method import Calibration, Method, option
from quantkit.calibration.registry import KV_DTYPES, METHODS, method
from quantkit.errors import QuantkitError
from quantkit.scheme import preset

TARGET_BITS_HELP = (
    "Mixed precision: give each layer group int4 (group 128/64/32; with --scheme nvfp4a16 or mxfp4a16 that "
    "FP4 format), int8 or float, chosen by its measured sensitivity, averaging at most this many bits per "
    "weight (as inspect counts them)."
)
TARGET_FORMATS_HELP = (
    "With --target-bits: the formats to choose from, comma-separated: int4-g128, int4-g64, int4-g32 "
    "(int4: all three), nvfp4, mxfp4, int8, float. E.g. int4,float for vLLM's CPU build, which has no int8 "
    "weight kernel."
)

TARGET_ESTIMATE_HELP = (
    "With --target-bits: how each layer group's sensitivity is found: fisher (the default; a second-order "
    "estimate from one backward pass, ~1 min on smollm2) or exact (its KL measured through the rest of the "
    "model, ~20x longer)."
)

TUNE_SCALES_HELP = (
    "After calibration, train the int weight scales end to end for this many passes over the calibration rows, "
    "on the KL divergence to the float model (codes and zero points fixed; weight-only int schemes). Holds the float "
    "and the quantized model in float32: about 3x the model's fp32 size in memory."
)

LM_HEAD_HELP = (
    "Also quantize the output projection (lm_head), round to nearest: int8 (per channel) or int4 (groups of "
    "128, or less to divide the hidden size), untied from the input embeddings; batch-1 decode of a small model "
    "reads less. Off by default, as in llm-compressor."
)


@dataclass(frozen=True)
class RunOptions:
    """How a quantizing run is carried out: where, into what files, whether it may replace
    or resume an output folder, mixed precision, KV-cache scales."""

    device: str = option("cpu", "Where each block is quantized (cpu, cuda).")
    max_shard_size: str = option("5GB", "Largest safetensors shard of the checkpoint, e.g. 5GB or 500MB.")
    target_bits: float | None = option(None, TARGET_BITS_HELP, kind="float", min=0)
    target_formats: str | None = option(None, TARGET_FORMATS_HELP, kind="text")
    target_estimate: str | None = option(None, TARGET_ESTIMATE_HELP, kind="text")
    lm_head: str | None = option(None, LM_HEAD_HELP, kind="text")
    tune_scales: int | None = option(None, TUNE_SCALES_HELP, kind="int", min=1)
    kv_cache: str | None = option(None, f"Also calibrate KV-cache scales: {' or '.join(KV_DTYPES)}.", kind="text")
    kv_per_head: bool = option(False, "One scale per KV head instead of per layer.")
    overwrite: bool = option(False, "Replace an existing output folder.")
    resume: bool = option(
        False, "Continue an interrupted run from its last finished block (same arguments), byte-identical."
    )


NOT_IN_RECIPE = ("kv_cache", "kv_per_head", "overwrite", "resume")  # a kv step; how this run treats its folder


def applies(name: str, entry: Method) -> bool:
    """Whether the run option `name` is offered with the weight method `entry` (mixed
    precision chooses among int and FP4 formats, and scale tuning trains packed int scales, so only
    for the methods that pack them)."""
    return not name.startswith(("target_", "tune_")) or entry.format == "pack-quantized"


def recipe_keys(options: type | None = None) -> tuple[str, ...]:
    """The run options that are recipe keys, in order (of `RunOptions` as it is when called)."""
    return tuple(f.name for f in dataclasses.fields(options or RunOptions) if f.name not in NOT_IN_RECIPE)


def group_size(value: int | str) -> int | str:
    """A group size as given: a positive number or "auto"."""
    if value == "auto" or isinstance(value, int):
        return value
    if not value.isdigit() or int(value) <= 0:
        raise QuantkitError(f"--group-size {value!r} is neither a positive number nor auto; use e.g. 64 or auto.")
    return int(value)


def transforms_for(entry: Method) -> list[Method]:
    """The transforms (smooth) that may run before the weight method `entry`."""
    return [m for m in METHODS.values() if m.role == "transform" and entry.name in m.before]


def groups(entry: Method) -> bool:
    """Whether the method's default scheme has weight groups (so a group size to choose)."""
    return entry.default_scheme is not None and preset(entry.default_scheme).weights.strategy == "group"


def quantize_recipe(
    model: str,
    output: str | None,
    name: str,
    scheme: str | None = None,
    *,
    group: int | str = "auto",
    actorder: str | None = None,
    calibration: Calibration | None = None,
    transforms: tuple[str | dict, ...] | list[str | dict] = (),
    options: dict | None = None,
    run: RunOptions | None = None,
) -> dict:
    """The recipe dict (for `recipe.from_dict`) of quantizing `model` with the weight method
    `name`: its `options`, after `transforms`, with the run options `run`; `scheme` defaults
    to the method's, `actorder` ("none" for none) to the method's; a transform is its name
    (default options) or {name: options}."""
    entry, run = method(name), run or RunOptions()
    if run.kv_cache is not None and run.kv_cache not in KV_DTYPES:
        raise QuantkitError(f"KV-cache type {run.kv_cache!r} is unknown; use {' or '.join(KV_DTYPES)}.")
    group = group_size(group)
    actorder = actorder or entry.default_actorder
    weights = ({"group_size": group} if group != "auto" else {}) | (
        {"actorder": actorder} if actorder not in (None, "none") else {}
    )
    kv = [{"kv": {"dtype": run.kv_cache, "per_head": run.kv_per_head}}] if run.kv_cache else []
    values = {key: getattr(run, key) for key in recipe_keys(type(run))}
    return {
        "model": str(model),
        "scheme": {"preset": scheme or entry.default_scheme} | weights,
        "steps": [*({t: {}} if isinstance(t, str) else t for t in transforms), {entry.name: dict(options or {})}, *kv],
        "calibration": dataclasses.asdict(calibration or Calibration()),
        "output": None if output is None else str(output),
    } | {key: value for key, value in values.items() if value is not None}
