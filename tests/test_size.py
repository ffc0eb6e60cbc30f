"""Small units (STYLE.md, principle 11): no Python file over 600 lines and no function over 80
lines (from `def` to its last line, docstring included; `@triton.jit` kernels are exempt) in
the library, the kernels, calibration, the benchmarks and the tests."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("quantkit", "kernels", "calibration", "benchmarks", "tests")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator  # @triton.jit(...) too
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    """'path:line name (N lines > limit)' for the file and each of its functions over the limits."""
    text = path.read_text()
    name = path.relative_to(root).as_posix()
    found = []
    if (lines := len(text.splitlines())) > MAX_FILE_LINES:
        found.append(f"{name}:1 the file ({lines} lines > {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_triton_kernel(node):
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name} ({length} lines > {MAX_FUNCTION_LINES})")
    return found


def test_the_checker_sees_long_functions_and_files(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "long.py").write_text(
        f"def long():\n{body}\n\n\n@triton.jit\ndef kernel():\n{body}\n\n\ndef short():\n    pass\n"
    )
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert oversized(tmp_path / "long.py", tmp_path) == ["long.py:1 long (81 lines > 80)"]
    assert oversized(tmp_path / "big.py", tmp_path) == ["big.py:1 the file (601 lines > 600)"]


def test_no_file_or_function_is_too_long():
    sources = _sources()
    assert len(sources) > 100, f"found only {len(sources)} Python files under {ROOT}"
    offenders = [line for path in sources for line in oversized(path)]
    if offenders:
        pytest.fail(
            f"{len(offenders)} over the size limits (files ≤ {MAX_FILE_LINES} lines, functions ≤ "
            f"{MAX_FUNCTION_LINES}); split them into named pieces:\n  " + "\n  ".join(offenders),
            pytrace=False,
        )
