"""The reference stays true: the Layout tree of docs/design.md names every Python module of
quantkit/, kernels/, calibration/ and benchmarks/ (`__init__.py` aside), and every module it
names exists. Both sides are read at run time, so a moved module fails here until the tree
moves with it.

How the tree names a module: by its file name on a line under its folder's line (two spaces
of indentation per level; a line indented deeper than the next level continues the line
above it), e.g. `moe.py` under `  models/` under `quantkit/`. Several may share a line
(`awq.py, gptq.py  ...`), or sit in a folder line's description (`serve/  app.py, ...`). A
folder named in a description (`tasks/ (built-in ...)`) names all the modules in it; a folder
that starts a line only opens it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
FOLDERS = ("quantkit", "kernels", "calibration", "benchmarks")
TOKEN = re.compile(r"\w[\w./-]*")  # a word, a file name or a path (not a lone "/")


def layout_tree(markdown: str) -> str:
    """The first fenced block after the `## Layout` heading."""
    section = markdown.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def named(tree: str) -> tuple[set[str], set[str]]:
    """(modules, folders named as a group) of the tree, as paths from the repository root."""
    modules, groups = set(), set()
    stack: list[str] = []  # the folders the current line is in
    context = ""
    for line in tree.splitlines():
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(text)
        tokens = [t.rstrip(".") for t in TOKEN.findall(text)]
        if indent % 2 == 0 and indent // 2 <= len(stack):  # an entry, not a continuation
            del stack[indent // 2 :]
            if tokens[0].endswith("/"):  # a folder's own line: it opens the folder
                stack.append(tokens.pop(0).rstrip("/"))
            context = "/".join(stack)
        for token in tokens:
            path = f"{context}/{token}" if context else token
            if token.endswith(".py"):
                # a path with a folder in it may be written from the repository root
                modules.add(token if "/" in token and (ROOT / token).is_file() else path)
            elif token.endswith("/") and (ROOT / path).is_dir():
                groups.add(path.rstrip("/"))
    return modules, groups


def modules_on_disk() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py"
    }


def test_the_parser_reads_folders_groups_and_continuations():
    tree = """
quantkit/           the library
  cli.py            commands / options
  models/
    arch.py, moe.py  families
  eval/             accuracy: run.py,
                    gates.py, tasks/ (built-in)
kernels/            reference.py; csrc/x.cpp
"""
    modules, groups = named(tree)
    assert modules == {
        "quantkit/cli.py",
        "quantkit/models/arch.py",
        "quantkit/models/moe.py",
        "quantkit/eval/run.py",
        "quantkit/eval/gates.py",
        "kernels/reference.py",
    }
    assert groups == {"quantkit/eval/tasks"}


def test_design_names_every_module():
    modules, groups = named(layout_tree(DOC.read_text()))
    on_disk = modules_on_disk()
    assert len(on_disk) > 50, f"found only {len(on_disk)} modules under {ROOT}"
    missing = sorted(m for m in on_disk - modules if not any(m.startswith(g + "/") for g in groups))
    if missing:
        pytest.fail(
            "docs/design.md's Layout tree does not name these modules; add each file name, with what it "
            "holds, on a line under its folder's line:\n  " + "\n  ".join(missing),
            pytrace=False,
        )


def test_design_names_only_modules_that_exist():
    modules, _ = named(layout_tree(DOC.read_text()))
    gone = sorted(m for m in modules if not (ROOT / m).is_file())
    if gone:
        pytest.fail(
            "docs/design.md's Layout tree names modules that do not exist (moved or removed?); "
            "update the tree:\n  " + "\n  ".join(gone),
            pytrace=False,
        )
