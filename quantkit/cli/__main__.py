"""`python -m quantkit.cli …`, as the benchmark scripts call it."""

from quantkit.cli import app

app()
