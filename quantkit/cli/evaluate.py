"""`quantkit eval`: perplexity and lm-eval tasks, side by side with a baseline, and gates."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from quantkit.cli.common import command, console, new_table, out, progress, quiet_lm_eval, rows_table, write_json
from quantkit.errors import QuantkitError


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


def gate_table(report: dict) -> Table:
    pair = report["baseline"] is not None
    title = f"{report['candidate']} vs {report['baseline']}" if pair else f"scores of {report['candidate']}"
    table = new_table(
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


def _perplexity(models: list[str], text: str, seq_len, limit, batch_size, json_path: Path | None, dtype) -> None:
    """`quantkit eval` without a baseline, tasks or gates: a perplexity table per model."""
    from quantkit.eval.run import evaluate

    results = []
    with progress() as track:
        for model in models:
            results.append(evaluate(model, text, seq_len, limit, batch_size, track, dtype))
    if json_path:
        write_json(json_path, results[0] if len(results) == 1 else results)
    for model, result in zip(models, results):
        out.print(
            rows_table(
                f"perplexity of {model}",
                [
                    ("dataset", result["dataset"]),
                    ("perplexity", f"{result['ppl']:.4f}"),
                    ("windows × seq_len", f"{result['windows']} × {result['seq_len']} = {result['tokens']} tokens"),
                    ("time", f"{result['eval_time_s']:.1f} s"),
                ],
            )
        )


@command
def eval(
    models: list[str] = typer.Argument(
        ...,
        help="Built-in name, local folder, hub id or quantkit checkpoint; several are scored one after the other, "
        "against one --baseline scored once.",
    ),
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
    dtype: str = typer.Option(
        "auto",
        help="auto (each model computes in its own dtype), float32, bfloat16 or float16: every model, the "
        "baseline too, computes in this one, so checkpoints exported in other dtypes compare on one footing.",
    ),
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
    json_path: Optional[Path] = typer.Option(
        None, "--json", help="Also write the result to this JSON file (a list of results for several models)."
    ),
):
    """Perplexity on the papers' protocol (non-overlapping windows, mean token NLL) and
    lm-eval tasks; with --baseline, side by side (plus KL divergence and top-1 agreement on
    the perplexity windows), exiting 1 when a gate fails."""
    text = None if ppl.lower() == "none" else ppl
    task_list = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    gates = {"max_ppl_increase": _fraction(max_ppl_increase), "min_recovery": min_recovery}
    gates |= {"max_kld": max_kld, "min_top1": min_top1}
    from quantkit.runtime.loader import parse_dtype

    compute = parse_dtype(dtype)
    if baseline is None and not task_list and text and all(g is None for g in gates.values()):
        return _perplexity(models, text, seq_len, limit, batch_size, json_path, compute)
    from quantkit.eval.gates import evaluate_many

    if task_list:
        quiet_lm_eval()
    scope = {"ppl": text, "tasks": task_list, "limit": limit, "seq_len": seq_len, "batch_size": batch_size}
    with progress() as track:
        reports = evaluate_many(
            models,
            baseline,
            **scope,
            num_fewshot=num_fewshot,
            include_path=include_path,
            **gates,
            track=track,
            dtype=compute,
        )
    if json_path:
        write_json(json_path, reports[0] if len(reports) == 1 else reports)
    show_gates(*reports)


def show_gates(*reports: dict) -> None:
    """Each report's gate table and a sentence per failed gate; exit code 1 if one failed."""
    for report in reports:
        out.print(gate_table(report))
        which = f"{report['candidate']}: " if len(reports) > 1 else ""
        for failure in report["failures"]:
            console.print(f"[bold red]gate failed:[/] {escape(which + failure)}")
    if any(report["failures"] for report in reports):
        raise typer.Exit(1)
