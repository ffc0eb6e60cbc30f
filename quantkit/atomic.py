"""Writing a file so that its path never holds half of it: the data goes to a hidden sibling,
which is then renamed over the path (an atomic replace on POSIX and Windows)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes, durable: bool = False) -> Path:
    """Write `data` (text as UTF-8, or bytes) to `path`, creating its folder. `durable` also
    fsyncs the data before the rename, for state a resumed run trusts after a crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
