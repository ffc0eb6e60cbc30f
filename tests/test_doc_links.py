"""Every relative link in README.md and docs/*.md names a file that exists and, where it has
a #fragment, a heading of that file (GitHub's anchors: lower case, punctuation dropped,
spaces to hyphens, -1, -2 … for repeats)."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen, out = Counter(), set()
    for line in CODE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            base = slug(m[1])
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def test_slug_follows_githubs_rules():
    assert slug("Formats × methods, NVFP4 (2026-12-04, night)") == "formats--methods-nvfp4-2026-12-04-night"
    assert slug("`quantkit eval`") == "quantkit-eval"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
