"""The `quantkit` command line: thin commands that parse, call one library function
and render the result with rich."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect as inspect_module
import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from quantkit.atomic import write_atomic
from quantkit.calibration.method import Calibration, describe
from quantkit.calibration.registry import KV_DTYPES, METHODS, AWQOptions, GPTQOptions, KVOptions, SmoothOptions
from quantkit.errors import QuantkitError
from quantkit.version import __version__


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantkit {__version__}")
        raise typer.Exit()


app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Quantize Hugging Face causal LMs, measure what it cost, serve the result.",
)
console = Console(stderr=True)
out = Console()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    pass


def _quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


@contextlib.contextmanager
def _progress():
    with Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:

        def track(iterable, description="", total=None):
            task = bar.add_task(description, total=total)
            for item in iterable:
                yield item
                bar.advance(task)

        yield track


def _paragraphs(doc: str | None) -> str | None:
    """A docstring as help text: each paragraph on one line (the terminal wraps it)."""
    if not doc:
        return doc
    return "\n\n".join(" ".join(p.split()) for p in inspect_module.cleandoc(doc).split("\n\n"))


def command(fn):
    """Run a command; a `QuantkitError` becomes one red sentence and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _quiet_transformers()
            return fn(*args, **kwargs)
        except QuantkitError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            raise typer.Exit(2) from None

    return app.command(help=_paragraphs(fn.__doc__))(wrapper)


def _write_json(path: Path | None, data: dict | list) -> None:
    if path is None:
        return
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def _new_table(title: str, columns: tuple[str, ...] = (), **kwargs) -> Table:
    """A table whose cells fold instead of losing characters when the terminal is narrow."""
    table = Table(title=title, title_justify="left", **kwargs)
    for name in columns:
        table.add_column(name, overflow="fold", justify="left" if name == columns[0] else "right")
    return table


