"""`quantkit inspect`, `quantkit export` and `quantkit sensitivity`: look inside and convert checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from quantkit.calibration.method import Calibration
from quantkit.cli.common import (
    CALIB,
    JSON,
    SEED,
    command,
    console,
    mib,
    new_table,
    out,
    progress,
    registry_option,
    rows_table,
    write_json,
)
from quantkit.cli.quantize import mixed_methods, scheme_option
from quantkit.pipeline.options import RunOptions


@command
def export(
    checkpoint: str = typer.Argument(
        ..., help="An int4 checkpoint (compressed-tensors pack-quantized, AWQ or GPTQ); for gguf: a float model."
    ),
    format: str = typer.Option(..., "--format", help="awq (AutoAWQ GEMM), gptq (GPTQ v1), compressed-tensors or gguf."),
    output: Path = typer.Option(..., "--output", "-o", help="Folder (a .gguf file for gguf) to write."),
    type: str = typer.Option(
        "q4_k_m", "--type", help="gguf: f32, q8_0, q4_0, q4_1, q4_k_m, q5_k_m or q6_k (llama.cpp's file types)."
    ),
    method: str = typer.Option(
        "gptq",
        help="gguf: gptq (GPTQ rounding on the type's grid, block parameters searched under the calibration's "
        "importance), imatrix (the importance-weighted search alone) or rtn (the search, no calibration).",
    ),
    calib: str = CALIB,
    samples: int = typer.Option(64, help="gguf: calibration rows."),
    seq_len: int = typer.Option(512, help="gguf: tokens per calibration row."),
    seed: int = SEED,
    awq: bool = typer.Option(
        True,
        "--awq/--no-awq",
        help="gguf --method gptq: fold AWQ's scales into the float weights first (exact in float; "
        "smollm2 Q4_0 KL in llama.cpp 0.213 -> 0.120).",
    ),
    imatrix_out: Optional[Path] = typer.Option(
        None,
        "--imatrix-out",
        help="gguf: also write the calibration's importance matrix as llama-imatrix does (llama-quantize --imatrix).",
    ),
    overwrite: bool = registry_option(RunOptions, "overwrite"),
):
    """Convert an int4 checkpoint between the compressed-tensors, AWQ and GPTQ layouts, or
    write a float model as a calibrated GGUF file for llama.cpp (--format gguf)."""
    if format == "gguf":
        from quantkit.calibration.gguf import GGUFOptions
        from quantkit.pipeline.gguf import export_gguf

        calibration = Calibration(dataset=calib, samples=samples, seq_len=seq_len, seed=seed)
        options = GGUFOptions(awq=awq)
        with progress() as track:
            chosen = export_gguf(
                checkpoint, output, type, method, calibration, overwrite, track, options, imatrix_out=imatrix_out
            )
        counts: dict[str, int] = {}
        for t in chosen.values():
            counts[t] = counts.get(t, 0) + 1
        mix = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        how = f"{method} after AWQ's scales" if awq and method == "gptq" else method
        out.print(f"wrote {output} (gguf {type}, {how}: {mix} tensors)")
        if imatrix_out is not None:
            out.print(f"wrote {imatrix_out} (importance matrix)")
        return
    from quantkit.formats import interop

    interop.export(Path(checkpoint), output, format, overwrite)
    out.print(f"wrote {output} ({format})")


@command
def sensitivity(
    model: str = typer.Argument(..., help="Built-in name, local folder or hub id of the float model."),
    scheme: str = scheme_option("w4a16", "pack-quantized"),
    method: str = typer.Option(
        "rtn",
        help=f"Quantize each group by {mixed_methods()} (with its defaults): --target-bits measures with its own.",
    ),
    calib: str = CALIB,
    samples: int = typer.Option(8, help="Calibration windows the cost is measured on (and the method calibrates on)."),
    seq_len: int = typer.Option(256, help="Tokens per window."),
    seed: int = SEED,
    exact: bool = typer.Option(
        False,
        "--exact",
        help="Measure each cost by running the model to its logits (the reference, about 15× slower) "
        "instead of the second-order estimate from the group's block alone.",
    ),
    top: int = typer.Option(20, help="Rows shown, most sensitive first (the JSON has them all)."),
    plot: Optional[Path] = typer.Option(None, help="Also plot the costs, group by group (PNG)."),
    json_path: Optional[Path] = JSON,
):
    """The KL divergence from the float model (nats per token) of quantizing each fusion group
    alone (q/k/v, o, gate/up, down) to each format --target-bits chooses among (int4 per
    group of 128, 64, 32; int8 per channel), rounded to nearest or by --method, on a few
    calibration windows, estimated to second order (--exact: measured); most sensitive
    first. Cached, so --target-bits reuses it."""
    from quantkit.pipeline import mixed
    from quantkit.scheme import preset

    calibration = Calibration(dataset=calib, samples=samples, seq_len=seq_len, seed=seed)
    estimator = "exact" if exact else "fisher"
    with progress() as track:
        result = mixed.sensitivity(
            model, preset(scheme), calibration, track, console.print, method=method, estimator=estimator
        )
    write_json(json_path, result)
    if plot:
        mixed.plot(result, plot)
    names = [c for c in mixed.candidates(preset(scheme)) if c != mixed.FLOAT]
    rows = sorted(result["units"], key=lambda r: -max(r["kld"].get(c, 0.0) for c in names))
    table = new_table(
        f"sensitivity of {model} ({scheme}, {method}, {estimator}): KL per token (nats) with one group quantized",
        ("group", "weights", *names),
    )
    for r in rows[:top]:
        table.add_row(r["label"], f"{r['params']:,}", *(f"{r['kld'][c]:.2e}" if c in r["kld"] else "—" for c in names))
    out.print(table)
    if len(rows) > top:
        out.print(f"{len(rows) - top} more groups in the JSON (--json).")


@command
def inspect(
    checkpoint: str = typer.Argument(..., help="A checkpoint folder (or any model)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report to this JSON file."),
):
    """Scheme, quantized and ignored modules, size against the float model, provenance."""
    from quantkit.formats.inspect import describe

    info = describe(checkpoint)
    if json_path:
        write_json(json_path, info)
    rows = [("format", f"{info['quant_method']} / {info['format']}")]
    for name, w in info["weights"].items():
        if w:
            kind = f"{w['type']}{w['num_bits']} {w['strategy']}" + (
                f" {w['group_size']}" if w.get("group_size") else ""
            )
            rows.append(
                (
                    f"weights ({name})",
                    f"{kind}, {'symmetric' if w['symmetric'] else 'asymmetric'}"
                    + (f", actorder {w['actorder']}" if w.get("actorder") else ""),
                )
            )
        a = info["input_activations"].get(name)
        if a:
            kind = f"{a['type']}{a['num_bits']} {a['strategy']}, {'symmetric' if a['symmetric'] else 'asymmetric'}"
            rows.append((f"activations ({name})", f"{kind}, {'dynamic' if a['dynamic'] else 'static'}"))
    q = info["quantized_modules"]
    rows += [
        ("quantized modules", f"{len(q)}" + (f" ({q[0]} … {q[-1]})" if q else "")),
        ("ignored modules", ", ".join(info["ignored_modules"]) or "none"),
        ("on disk", mib(info["disk_bytes"])),
        ("float model", mib(info["float_bytes"])),
        ("compression", f"{info['compression']:.2f}×"),
    ]
    if info["bits_per_weight"]:
        rows.append(("bits per quantized weight", f"{info['bits_per_weight']:.3f}"))
    for key, value in (info["provenance"] or {}).items():
        if key not in ("expert_tokens", "mixed_precision"):  # shown as tables of their own
            rows.append((f"made: {key}", json.dumps(value) if isinstance(value, (dict, list)) else value))
    out.print(rows_table(f"inspect {info['path']}", rows))
    if info["experts"]:
        out.print(_coverage_table(info["experts"]))
    mixed = (info["provenance"] or {}).get("mixed_precision")
    if mixed:
        title = f"mixed precision: {mixed['bits_per_weight']:.3f} bits per weight (target {mixed['target_bits']:g})"
        table = new_table(title, ("layer group", "format"))
        for label, chosen in mixed["choice"].items():
            table.add_row(label, chosen)
        out.print(table)


def _coverage_table(experts: dict) -> Table:
    columns = ("block", "experts", "least / median / most", "calibrated on all tokens", "tokens per expert")
    table = new_table("expert coverage: calibration tokens routed to each expert", columns)
    for block, c in experts.items():
        tokens = sorted(c["tokens"])
        table.add_row(
            block,
            str(len(tokens)),
            f"{tokens[0]} / {tokens[len(tokens) // 2]} / {tokens[-1]}",
            ", ".join(map(str, c["all_tokens"])) or "none",
            " ".join(map(str, c["tokens"])),
        )
    return table
