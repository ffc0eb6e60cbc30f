"""What the commands share: the consoles, the error handling of `command`, progress bars,
tables, JSON output and the options several commands take."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import signal
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from quantkit.atomic import write_atomic
from quantkit.calibration.method import Calibration, describe
from quantkit.errors import QuantkitError

console = Console(stderr=True)
out = Console()


def quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


@contextlib.contextmanager
def progress():
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
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


@contextlib.contextmanager
def unwind_on_sigterm():
    """While inside: SIGTERM (`kill`, a job scheduler's stop) raises SystemExit(143) in the main
    thread, so `finally` blocks and context managers run: temporary files (the KL recorder's
    logits, gigabytes) are removed and no output is left half-written, as on Ctrl-C. Python's
    default is to die on the spot. A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def command(fn):
    """A command (registered by `quantkit.cli.build_app`): a `QuantkitError` becomes one red
    sentence and exit code 2; SIGTERM unwinds it as Ctrl-C does (`unwind_on_sigterm`); its
    help is the docstring."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            quiet_transformers()
            with unwind_on_sigterm():
                return fn(*args, **kwargs)
        except QuantkitError as e:
            console.print(f"[bold red]error:[/] {escape(str(e))}")
            raise typer.Exit(2) from None

    wrapper.help = _paragraphs(fn.__doc__)
    return wrapper


def write_json(path: Path | None, data: dict | list) -> None:
    if path is None:
        return
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def new_table(title: str, columns: tuple[str, ...] = (), **kwargs) -> Table:
    """A table whose cells fold instead of losing characters when the terminal is narrow."""
    table = Table(title=title, title_justify="left", **kwargs)
    for name in columns:
        table.add_column(name, overflow="fold", justify="left" if name == columns[0] else "right")
    return table


def rows_table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = new_table(title, show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def registry_option(options: type, name: str, *decls: str, default=None, help: str | None = None):
    """The typer option of a registry option (`calibration.method.option`): its default and help."""
    meta = describe(options)[name]
    return typer.Option(meta["default"] if default is None else default, *decls, help=help or meta["help"])


def note(message: str) -> None:
    console.print(f"[yellow]note:[/] {escape(message)}")


def quiet_lm_eval() -> None:
    import logging

    import datasets

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    datasets.disable_progress_bars()


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else mib(n)


MODEL = typer.Option("smollm2-135m", "--model", "-m", help="Built-in name, local folder or hub id.")
OUTPUT = typer.Option(..., "--output", "-o", help="Folder to write the checkpoint to.")
QOUTPUT = typer.Option(None, "--output", "-o", help="Folder to write the checkpoint to.")
JSON = typer.Option(None, "--json", help="Also write the result to this JSON file.")
PRINT_RECIPE = typer.Option(False, help="Print the equivalent recipe (YAML for `quantkit run`) and exit.")
CALIB = registry_option(Calibration, "dataset", "--calib")
SAMPLES = registry_option(Calibration, "samples", "--samples")
SEQ_LEN = registry_option(Calibration, "seq_len", "--seq-len")
SEED = registry_option(Calibration, "seed", "--seed")
DTYPE = typer.Option(
    "auto",
    help="auto (the checkpoint's; float32 and float16 run in bfloat16 where the CPU computes it natively), "
    "float32, bfloat16 or float16.",
)
