"""The package's layering, from its own imports (those inside functions included)."""

from __future__ import annotations

from pathlib import Path


def _qvl_imports(path: Path, root: Path) -> set[str]:
    """qvl_trt modules a file imports, at any depth of it (imports inside functions too)."""
    import ast

    package = ".".join(path.relative_to(root).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: -node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "qvl_trt"}


def test_the_served_code_imports_neither_the_config_writer_nor_the_fixtures() -> None:
    root = Path(__file__).resolve().parents[1]
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (root / "qvl_trt").rglob("*.py")}
    todo = [p for p in (root / "triton_repo").glob("*/1/model.py")]
    assert len(todo) == 5
    reached: set[str] = set()
    while todo:
        for name in _qvl_imports(todo.pop(), root) - reached:
            if name in modules:
                reached.add(name)
                todo.append(modules[name])
    assert "qvl_trt.triton.runtime.backend" in reached
    forbidden = {"qvl_trt.triton.model_configs", "qvl_trt.triton.repository", "qvl_trt.testing"}
    assert not {m for m in reached if m in forbidden or m.startswith("qvl_trt.testing.")}


# Layers from the bottom up: a module may import its own layer and those below, never above.
# Within triton/, the contract and the stock backend's parameter table are the ground the
# served code stands on; testing/ (fixtures) may use anything.
LAYERS = (
    ("qvl_trt", "qvl_trt.errors", "qvl_trt.deps", "qvl_trt.atomic", "qvl_trt.typed_config",
     "qvl_trt.resources", "qvl_trt.hashing", "qvl_trt.dtypes", "qvl_trt.child"),
    ("qvl_trt.checkpoint", "qvl_trt.profiles", "qvl_trt.machine",
     "qvl_trt.generation_config", "qvl_trt.chat_messages"),
    ("qvl_trt.mm",),
    ("qvl_trt.vision", "qvl_trt.llm"),
    ("qvl_trt.plan", "qvl_trt.manifest"),
    ("qvl_trt.triton.options", "qvl_trt.triton.contract", "qvl_trt.triton.tensorrtllm_backend"),
    ("qvl_trt.triton.runtime",),
    ("qvl_trt.triton",),
    ("qvl_trt.client",),
    ("qvl_trt.gateway",),
    ("qvl_trt.serve",),
    ("qvl_trt.deploy",),
    ("qvl_trt.build",),
    ("qvl_trt.cli",),
    ("qvl_trt.testing",),
)


def _layer(module: str) -> tuple[int, int]:
    """(layer, length of the matching prefix): the most specific prefix wins."""
    best = (-1, -1)
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (level, len(prefix))
    return best


def _import_graph() -> dict[str, set[str]]:
    root = Path(__file__).resolve().parents[1]
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "qvl_trt").rglob("*.py")}
    imports = {module: _qvl_imports(path, root) for module, path in paths.items()}
    # A package whose __init__ imports nothing (a docstring, a version) adds no dependency.
    empty = {m for m, p in paths.items() if p.name == "__init__.py" and not imports[m]}
    graph = {}
    for module in paths:
        targets = set()
        for name in imports[module]:
            while name and name not in paths:  # `from .x import Name` names a module's member
                name = name.rpartition(".")[0]
            if name and name != module and name not in empty:
                targets.add(name)
        graph[module] = targets
    return graph


def _in_cycles(graph: dict[str, set[str]]) -> set[str]:
    """Modules left after repeatedly dropping those that import nothing still left: exactly
    the ones on or behind an import cycle."""
    left = {m: set(t) for m, t in graph.items()}
    while leaves := [m for m, t in left.items() if not t & left.keys()]:
        for m in leaves:
            del left[m]
    return set(left)


def test_no_import_cycle_and_no_upward_import() -> None:
    graph = _import_graph()
    assert all(_layer(m)[0] >= 0 for m in graph), [m for m in graph if _layer(m)[0] < 0]
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if _layer(b)[0] > _layer(a)[0])
    assert upward == []
    assert _in_cycles(graph) == set()


def test_the_layer_check_catches_an_upward_import_and_a_cycle() -> None:
    """The checks above on a made-up graph: they must fail on purpose."""
    assert _layer("qvl_trt.triton.runtime.preprocessing")[0] < _layer("qvl_trt.client.bench")[0]
    assert _layer("qvl_trt.triton.contract")[0] < _layer("qvl_trt.triton.runtime.backend")[0]
    assert _in_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}, "d": set()}) == {"a", "b", "c"}
    assert _in_cycles({"a": {"b"}, "b": set()}) == set()
