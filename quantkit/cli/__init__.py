"""The `quantkit` command line: thin commands that parse, call one library function and
render the result with rich. One module per group of commands: `quantize` (a command per
weight method of the registry, generated from its entry; `kv`, `run`), `evaluate`,
`serve` (generate, serve), `bench` (bench, plan), `inspection` (inspect, export,
sensitivity); `common` holds what they share."""

from __future__ import annotations

import typer

from quantkit.calibration.registry import METHODS
from quantkit.cli import bench, evaluate, inspection, quantize, serve
from quantkit.version import __version__


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantkit {__version__}")
        raise typer.Exit()


def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    pass


def build_app() -> typer.Typer:
    """The `quantkit` app, with a command for each weight method registered now."""
    app = typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        help="Quantize Hugging Face causal LMs, measure what it cost, serve the result.",
    )
    app.callback()(_main)
    methods = [quantize.method_command(m) for m in METHODS.values() if m.role == "weights"]
    for fn in (
        *methods,
        quantize.kv,
        quantize.run,
        evaluate.eval,
        serve.generate,
        serve.serve,
        bench.bench,
        bench.plan,
        inspection.export,
        inspection.sensitivity,
        inspection.inspect,
    ):
        app.command(help=fn.help)(fn)
    return app


app = build_app()
