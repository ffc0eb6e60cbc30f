"""Progress reporting without a UI dependency: the library wraps long loops in a
`track(iterable, description, total)` callback; the CLI passes one that draws a rich
progress bar, everything else gets `no_progress`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
Track = Callable[..., Iterable]


def no_progress(iterable: Iterable[T], description: str = "", total: int | None = None) -> Iterable[T]:
    return iterable
