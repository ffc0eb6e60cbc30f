"""The commands that make checkpoints: one per weight method of the registry (`quantkit rtn`,
`awq`, `gptq`, `fp8`, ...), generated from its entry (the method's options become flags,
its summary the help), plus `quantkit kv` and `quantkit run`. Each builds a recipe and runs
it through the same code as `quantkit run`."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer

from quantkit.calibration.method import Calibration, Method, describe
from quantkit.calibration.registry import METHODS, KVOptions, weight_methods
from quantkit.cli.common import (
    CALIB,
    JSON,
    MODEL,
    PRINT_RECIPE,
    QOUTPUT,
    SAMPLES,
    SEED,
    SEQ_LEN,
    command,
    note,
    out,
    progress,
    quiet_lm_eval,
    registry_option,
    rows_table,
    write_json,
)
from quantkit.cli.evaluate import show_gates
from quantkit.errors import QuantkitError
from quantkit.pipeline import options as run_options
from quantkit.scheme import PRESETS

PRESET_WORDS = {  # what --scheme's help says of each preset
    "w4a16": "int4 symmetric",
    "w4a16-asym": "with a zero point",
    "w8a16": "int8 per channel",
    "w8a8": "int8 weights per channel and int8 activations per token, at run time",
    "fp8-dynamic": "per-channel weights, per-token activations at run time",
    "fp8": "per-tensor weights and calibrated static activation scales",
}
GROUP = typer.Option(
    "auto",
    help="Weights per scale: a number that divides every quantized layer's input width, "
    "or auto (128, or the largest power of two below it that divides them all).",
)
ACT_ORDERS = ("static", "group", "none")
ACT_ORDER_HELP = "static (columns by descending Hessian diagonal, groups kept), group (desc_act with g_idx) or none."
CALIBRATION_FLAGS = {"dataset": ("--calib",)}
OVERWRITE = registry_option(run_options.RunOptions, "overwrite")
RESUME = registry_option(run_options.RunOptions, "resume")


def _words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def scheme_option(default: str, *formats: str):
    """--scheme: the presets whose weights take one of `formats`, each said in words."""
    names = [n for n, s in PRESETS.items() if s.format in formats]
    return typer.Option(
        default, help=_words([f"{n} ({PRESET_WORDS[n]})" if n in PRESET_WORDS else n for n in names]) + "."
    )


def mixed_methods() -> str:
    """The weight methods --target-bits (and sensitivity) can mix formats for, in words."""
    return _words([m for m in weight_methods() if run_options.applies("target_bits", METHODS[m])])


def _annotation(meta: dict):
    kind = {"bool": bool, "int": int, "float": float}.get(meta["kind"], str)
    return Optional[kind] if meta["default"] is None else kind


def _flags(options: type, decls: dict | None = None, keep=lambda name: True) -> list[tuple]:
    """(name, type, typer option) of each field of an options dataclass that has a flag."""
    return [
        (name, _annotation(meta), typer.Option(meta["default"], *(decls or {}).get(name, ()), help=meta["help"]))
        for name, meta in describe(options).items()
        if meta["cli"] and keep(name)
    ]


def _transform_help(t: Method) -> str:
    acts = [n for n, s in PRESETS.items() if s.input_activations is not None]
    only = f"; for schemes that quantize activations: {', '.join(acts)}" if t.needs_activations else ""
    if t.flag:
        choices = describe(t.options)[t.flag]["choices"]
        return f"First {t.name}: {t.summary.rstrip('.')}. Its {t.flag}: {_words(list(choices))}."
    return f"First run {t.name}, {t.summary.rstrip('.')} (its default options, on --calib{only})."


def _transform_flag(t: Method) -> tuple:
    """(name, type, typer option) of a transform's flag: a switch, or --NAME VALUE for its `flag` option."""
    if t.flag:
        return (t.name, Optional[str], typer.Option(None, help=_transform_help(t)))
    return (t.name, bool, typer.Option(False, help=_transform_help(t)))


