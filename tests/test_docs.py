"""The Python blocks of docs/methods.md run as shown: in order, in one namespace, as a reader
would paste them; a block followed by "prints" and a plain block prints exactly that."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from pathlib import Path

from quantkit.calibration.registry import METHODS

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```\n(?:\s*prints[^\n]*\n+```\n(.*?)```)?", re.S)


def blocks(page: str) -> list[tuple[str, str | None]]:
    """(code, the output shown after it or None) of each ```python block of a page."""
    return [(m[1], m[2]) for m in BLOCK.finditer((DOCS / page).read_text())]


def test_the_python_blocks_of_methods_md_run_as_shown(monkeypatch):
    found = blocks("methods.md")
    assert len(found) >= 4 and any(shown for _, shown in found)
    module = types.ModuleType("docs_methods")  # a module, so dataclasses can resolve the annotations
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    registered = dict(METHODS)
    try:
        for code, shown in found:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, "docs/methods.md", "exec"), namespace)
            if shown is not None:
                assert printed.getvalue() == shown, code
    finally:
        METHODS.clear()
        METHODS.update(registered)
