"""The layering of the packages, read from the source with ``ast`` (nothing is imported).

From the bottom up: ``kernels_ampere`` (kernels and their integer reference numerics) <-
``bitmtp_edge.format`` (the artifact contract) <- ``bitmtp_edge.runtime`` and
``bitmtp_edge.backends`` (one layer: the engine drives the backends, the backends use the
runtime's model, masks and replay state) <- ``bitmtp_edge.jetson`` and ``bitmtp_edge.app``
<- ``export`` and ``tools``. An import may only point down (or sideways inside a layer),
and no chain of module imports closes a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_ampere", "bitmtp_edge", "export")

# Lower number = lower layer. A module may import modules of its own layer or below.
LAYERS = {
    "kernels_ampere": 0,
    "bitmtp_edge.format": 1,
    "bitmtp_edge.runtime": 2,
    "bitmtp_edge.backends": 2,
    "bitmtp_edge.jetson": 3,
    "bitmtp_edge.app": 4,
    "bitmtp_edge": 4,  # the package's own __init__: lazy public names from every layer
    "export": 5,
    "tools": 6,
}
# jetson and app sit above the runtime; jetson (boards, posture, monitors) needs none of app.
FORBIDDEN = {("bitmtp_edge.jetson", "bitmtp_edge.app"), ("bitmtp_edge.jetson", "bitmtp_edge.runtime"),
             ("bitmtp_edge.jetson", "bitmtp_edge.backends")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """Every first-party module ``name`` imports, wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    # Imports under ``if TYPE_CHECKING:`` never run: they name types for annotations only.
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] in (*PACKAGES, "tools")}


def layer_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return prefix
    raise AssertionError(f"{module}: in no layer of tests/test_layering.py; add its package to LAYERS")


def resolve(module: str, known: dict[str, Path]) -> str | None:
    """The source module an import names (``pkg.mod.func`` -> ``pkg.mod``), if it is ours."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def graph() -> dict[str, set[str]]:
    known = source_modules()
    edges = {}
    for name, path in known.items():
        edges[name] = {t for m in imports_of(name, path) if (t := resolve(m, known)) and t != name}
    return edges


def test_every_import_points_down_a_layer():
    wrong = []
    for name, targets in graph().items():
        here = layer_of(name)
        for target in targets:
            there = layer_of(target)
            if LAYERS[there] > LAYERS[here] or (here, there) in FORBIDDEN:
                wrong.append(f"{name} imports {target} ({here} -> {there})")
    assert not wrong, "imports running back up:\n" + "\n".join(sorted(wrong))


def test_kernels_import_nothing_of_the_runtime_or_export():
    for name, targets in graph().items():
        if name.startswith("kernels_ampere"):
            assert all(t.startswith("kernels_ampere") for t in targets), (name, targets)


def test_the_library_imports_nothing_of_export_or_tools():
    for name, targets in graph().items():
        if name.startswith("bitmtp_edge"):
            assert not [t for t in targets if t.split(".")[0] in ("export", "tools")], (name, targets)


def test_no_import_circles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_the_checker_sees_a_wrong_import(tmp_path):
    """The rule can fail: a kernel module importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from bitmtp_edge.runtime.model import TernaryLM\nfrom .numerics import int_matmul\n")
    found = imports_of("kernels_ampere.bad", bad)
    assert "bitmtp_edge.runtime.model" in found and "kernels_ampere.numerics" in found
    assert LAYERS[layer_of("bitmtp_edge.runtime.model")] > LAYERS[layer_of("kernels_ampere.bad")]