def _transforms(entry: Method, flags: dict) -> list:
    """The transform steps the flags ask for: a name, or {name: {flag option: value}}."""
    return [
        {t.name: {t.flag: flags[t.name]}} if t.flag else t.name
        for t in run_options.transforms_for(entry)
        if flags[t.name]
    ]


def _parameters(entry: Method) -> list[inspect.Parameter]:
    """The flags of `quantkit NAME` for the weight method `entry`."""
    flags = [
        ("model", str, MODEL),
        ("output", Optional[Path], QOUTPUT),
        ("scheme", str, scheme_option(entry.default_scheme, entry.format, *entry.formats)),
    ]
    if run_options.groups(entry):
        flags.append(("group_size", str, GROUP))
    if entry.actorder:
        flags.append(("act_order", str, typer.Option(entry.default_actorder or "none", help=ACT_ORDER_HELP)))
    flags += [_transform_flag(t) for t in run_options.transforms_for(entry)]
    flags += _flags(Calibration, CALIBRATION_FLAGS)
    flags += _flags(entry.options)
    flags += _flags(run_options.RunOptions, keep=lambda name: run_options.applies(name, entry))
    flags += [("print_recipe", bool, PRINT_RECIPE), ("json_path", Optional[Path], JSON)]
    names = [name for name, _, _ in flags]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(
                f"{entry.name}: option {name!r} is also another flag of `quantkit {entry.name}`; rename it."
            )
    kw = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter(name, kw, default=option, annotation=kind) for name, kind, option in flags]


def _recipe(entry: Method, flags: dict) -> dict:
    """The recipe dict the flags of `quantkit NAME` mean."""
    act_order = flags.get("act_order")
    if act_order is not None and act_order not in ACT_ORDERS:
        raise QuantkitError(f"--act-order {act_order!r} is unknown; use {_words(list(ACT_ORDERS))}.")

    def given(options: type) -> dict:
        return {name: flags[name] for name, _, _ in _flags(options) if name in flags}

    return run_options.quantize_recipe(
        flags["model"],
        flags["output"],
        entry.name,
        flags["scheme"],
        group=flags.get("group_size", "auto"),
        actorder=act_order,
        calibration=Calibration(**given(Calibration)),
        transforms=_transforms(entry, flags),
        options=given(entry.options),
        run=run_options.RunOptions(**given(run_options.RunOptions)),
    )


def method_command(entry: Method):
    """`quantkit NAME` for the weight method `entry`: its help is the entry's summary."""

    def quantize(**flags):
        _command_recipe(
            _recipe(entry, flags), flags["overwrite"], flags["print_recipe"], flags["json_path"], flags["resume"]
        )

    quantize.__signature__ = inspect.Signature(_parameters(entry))
    quantize.__name__ = quantize.__qualname__ = entry.name
    quantize.__doc__ = entry.summary
    return command(quantize)


def _command_recipe(
    raw: dict, overwrite: bool, print_recipe: bool, json_path: Path | None = None, resume: bool = False
) -> None:
    from quantkit.pipeline.recipe import from_dict

    recipe = from_dict(raw)
    if print_recipe:
        typer.echo(recipe.to_yaml(), nl=False)
        return
    if recipe.output is None:
        raise QuantkitError("-o/--output is missing; name the folder to write the checkpoint to.")
    _run_recipe(recipe, None, overwrite, json_path, resume)


def _quantize_rows(prov: dict) -> list[tuple[str, object]]:
    w, c, a = prov["weights"], prov["calibration"], prov["input_activations"]
    t = "fp" if w["type"] == "float" else "int"
    if a is not None:
        ta, when = "fp" if a["type"] == "float" else "int", "dynamic" if a["dynamic"] else "static"
        kind = f"{t}{w['num_bits']} {w['strategy']} weights, {ta}{a['num_bits']} {when} {a['strategy']} activations"
    else:
        kind = f"{t}{w['num_bits']}, group {w['group_size']}, {'sym' if w['symmetric'] else 'asym'}" + (
            f", act-order {w['actorder']}" if w["actorder"] else ""
        )
    rows = [("scheme", f"{prov['scheme']} ({kind})"), ("quantized linears", prov["quantized_linears"])]
    if prov.get("transforms"):
        rows.append(("before quantizing", ", ".join(prov["transforms"])))
    if prov["kv_cache"]:
        k = prov["kv_cache"]
        rows.append(
            (
                "kv cache",
                f"{k['type']}{k['num_bits']}, one scale per {'head' if k['strategy'] == 'attn_head' else 'layer'}",
            )
        )
    if c:
        rows.append(("calibration", f"{c['dataset']}: {c['samples']} × {c['seq_len']} tokens, seed {c['seed']}"))
    return rows + [
        ("wall time", f"{prov['wall_time_s']:.1f} s"),
        ("peak memory (RSS)", f"{prov['peak_rss_mib']:.0f} MiB"),
    ]


