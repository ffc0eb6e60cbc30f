"""The layering the docs promise: no import cycle anywhere (imports inside functions
count), the numerical core at the bottom, kernels importing only the core, eval and the
pipeline below perf, the calibration registry and the CLI free of torch at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "quantkit": ROOT / "quantkit",
    "quantkit.kernels": ROOT / "kernels",
    "quantkit.calibration": ROOT / "calibration",
}
CORE = {"quantkit.errors", "quantkit.scheme", "quantkit.primitives", "quantkit.packing"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the quantkit modules it imports, anywhere in its body."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("quantkit"):
                    target = resolve(name)
                    if target and target != module:
                        graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_kernels_import_only_the_numerical_core():
    graph = import_graph()
    kernels = [m for m in graph if m.startswith("quantkit.kernels")]
    assert kernels
    for module in kernels:
        above = {t for t in graph[module] if t not in CORE and not t.startswith("quantkit.kernels")}
        assert not above, f"{module} imports {above}"


def test_the_core_imports_only_the_core():
    graph = import_graph()
    for module in CORE:
        assert graph[module] <= CORE, f"{module} imports {graph[module] - CORE}"


def test_eval_is_accuracy_only():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("quantkit.eval")):
        wrong = {t for t in graph[module] if t.startswith(("quantkit.perf", "quantkit.serve", "quantkit.cli"))}
        assert not wrong, f"{module} imports {wrong}"


def test_the_pipeline_does_not_plan():
    # checkpoint bytes come from the formats, not from capacity planning (perf sits above the pipeline)
    graph = import_graph()
    for module in (m for m in graph if m.startswith("quantkit.pipeline")):
        wrong = {t for t in graph[module] if t.startswith("quantkit.perf")}
        assert not wrong, f"{module} imports {wrong}"


def test_cli_and_registry_start_without_torch():
    code = "import sys, quantkit.cli, quantkit.calibration.registry; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