def _table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = _new_table(title, show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def _opt(options: type, name: str, *decls: str, default=None, help: str | None = None):
    """The typer option of a registry option (`calibration.method.option`): its default and help."""
    meta = describe(options)[name]
    return typer.Option(meta["default"] if default is None else default, *decls, help=help or meta["help"])


MODEL = typer.Option("smollm2-135m", "--model", "-m", help="Built-in name, local folder or hub id.")
OUTPUT = typer.Option(..., "--output", "-o", help="Folder to write the checkpoint to.")
OVERWRITE = typer.Option(False, help="Replace an existing output folder.")
DEVICE = typer.Option("cpu", help="Where each block is quantized (cpu, cuda).")
JSON = typer.Option(None, "--json", help="Also write the result to this JSON file.")
QOUTPUT = typer.Option(None, "--output", "-o", help="Folder to write the checkpoint to.")
PRINT_RECIPE = typer.Option(False, help="Print the equivalent recipe (YAML for `quantkit run`) and exit.")
RESUME = typer.Option(
    False, help="Continue an interrupted run from its last finished block (same arguments), byte-identical."
)
MAX_SHARD_SIZE = typer.Option("5GB", help="Largest safetensors shard of the checkpoint, e.g. 5GB or 500MB.")
TARGET_BITS = typer.Option(
    None,
    help="Mixed precision: give each layer group int4 (group 128/64/32), int8 or float, chosen by its measured "
    "sensitivity, averaging at most this many bits per weight (as inspect counts them).",
)
TARGET_FORMATS = typer.Option(
    None,
    help="With --target-bits: the formats to choose from, comma-separated: int4-g128, int4-g64, int4-g32 "
    "(int4: all three), int8, float. E.g. int4,float for vLLM's CPU build, which has no int8 weight kernel.",
)


def _int4_scheme():
    return typer.Option("w4a16", help="w4a16 (int4 symmetric) or w4a16-asym (with a zero point).")


def _int_scheme():
    return typer.Option(
        "w4a16",
        help="w4a16 (int4 symmetric), w4a16-asym (with a zero point), w8a16 (int8 per channel) or w8a8 "
        "(int8 weights per channel and int8 activations per token, at run time).",
    )


SMOOTH = typer.Option(
    False,
    help="Migrate activation outliers into the weights first (SmoothQuant, α searched per mapping on --calib; "
    "for schemes that quantize activations: w8a8, fp8-dynamic, fp8).",
)


def _group():
    return typer.Option(
        "auto",
        help="Weights per scale: a number that divides every quantized layer's input width, "
        "or auto (128, or the largest power of two below it that divides them all).",
    )


def _calibration_options():
    return (
        _opt(Calibration, "dataset", "--calib"),
        _opt(Calibration, "samples", "--samples"),
        _opt(Calibration, "seq_len", "--seq-len"),
        _opt(Calibration, "seed", "--seed"),
        _opt(Calibration, "min_expert_tokens", "--min-expert-tokens"),
    )


def _kv_options():
    return (
        typer.Option(None, "--kv-cache", help="Also calibrate KV-cache scales: fp8 or int8."),
        _opt(KVOptions, "per_head", "--kv-per-head"),
    )


CALIB, SAMPLES, SEQ_LEN, SEED, MIN_EXPERT_TOKENS = _calibration_options()
KV, KV_PER_HEAD = _kv_options()


def _group_size(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) <= 0:
        raise QuantkitError(f"--group-size {value!r} is neither a positive number nor auto; use e.g. 64 or auto.")
    return int(value)


def _weights_recipe(
    method,
    model,
    output,
    scheme,
    group_size,
    calib,
    samples,
    seq_len,
    seed,
    options,
    kv_cache,
    kv_per_head,
    device,
    weights=None,
    before=(),
    max_shard_size="5GB",
    min_expert_tokens=Calibration.min_expert_tokens,
    target_bits=None,
    target_formats=None,
) -> dict:
    """The recipe dict a quantizing command means, so each command and `quantkit run` share one path."""
    if kv_cache is not None and kv_cache not in KV_DTYPES:
        raise QuantkitError(f"KV-cache type {kv_cache!r} is unknown; use {' or '.join(KV_DTYPES)}.")
    kv = [{"kv": {"dtype": kv_cache, "per_head": kv_per_head}}] if kv_cache else []
    group = _group_size(group_size) if group_size else "auto"
    return {
        "model": model,
        "scheme": {"preset": scheme} | ({"group_size": group} if group != "auto" else {}) | (weights or {}),
        "steps": [*before, {method: options}, *kv],
        "calibration": {"dataset": calib, "samples": samples, "seq_len": seq_len, "seed": seed}
        | ({"min_expert_tokens": min_expert_tokens} if min_expert_tokens != Calibration.min_expert_tokens else {}),
        "output": None if output is None else str(output),
        "device": device,
        "max_shard_size": max_shard_size,
    } | (
        ({"target_bits": target_bits} if target_bits is not None else {})
        | ({"target_formats": target_formats.split(",")} if target_formats is not None else {})
    )


def _smooth_steps(smooth: bool) -> list[dict]:
    """The `smooth` step (SmoothQuant, its default options) to run before the weight method, if asked."""
    return [{"smooth": dataclasses.asdict(SmoothOptions())}] if smooth else []


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
    if a is not None:
        t, when = "fp" if w["type"] == "float" else "int", "dynamic" if a["dynamic"] else "static"
        kind = f"{t}8 {w['strategy']} weights, {t}8 {when} {a['strategy']} activations"
    else:
        kind = f"int{w['num_bits']}, group {w['group_size']}, {'sym' if w['symmetric'] else 'asym'}" + (
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
        _quiet_lm_eval()
    with _progress() as track:
        prov = run_recipe(
            recipe,
            output,
            overwrite,
            track,
            log=_note,
            resume=resume,
        )
    _write_json(json_path, prov)
    name = "kv" if [s.name for s in recipe.steps] == ["kv"] else prov["algorithm"]
    out.print(_table(f"{name} → {output or recipe.output}", _kv_rows(prov) if name == "kv" else _quantize_rows(prov)))
    gates = prov.get("gates")
    if gates is not None:
        out.print(_gate_table(gates))
        for failure in gates["failures"]:
            console.print(f"[bold red]gate failed:[/] {escape(failure)}")
        if gates["failures"]:
            raise typer.Exit(1)


@command
def rtn(
    model: str = MODEL,
    output: Optional[Path] = QOUTPUT,
    scheme: str = _int_scheme(),
    group_size: str = _group(),
    smooth: bool = SMOOTH,
    kv_cache: Optional[str] = KV,
    kv_per_head: bool = KV_PER_HEAD,
    calib: str = CALIB,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    overwrite: bool = OVERWRITE,
    resume: bool = RESUME,
    max_shard_size: str = MAX_SHARD_SIZE,
    target_bits: Optional[float] = TARGET_BITS,
    target_formats: Optional[str] = TARGET_FORMATS,
    device: str = DEVICE,
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """Round-to-nearest INT4 (or INT8, W8A8) weights: the baseline for AWQ and GPTQ (calibration text is used
    only for --smooth and --kv-cache)."""
    _command_recipe(
        _weights_recipe(
            "rtn",
            model,
            output,
            scheme,
            group_size,
            calib,
            samples,
            seq_len,
            seed,
            {},
            kv_cache,
            kv_per_head,
            device,
            before=_smooth_steps(smooth),
            max_shard_size=max_shard_size,
            min_expert_tokens=min_expert_tokens,
            target_bits=target_bits,
            target_formats=target_formats,
        ),
        overwrite,
        print_recipe,
        json_path,
        resume,
    )


def _awq_option(name: str, *decls: str):
    return _opt(AWQOptions, name, *decls)


@command
def awq(
    model: str = MODEL,
    output: Optional[Path] = QOUTPUT,
    scheme: str = _int4_scheme(),
    group_size: str = _group(),
    calib: str = CALIB,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    grid: int = _awq_option("grid"),
    duo: bool = _awq_option("duo"),
    clip: bool = _awq_option("clip"),
    gptq: bool = _awq_option("gptq"),
    guided: int = _awq_option("guided"),
    module_loss: bool = _awq_option("module_loss"),
    save_search: Optional[Path] = _awq_option("save_search"),
    load_search: Optional[Path] = _awq_option("load_search"),
    kv_cache: Optional[str] = KV,
    kv_per_head: bool = KV_PER_HEAD,
    overwrite: bool = OVERWRITE,
    resume: bool = RESUME,
    max_shard_size: str = MAX_SHARD_SIZE,
    target_bits: Optional[float] = TARGET_BITS,
    target_formats: Optional[str] = TARGET_FORMATS,
    device: str = DEVICE,
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """AWQ INT4 (Lin et al.): activation-aware scales folded into the previous op, then per-group clipping."""
    options = {
        "grid": grid,
        "duo": duo,
        "clip": clip,
        "gptq": gptq,
        "guided": guided,
        "module_loss": module_loss,
        "save_search": str(save_search) if save_search else None,
        "load_search": str(load_search) if load_search else None,
    }
    _command_recipe(
        _weights_recipe(
            "awq",
            model,
            output,
            scheme,
            group_size,
            calib,
            samples,
            seq_len,
            seed,
            options,
            kv_cache,
            kv_per_head,
            device,
            max_shard_size=max_shard_size,
            min_expert_tokens=min_expert_tokens,
            target_bits=target_bits,
            target_formats=target_formats,
        ),
        overwrite,
        print_recipe,
        json_path,
        resume,
    )


@command
def fp8(
    model: str = MODEL,
    output: Optional[Path] = QOUTPUT,
    scheme: str = typer.Option(
        "fp8-dynamic",
        help="fp8-dynamic (per-channel weights, per-token activations at run "
        "time) or fp8 (per-tensor weights and calibrated static activation scales).",
    ),
    calib: str = CALIB,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    smooth: bool = SMOOTH,
    kv_cache: Optional[str] = KV,
    kv_per_head: bool = KV_PER_HEAD,
    overwrite: bool = OVERWRITE,
    resume: bool = RESUME,
    max_shard_size: str = MAX_SHARD_SIZE,
    device: str = DEVICE,
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """FP8 e4m3 weights and activations (static scales and --smooth are calibrated on --calib)."""
    _command_recipe(
        _weights_recipe(
            "fp8",
            model,
            output,
            scheme,
            None,
            calib,
            samples,
            seq_len,
            seed,
            {},
            kv_cache,
            kv_per_head,
            device,
            before=_smooth_steps(smooth),
            max_shard_size=max_shard_size,
            min_expert_tokens=min_expert_tokens,
        ),
        overwrite,
        print_recipe,
        json_path,
        resume,
    )


def _gptq_option(name: str):
    return _opt(GPTQOptions, name)


@command
def gptq(
    model: str = MODEL,
    output: Optional[Path] = QOUTPUT,
    scheme: str = _int_scheme(),
    group_size: str = _group(),
    smooth: bool = SMOOTH,
    calib: str = CALIB,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    seed: int = SEED,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    act_order: str = typer.Option(
        METHODS["gptq"].default_actorder,
        help="static (columns by descending Hessian diagonal, groups kept), group (desc_act with g_idx) or none.",
    ),
    damp: float = _gptq_option("damp"),
    block_size: int = _gptq_option("block_size"),
    range_search: bool = _gptq_option("range_search"),
    refine: int = _gptq_option("refine"),
    guided: int = _gptq_option("guided"),
    kv_cache: Optional[str] = KV,
    kv_per_head: bool = KV_PER_HEAD,
    overwrite: bool = OVERWRITE,
    resume: bool = RESUME,
    max_shard_size: str = MAX_SHARD_SIZE,
    target_bits: Optional[float] = TARGET_BITS,
    target_formats: Optional[str] = TARGET_FORMATS,
    device: str = DEVICE,
    print_recipe: bool = PRINT_RECIPE,
    json_path: Optional[Path] = JSON,
):
    """GPTQ INT4 or INT8 (Frantar et al.): Hessian-based error feedback, true-sequential, act-order."""
    if act_order not in ("static", "group", "none"):
        raise QuantkitError(f"--act-order {act_order!r} is unknown; use static, group or none.")
    _command_recipe(
        _weights_recipe(
            "gptq",
            model,
            output,
            scheme,
            group_size,
            calib,
            samples,
            seq_len,
            seed,
            {"damp": damp, "block_size": block_size, "range_search": range_search, "refine": refine, "guided": guided},
            kv_cache,
            kv_per_head,
            device,
            {"actorder": act_order} if act_order != "none" else None,
            before=_smooth_steps(smooth),
            max_shard_size=max_shard_size,
            min_expert_tokens=min_expert_tokens,
            target_bits=target_bits,
            target_formats=target_formats,
        ),
        overwrite,
        print_recipe,
        json_path,
        resume,
    )


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


def _fraction(value: str | None) -> float | None:
    """ "2%" or "0.02" -> 0.02."""
    if value is None:
        return None
    text = value.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise QuantkitError(
            f"--max-ppl-increase {value!r} is neither a percentage nor a fraction; write 2% or 0.02."
        ) from None


def _number(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:{'+' if signed else ''}.4f}" if abs(value) < 1e6 else f"{value:{'+' if signed else ''}.4g}"


def _gate_table(report: dict) -> Table:
    pair = report["baseline"] is not None
    title = f"{report['candidate']} vs {report['baseline']}" if pair else f"scores of {report['candidate']}"
    table = _new_table(
        title, ("metric", "baseline", "candidate", "delta", "recovery", "gate") if pair else ("metric", "value")
    )
    for row in report["rows"]:
        if not pair:
            table.add_row(row["metric"], _number(row["candidate"]))
            continue
        gate = {True: "[green]pass[/]", False: "[bold red]FAIL[/]", None: ""}[row["passed"]]
        nats = row["metric"] in ("kld", "kld_p99")  # small: significant digits, not decimals
        table.add_row(
            row["metric"],
            _number(row["baseline"]),
            f"{row['candidate']:.4g}" if nats else _number(row["candidate"]),
            _number(row["delta"], signed=True),
            _number(row["recovery"]),
            gate,
        )
    c = report["results"]["candidate"]
    scope = [f"{c['ppl']['dataset']}: {c['ppl']['windows']} × {c['ppl']['seq_len']} tokens"] if c["ppl"] else []
    scope += [f"{task}: {n} docs" for task, n in c["docs"].items()]
    if c.get("kld"):
        k = c["kld"]
        shown = (
            "" if not c["ppl"] or k.get("windows") == c["ppl"]["windows"] else f", first {k['windows']} windows (disk)"
        )
        scope += [f"kld: nats per token{shown}"]
    table.caption = " · ".join(scope)
    return table


def _quiet_lm_eval() -> None:
    import logging

    import datasets

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    datasets.disable_progress_bars()


@command
def eval(
    model: str = typer.Argument(..., help="Built-in name, local folder, hub id or quantkit checkpoint."),
    ppl: str = typer.Option(
        "wiki", help="Perplexity text: wiki, news, wikitext2, c4, pileval, a .txt/.jsonl/.parquet file, or none."
    ),
    tasks: Optional[str] = typer.Option(
        None,
        help="lm-eval tasks, comma-separated: wiki_cloze, wiki_wordppl (built in, "
        "offline), lm-eval's own (need the hub) or yours under --include-path.",
    ),
    include_path: Optional[Path] = typer.Option(None, help="A folder of your own lm-eval task YAMLs."),
    num_fewshot: Optional[int] = typer.Option(None, help="Few-shot examples per prompt (default: each task's own)."),
    seq_len: Optional[int] = typer.Option(
        None, help="Window length (default 2048, or the model's context if shorter)."
    ),
    limit: Optional[int] = typer.Option(None, help="Score only the first N windows, and N documents per task."),
    batch_size: int = typer.Option(1, help="Windows (or task requests) per forward pass."),
    baseline: Optional[str] = typer.Option(
        None,
        help="The model to compare against, scored first on the same data; its fp16 log-probs wait in "
        "$TMPDIR (2 bytes × vocabulary per position).",
    ),
    max_ppl_increase: Optional[str] = typer.Option(
        None, help="Gate: fail when a perplexity rises more than this over the baseline (2% or 0.02)."
    ),
    min_recovery: Optional[float] = typer.Option(
        None, help="Gate: fail when a metric keeps less than this fraction of the baseline's (e.g. 0.98)."
    ),
    max_kld: Optional[float] = typer.Option(
        None, help="Gate: fail when the mean KL(baseline ‖ candidate) per token exceeds this, in nats (e.g. 0.05)."
    ),
    min_top1: Optional[float] = typer.Option(
        None, help="Gate: fail when fewer positions than this fraction keep the baseline's top token (e.g. 0.9)."
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the result to this JSON file."),
):
    """Perplexity on the papers' protocol (non-overlapping windows, mean token NLL) and
    lm-eval tasks; with --baseline, side by side (plus KL divergence and top-1 agreement on
    the perplexity windows), exiting 1 when a gate fails."""
    text = None if ppl.lower() == "none" else ppl
    task_list = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    max_increase = _fraction(max_ppl_increase)
    gates = (max_increase, min_recovery, max_kld, min_top1)
    if baseline is None and not task_list and text and all(g is None for g in gates):
        from quantkit.eval.run import evaluate

        with _progress() as track:
            result = evaluate(model, text, seq_len, limit, batch_size, track)
        if json_path:
            _write_json(json_path, result)
        out.print(
            _table(
                f"perplexity of {model}",
                [
                    ("dataset", result["dataset"]),
                    ("perplexity", f"{result['ppl']:.4f}"),
                    ("windows × seq_len", f"{result['windows']} × {result['seq_len']} = {result['tokens']} tokens"),
                    ("time", f"{result['eval_time_s']:.1f} s"),
                ],
            )
        )
        return
    from quantkit.eval.gates import evaluate_gates

    if task_list:
        _quiet_lm_eval()
    with _progress() as track:
        report = evaluate_gates(
            model,
            baseline,
            ppl=text,
            tasks=task_list,
            limit=limit,
            seq_len=seq_len,
            num_fewshot=num_fewshot,
            include_path=include_path,
            max_ppl_increase=max_increase,
            min_recovery=min_recovery,
            max_kld=max_kld,
            min_top1=min_top1,
            track=track,
            batch_size=batch_size,
        )
    if json_path:
        _write_json(json_path, report)
    out.print(_gate_table(report))
    for failure in report["failures"]:
        console.print(f"[bold red]gate failed:[/] {failure}")
    if report["failures"]:
        raise typer.Exit(1)


@command
def kv(
    model: str = typer.Argument(..., help="A float model or a checkpoint (built-in name, folder or hub id)."),
    output: Optional[Path] = QOUTPUT,
    dtype: str = _opt(KVOptions, "dtype", help="KV-cache type: fp8 or int8."),
    per_head: bool = _opt(KVOptions, "per_head"),
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


DTYPE = typer.Option(
    "auto",
    help="auto (the checkpoint's; float32 and float16 run in bfloat16 where the CPU computes it natively), "
    "float32, bfloat16 or float16.",
)


def _note(message: str) -> None:
    console.print(f"[yellow]note:[/] {escape(message)}")


def _engine(model: str, dtype: str, **kwargs):
    """The engine on `model`, its notes (dtype, kernels) printed once."""
    from quantkit.runtime.engine import LLM

    llm = LLM(model, dtype=dtype, **kwargs)
    for note in llm.notes:
        _note(note)
    return llm


@command
def generate(
    model: str = typer.Argument(..., help="Built-in name, local folder, hub id or quantkit checkpoint."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    max_tokens: int = typer.Option(128, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the tokenizer's chat template."),
    dtype: str = DTYPE,
    json_path: Optional[Path] = JSON,
):
    """Stream a completion to the terminal through the engine, then print TTFT, TPOT and tokens/s."""
    from quantkit.runtime.sequence import SamplingParams

    llm = _engine(model, dtype, max_num_seqs=1)
    if chat:
        if not getattr(llm.tokenizer, "chat_template", None):
            raise QuantkitError(f"{model} has no chat template; drop --chat.")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    request = llm.add_request(prompt, params)
    shown = ""
    output = None
    while llm.has_unfinished():
        for o in llm.step():
            if o.request_id == request:
                output = o
                text = llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # wait for the rest of a multibyte character
                    out.print(text[len(shown) :], end="", markup=False, highlight=False, soft_wrap=True)
                    shown = text
    out.print()
    n = len(output.token_ids)
    total = output.finish_time - output.arrival_time
    _write_json(
        json_path,
        {
            "prompt": prompt,
            "text": shown,
            "prompt_tokens": len(output.prompt_token_ids),
            "generated_tokens": n,
            "finish_reason": output.finish_reason,
            "ttft_ms": 1000 * output.ttft,
            "tpot_ms": 1000 * output.tpot if output.tpot else None,
            "tokens_per_s": n / total,
        },
    )
    out.print(
        _table(
            "generation",
            [
                ("tokens", f"{len(output.prompt_token_ids)} prompt, {n} generated ({output.finish_reason})"),
                ("TTFT", f"{1000 * output.ttft:.1f} ms"),
                ("TPOT", f"{1000 * output.tpot:.1f} ms" if output.tpot else "–"),
                ("throughput", f"{n / total:.1f} tokens/s"),
            ],
        )
    )


def _report_rows(r: dict) -> list[tuple[str, object]]:
    def pct(d):
        return (
            " / ".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p95", "p99")) if d and d.get("p50") is not None else "–"
        )

    rows = [
        ("requests", f"{r['num_requests']} ({r['input_tokens']} prompt + {r['output_tokens']} output tokens)"),
        ("duration", f"{r['duration_s']:.1f} s"),
        ("requests/s", f"{r['requests_per_s']:.3f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
        ("TTFT p50/p90/p95/p99 (ms)", pct(r["ttft_ms"])),
        ("TPOT p50/p90/p95/p99 (ms)", pct(r["tpot_ms"])),
        ("latency p50/p90/p95/p99 (ms)", pct(r["e2e_ms"])),
        ("KV usage peak / preemptions", f"{100 * (r.get('kv_usage_peak') or 0):.1f}% / {r.get('preemptions', 0)}"),
    ]
    if r.get("goodput_requests_per_s") is not None:
        rows.append(("goodput (requests/s in SLO)", f"{r['goodput_requests_per_s']:.3f}"))
    if r.get("cost_per_1m_output_tokens") is not None:
        rows.append(("cost per 1M output tokens", f"${r['cost_per_1m_output_tokens']:.2f}"))
    return rows


@command
def serve(
    model: str = typer.Argument(..., help="Built-in name, local folder, hub id or quantkit checkpoint."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(
        None, help="Require `Authorization: Bearer KEY` on /v1 (or QUANTKIT_API_KEY)."
    ),
    max_num_seqs: int = typer.Option(64, help="Sequences per engine step at most."),
    max_queue: int = typer.Option(256, help="Requests that may wait beyond those running; more get 429."),
    kv_cache_memory: float = typer.Option(1 << 30, help="KV-cache bytes (or a fraction of free memory)."),
    served_model_name: Optional[str] = typer.Option(None, help="The model name clients use (default: MODEL)."),
    dtype: str = DTYPE,
):
    """An OpenAI-compatible HTTP server (completions, chat, streaming, /metrics) on quantkit's engine."""
    from quantkit.serve.server import serve as run_server

    run_server(
        model,
        host,
        port,
        api_key,
        max_num_seqs,
        max_queue,
        kv_cache_memory,
        served_model_name,
        dtype,
        log=_note,
    )


@command
def bench(
    model: str = typer.Argument(
        ...,
        help="Built-in name, local folder, hub id or quantkit checkpoint; or kernels, for the kernel micro-benchmark.",
    ),
    workload: Optional[Path] = typer.Option(None, help="jsonl of {prompt or prompt_token_ids, max_tokens}."),
    num_requests: int = typer.Option(64, help="Synthetic requests (without --workload)."),
    input_len: str = typer.Option("32:512", help="Prompt tokens, A:B uniform."),
    output_len: str = typer.Option("16:256", help="Output tokens, A:B uniform (EOS ignored)."),
    seed: int = typer.Option(0, help="Seed of the workload and the arrivals."),
    mode: str = typer.Option("offline", help="offline (all at once) or online (arrivals at --rate)."),
    rate: float = typer.Option(float("inf"), help="Online: Poisson arrival rate, requests/s (inf: all at once)."),
    concurrency: Optional[int] = typer.Option(None, help="Online: a closed loop of C clients instead."),
    url: Optional[str] = typer.Option(None, help="Benchmark a running OpenAI-compatible server instead."),
    slo_ttft: Optional[float] = typer.Option(None, "--slo-ttft", help="TTFT objective (ms) for goodput."),
    slo_tpot: Optional[float] = typer.Option(None, "--slo-tpot", help="TPOT objective (ms) for goodput."),
    gpu_cost_per_hour: Optional[float] = typer.Option(None, help="Machine price, for cost per 1M tokens."),
    compare: Optional[str] = typer.Option(
        None, help="hf: also run transformers (one at a time, static batches of 16)."
    ),
    dtype: str = DTYPE,
    max_num_seqs: int = typer.Option(64, help="Engine: sequences per step at most."),
    kv_cache_memory: float = typer.Option(1 << 30, help="Engine: KV-cache bytes (or a fraction of free memory)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    plot: Optional[Path] = typer.Option(None, help="Online: sweep rates and plot latency against throughput (PNG)."),
    device: str = typer.Option(
        "cpu",
        help="Kernels: cpu (GEMM paths against the copy bandwidth) or cuda (each "
        "Triton kernel checked against its twin, then timed).",
    ),
    quick: bool = typer.Option(False, help="Kernels: fewer shapes and repetitions."),
    threads: Optional[int] = typer.Option(None, help="Kernels: torch CPU threads (1 gives steadier numbers)."),
):
    """Throughput, TTFT, TPOT, latency percentiles, goodput and cost of serving a model;
    `quantkit bench kernels` times the kernels instead."""

    if model == "kernels":
        return _bench_kernels(device, quick, threads, json_path)

    from quantkit.models.loading import load_tokenizer, resolve_model
    from quantkit.perf import bench as b

    if compare not in (None, "hf"):
        raise QuantkitError(f"--compare {compare!r} is unknown; use hf.")
    slo = {"slo_ttft_ms": slo_ttft, "slo_tpot_ms": slo_tpot, "cost_per_hour": gpu_cost_per_hour}
    tokenizer = load_tokenizer(resolve_model(model))
    requests = (
        b.load_workload(workload)
        if workload
        else b.synthetic_workload(tokenizer, num_requests, input_len, output_len, seed)
    )
    with _progress() as track:
        if url:
            report = b.run_http(url, requests, rate, concurrency, model, track, seed, **slo)
        else:
            llm = _engine(model, dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs)
            if plot:
                rates = [r for r in (0.5, 1, 2, 4, 8) if r < rate] + ([rate] if rate != float("inf") else [])
                reports = b.sweep(llm, requests, rates, track, seed, **slo)
                b.plot_sweep(reports, plot)
            report = b.run(llm, requests, mode, rate, concurrency, track, seed, **slo)
            if compare == "hf":
                report["compare"] = b.compare_hf(model, requests, report, llm.runner.dtype, track=track)
    if json_path:
        _write_json(json_path, report)
    out.print(_table(f"bench {model} ({report['mode']})", _report_rows(report)))
    if report.get("compare"):
        c = report["compare"]
        out.print(
            _table(
                "against transformers (output tokens/s)",
                [
                    (
                        "hf, one request at a time",
                        f"{c['hf_sequential']['output_tokens_per_s']:.1f} (ours ×{c['ratio_vs_hf_sequential']:.2f})",
                    ),
                    (
                        "hf, static batches of 16",
                        f"{c['hf_static']['output_tokens_per_s']:.1f} (ours ×{c['ratio_vs_hf_static']:.2f})",
                    ),
                ],
            )
        )


def _bench_kernels(device: str, quick: bool, threads: int | None, json_path: Path | None) -> None:
    import torch

    from quantkit.perf import kernels

    if device not in ("cpu", "cuda"):
        raise QuantkitError(f"--device {device!r} is unknown; use cpu or cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise QuantkitError("--device cuda needs a CUDA GPU and none is visible here; use --device cpu.")
    if threads:
        torch.set_num_threads(threads)
    rows = kernels.run_cpu(quick=quick) if device == "cpu" else kernels.run_gpu(quick=quick)
    _write_json(json_path, {"header": kernels.header(device), "rows": rows})
    typer.echo(f"\n{kernels.header(device)}\n\n{kernels.to_markdown(rows)}")


def _plan_calibration(model, method, samples, seq_len, device, gpu, gflops, json_path) -> None:
    from quantkit.perf.plan import FP32_TFLOPS, calibration_plan, measure_gflops, model_config

    if gflops is None:
        if device == "cpu":
            gflops = measure_gflops("cpu")
        elif gpu in FP32_TFLOPS:
            gflops = FP32_TFLOPS[gpu] * 1000
        else:
            raise QuantkitError(f"no fp32 rate known for --gpu {gpu}; pass --gflops.")
    r = calibration_plan(model_config(model), method, samples, seq_len, device, gflops)
    _write_json(json_path, r)
    b = r["breakdown"]
    rows = [
        ("float weights", _size(r["float_weights_bytes"])),
        ("peak host memory", _size(r["host_peak_bytes"])),
        ("  libraries", _size(b["libraries"])),
        ("  one block in fp32", _size(b["block_weights"])),
        ("  activations (block inputs, outputs)", _size(b["activations"])),
        (f"  {method} working set", _size(b["working_set"])),
        ("  one batch through the block", _size(b["forward"])),
        ("  embeddings (while capturing)", _size(b["embeddings"])),
    ]
    if device != "cpu":
        rows.append(("peak device memory", _size(r["device_peak_bytes"])))
    rows += [
        ("checkpoint on disk (w4a16 g128)", _size(r["output_bytes"])),
        ("wall time", f"{r['seconds'] / 60:.0f} min at {gflops:.0f} fp32 GFLOP/s"),
    ]
    out.print(_table(f"plan: {method} on {model}, {samples} × {seq_len} tokens, {device}", rows))


@command
def plan(
    model: str = typer.Argument(..., help="Built-in name, local folder or hub id (only config.json is read)."),
    scheme: list[str] = typer.Option(["bf16", "w4a16", "fp8-dynamic"], help="Schemes to compare (repeatable)."),
    kv_cache: Optional[str] = typer.Option(None, help="KV-cache type: bf16, fp8 or int8."),
    gpu: str = typer.Option("h100-80gb", help="h100-80gb, a100-80gb, h200, l40s, l4, rtx4090 or cpu."),
    context: int = typer.Option(4096, help="Tokens per sequence."),
    gpu_cost_per_hour: Optional[float] = typer.Option(None, help="Overrides the table's illustrative price."),
    calibrate: Optional[str] = typer.Option(
        None, help="Instead: peak memory and wall time of calibrating the model with awq or gptq."
    ),
    samples: int = typer.Option(128, help="With --calibrate: calibration rows."),
    seq_len: int = typer.Option(512, help="With --calibrate: tokens per row."),
    device: str = typer.Option("cpu", help="With --calibrate: where blocks are calibrated (cpu, or cuda on --gpu)."),
    gflops: Optional[float] = typer.Option(
        None, help="With --calibrate: the device's fp32 matmul GFLOP/s (default: measured here, or --gpu's)."
    ),
    json_path: Optional[Path] = JSON,
):
    """Memory, concurrent sequences, decode-time bounds and cost per scheme, from the config alone
    (with --calibrate: what calibrating it will take)."""
    from quantkit.perf.plan import model_config
    from quantkit.perf.plan import plan as make_plan

    if calibrate is not None:
        _plan_calibration(model, calibrate, samples, seq_len, device, gpu, gflops, json_path)
        return
    rows = make_plan(model_config(model), list(scheme), kv_cache, gpu, context, gpu_cost_per_hour)
    _write_json(json_path, rows)
    table = _new_table(
        f"plan {model} on {gpu}, {context}-token sequences, KV {kv_cache or 'bf16'}",
        (
            "scheme",
            "weights",
            "KV/token",
            "seqs that fit",
            "TPOT bound b=1",
            "TPOT bound full",
            "tokens/s full",
            "$ / 1K tokens",
        ),
    )
    for r in rows:
        table.add_row(
            r["scheme"],
            _mib(r["weight_bytes"]),
            f"{r['kv_bytes_per_token'] / 1024:.1f} KiB",
            str(r["max_seqs"]),
            f"{r['tpot_ms_batch1']:.2f} ms",
            f"{r['tpot_ms_full']:.2f} ms" if r["tpot_ms_full"] is not None else "–",
            f"{r['tokens_per_s_full']:.0f}" if r["tokens_per_s_full"] is not None else "–",
            f"{r['usd_per_1k_output_tokens']:.5f}" if r["usd_per_1k_output_tokens"] is not None else "–",
        )
    out.print(table)


@command
def export(
    checkpoint: Path = typer.Argument(..., help="An int4 checkpoint: compressed-tensors pack-quantized, AWQ or GPTQ."),
    format: str = typer.Option(..., "--format", help="awq (AutoAWQ GEMM), gptq (GPTQ v1) or compressed-tensors."),
    output: Path = OUTPUT,
    overwrite: bool = OVERWRITE,
):
    """Convert an int4 checkpoint between the compressed-tensors, AWQ and GPTQ layouts."""
    from quantkit.formats import interop

    interop.export(checkpoint, output, format, overwrite)
    out.print(f"wrote {output} ({format})")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else _mib(n)


@command
def sensitivity(
    model: str = typer.Argument(..., help="Built-in name, local folder or hub id of the float model."),
    scheme: str = _int4_scheme(),
    method: str = typer.Option(
        "rtn", help="Quantize each group by rtn, awq or gptq (with its defaults): --target-bits measures with its own."
    ),
    calib: str = CALIB,
    samples: int = typer.Option(8, help="Calibration windows the cost is measured on (and the method calibrates on)."),
    seq_len: int = typer.Option(256, help="Tokens per window."),
    seed: int = SEED,
    top: int = typer.Option(20, help="Rows shown, most sensitive first (the JSON has them all)."),
    plot: Optional[Path] = typer.Option(None, help="Also plot the costs, group by group (PNG)."),
    json_path: Optional[Path] = JSON,
):
    """The KL divergence from the float model (nats per token) of quantizing each fusion group
    alone (q/k/v, o, gate/up, down) to each format --target-bits chooses among (int4 per
    group of 128, 64, 32; int8 per channel), rounded to nearest or by --method, on a few
    calibration windows; most sensitive first. Cached, so --target-bits reuses it."""
    from quantkit.pipeline import mixed
    from quantkit.scheme import preset

    calibration = Calibration(dataset=calib, samples=samples, seq_len=seq_len, seed=seed)
    with _progress() as track:
        result = mixed.sensitivity(
            model, preset(scheme), calibration, track, log=lambda m: console.print(m), method=method
        )
    _write_json(json_path, result)
    if plot:
        mixed.plot(result, plot)
    names = [c for c in mixed.candidates(preset(scheme)) if c != mixed.FLOAT]
    rows = sorted(result["units"], key=lambda r: -max(r["kld"].get(c, 0.0) for c in names))
    table = _new_table(
        f"sensitivity of {model} ({scheme}, {method}): KL per token (nats) with one group quantized",
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
        _write_json(json_path, info)
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
        ("on disk", _mib(info["disk_bytes"])),
        ("float model", _mib(info["float_bytes"])),
        ("compression", f"{info['compression']:.2f}×"),
    ]
    if info["bits_per_weight"]:
        rows.append(("bits per quantized weight", f"{info['bits_per_weight']:.3f}"))
    for key, value in (info["provenance"] or {}).items():
        if key not in ("expert_tokens", "mixed_precision"):  # shown as tables of their own
            rows.append((f"made: {key}", json.dumps(value) if isinstance(value, (dict, list)) else value))
    out.print(_table(f"inspect {info['path']}", rows))
    if info["experts"]:
        out.print(_coverage_table(info["experts"]))
    mixed = (info["provenance"] or {}).get("mixed_precision")
    if mixed:
        title = f"mixed precision: {mixed['bits_per_weight']:.3f} bits per weight (target {mixed['target_bits']:g})"
        table = _new_table(title, ("layer group", "format"))
        for label, chosen in mixed["choice"].items():
            table.add_row(label, chosen)
        out.print(table)


def _coverage_table(experts: dict) -> Table:
    columns = ("block", "experts", "least / median / most", "calibrated on all tokens", "tokens per expert")
    table = _new_table("expert coverage: calibration tokens routed to each expert", columns)
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

