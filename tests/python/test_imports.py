"""The package's import graph: no cycles (lazy imports inside functions count too), and the
layers point one way: bundle <- models <- checkpoint <- builtin <- runtime <- export <- checks,
training <- tools <- cli."""

import ast
from pathlib import Path

import museflash

PACKAGE_ROOT = Path(museflash.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, known: set[str]) -> set[str]:
    """Every museflash module `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` imports a.b, and a.b.c when c is a module.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    return {name: internal_imports(path, known) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "museflash.export.pipeline" in graph and "museflash.checks.verify" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    package = tmp_path / "museflash"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from museflash.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from museflash import c\n")
    (package / "c.py").write_text("import museflash.a\n")
    (package / "d.py").write_text("import museflash.a\n")
    assert cycles(import_graph(package)) == [["museflash.a", "museflash.c", "museflash.sub.b"]]


# layer -> the layers it may import from (besides itself)
LAYERS = {
    "bundle": set(),
    "models": set(),
    "checkpoint": {"bundle", "models"},
    "builtin": {"bundle", "checkpoint", "models"},
    "export": {"bundle", "checkpoint", "builtin", "models", "runtime"},
    "runtime": {"bundle", "checkpoint", "builtin", "models"},
    "checks": {"bundle", "checkpoint", "builtin", "models", "export", "runtime"},
    "training": {"bundle", "checkpoint", "builtin", "models", "runtime"},
    "tools": {"bundle", "checkpoint", "builtin", "models", "export", "runtime", "checks",
              "training"},
    "cli": {"bundle", "checkpoint", "builtin", "models", "export", "runtime", "checks",
            "training", "tools"},
}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


# Leaves anything may import: they import nothing from museflash but other leaves.
LEAVES = {"bundle", "compression", "compression_kernels", "paths"}


def test_layers_import_only_downwards():
    graph = import_graph()
    leaves = {f"museflash.{leaf}" for leaf in LEAVES}
    assert all(graph[leaf] <= leaves for leaf in leaves)
    assert not graph["museflash.compression_kernels"]
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if layer(module) in LAYERS and layer(target) not in (None, layer(module))
        and layer(target) not in LAYERS[layer(module)] | LEAVES
    )
    assert wrong == []
