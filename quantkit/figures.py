"""The PNG figures of `--plot` options: a matplotlib figure (imported on first use) and its
save, written beside the target and renamed into place."""

from __future__ import annotations

import os
from pathlib import Path

from quantkit.errors import QuantkitError


def figure(**kwargs):
    """A matplotlib `Figure` with a constrained layout, or a `QuantkitError` without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise QuantkitError("--plot needs matplotlib; install it with `pip install matplotlib`.") from None
    return Figure(layout="constrained", **kwargs)


def save(fig, path: str | os.PathLike) -> Path:
    """Write `fig` to `path` as a PNG (120 dpi); nothing half-written is left at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path