def _kv_rows(prov: dict) -> list[tuple[str, object]]:
    k, c = prov["kv_cache"], prov["kv_cache"]["calibration"]
    return [
        (
            "kv cache",
            f"{k['args']['type'].replace('float', 'fp')}{k['args']['num_bits']}, one scale per "
            f"{'head' if k['args']['strategy'] == 'attn_head' else 'layer'}",
        ),
        ("calibration", f"{c['dataset']}: {c['samples']} × {c['seq_len']} tokens, seed {c['seed']}"),
        ("wall time", f"{k['wall_time_s']:.1f} s"),
    ]


def _run_recipe(
    recipe, output: Optional[Path], overwrite: bool, json_path: Path | None = None, resume: bool = False
) -> None:
    """Run a recipe, print what was made and the eval gates; a failed gate exits 1 (the
    checkpoint stays written)."""
    from quantkit.pipeline.recipe import run_recipe

    if recipe.eval is not None and recipe.eval["tasks"]:
        quiet_lm_eval()
    with progress() as track:
        prov = run_recipe(
            recipe,
            output,
            overwrite,
            track,
            log=note,
            resume=resume,
        )
    write_json(json_path, prov)
    name = "kv" if [s.name for s in recipe.steps] == ["kv"] else prov["algorithm"]
    out.print(
        rows_table(f"{name} → {output or recipe.output}", _kv_rows(prov) if name == "kv" else _quantize_rows(prov))
    )
    if prov.get("gates") is not None:
        show_gates(prov["gates"])


@command
def run(
    recipe: Path = typer.Argument(..., help="A recipe YAML file (see recipes/)."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Folder to write the checkpoint to (default: the recipe's output)."
    ),
    set_: Optional[list[str]] = typer.Option(
        None,
        "--set",
        help="Change a recipe key, e.g. --set calibration.samples=16 or --set steps.0.awq.grid=10 (repeatable).",
    ),
    overwrite: bool = OVERWRITE,
    resume: bool = RESUME,
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """Make a checkpoint from a recipe: model, scheme, steps, calibration and eval gates in one
    YAML file (a failed gate exits 1; the checkpoint stays written)."""
    from quantkit.pipeline.recipe import load_recipe

    r = load_recipe(recipe, set_ or ())
    if print_recipe:
        typer.echo(r.replace(output=str(output) if output else r.output).to_yaml(), nl=False)
        return
    _run_recipe(r, output, overwrite, json_path, resume)


@command
def kv(
    model: str = typer.Argument(..., help="A float model or a checkpoint (built-in name, folder or hub id)."),
    output: Optional[Path] = QOUTPUT,
    dtype: str = registry_option(KVOptions, "dtype", help="KV-cache type: fp8 or int8."),
    per_head: bool = registry_option(KVOptions, "per_head"),
    calib: str = CALIB,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    overwrite: bool = typer.Option(
        False, help="Replace an existing output folder, or KV scales the model already has."
    ),
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """Add calibrated KV-cache scales (k_scale/v_scale) to a model or checkpoint; weights stay as they are."""
    _command_recipe(
        {
            "model": model,
            "steps": [{"kv": {"dtype": dtype, "per_head": per_head}}],
            "calibration": {"dataset": calib, "samples": samples, "seq_len": seq_len, "seed": seed},
            "output": None if output is None else str(output),
        },
        overwrite,
        print_recipe,
        json_path,
    )
