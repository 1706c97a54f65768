"""The package's layering, from its own imports (those inside functions included)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module parsed once for all the checks here."""
    return ast.parse(path.read_text())


def _qvl_imports(path: Path, root: Path) -> set[str]:
    """qvl_trt modules a file imports, at any depth of it (imports inside functions too)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts)
    if path.name == "__init__.py":
        package += ".__init__"
    found = set()
    for node in ast.walk(_tree(path)):
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
# The build folder's format (manifest) stands below the steps that write it (vision/, llm/);
# within triton/, the contract, the stock backend's parameter table and the repository's
# layout are the ground the served code and serve stand on; testing/ (fixtures) may use
# anything.
LAYERS = (
    ("qvl_trt", "qvl_trt.errors", "qvl_trt.deps", "qvl_trt.atomic", "qvl_trt.typed_config",
     "qvl_trt.resources", "qvl_trt.hashing", "qvl_trt.dtypes", "qvl_trt.child"),
    ("qvl_trt.checkpoint", "qvl_trt.profiles", "qvl_trt.machine",
     "qvl_trt.generation_config", "qvl_trt.chat_messages", "qvl_trt.manifest"),
    ("qvl_trt.mm",),
    ("qvl_trt.vision", "qvl_trt.llm"),
    ("qvl_trt.plan",),
    ("qvl_trt.triton.options", "qvl_trt.triton.contract", "qvl_trt.triton.tensorrtllm_backend",
     "qvl_trt.triton.layout"),
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


# ---- what `qvl-trt serve` loads, and where the artifacts' file names are defined --------------

# Not loaded before tritonserver starts: the repository writer and its model configs, the
# build, and numba (the preprocessing kernels, which only the served models compile).
_NOT_IN_SERVE = ("numba", "qvl_trt.triton.repository", "qvl_trt.triton.model_configs",
                 "qvl_trt.build")


def test_serve_loads_neither_the_writer_nor_the_build_nor_numba(tmp_path) -> None:
    """The `qvl-trt serve` command through `prepare` (its --dry-run: everything serve reads
    before it starts a process), plus the one import serve() makes after it
    (check_vision_editions)."""
    from cli_harness import modules_loaded_by

    loaded = modules_loaded_by(f"""
import contextlib, io
from qvl_trt.cli import app
with contextlib.redirect_stdout(io.StringIO()):
    try:
        app(["serve", {str(tmp_path)!r}, "--dry-run"])
    except SystemExit as exc:
        assert not exc.code, exc.code
import qvl_trt.serve, qvl_trt.serve.run, qvl_trt.vision.engine
""")
    assert {"qvl_trt.serve.needs", "qvl_trt.triton.layout", "qvl_trt.manifest"} <= loaded
    assert sorted(m for m in loaded for name in _NOT_IN_SERVE
                  if m == name or m.startswith(name + ".")) == []


# Where the file names of the two artifacts are defined: the build folder's, the repository's.
_LAYOUTS = ("qvl_trt/manifest.py", "qvl_trt/triton/layout.py")
# Names both artifacts use for folders of their own: the build's llm/engine/ and a repository
# model's 1/engine/.
_SHARED = {"engine"}
# The Hugging Face checkpoint's own file names (checkpoint.py), which code reads from (or
# writes into) a checkpoint by name as well; the repository copies them as they are.
_CHECKPOINT_FILES = {"config.json", "tokenizer.json", "model.safetensors"}


def _module_strings(tree: ast.Module) -> dict[str, list[str]]:
    """A module's top-level `NAME = "text"` constants: text -> names."""
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            found.setdefault(node.value.value, []).append(getattr(target, "id", "?"))
    return found


def _homes(root: Path) -> dict[str, dict[str, list[str]]]:
    return {path: _module_strings(_tree(root / path)) for path in _LAYOUTS}


def _defined_again(names: set[str], where: str, tree: ast.Module) -> list[str]:
    """Where a module defines one of the layouts' `names` again: a top-level constant of that
    value, or (for a name with a suffix that is not the checkpoint's too) a literal of it."""
    constants = _module_strings(tree)
    literals = {n for n in names - _CHECKPOINT_FILES if "." in n} - constants.keys()
    return [f"{where}: {' '.join(n)} = {text!r}" for text, n in constants.items()
            if text in names] + \
        [f"{where}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
         if isinstance(node, ast.Constant) and isinstance(node.value, str)
         and node.value in literals]


def test_each_file_name_of_the_build_folder_and_the_repository_is_defined_once() -> None:
    root = Path(__file__).resolve().parents[1]
    homes = _homes(root)
    for path, strings in homes.items():
        assert {t: n for t, n in strings.items() if len(n) > 1} == {}, path
    build, repository = homes.values()
    assert set(build) & set(repository) == _SHARED
    assert {"timing.cache", "build_config.json", "config.json", "model.engine"} <= set(build)
    assert {"build.json", "model.py", "1"} <= set(repository)
    names = set(build) | set(repository)
    again = [line for path in sorted((root / "qvl_trt").rglob("*.py"))
             if (where := path.relative_to(root).as_posix()) not in _LAYOUTS
             for line in _defined_again(names, where, _tree(path))]
    assert again == []


def test_the_definition_check_sees_a_name_defined_again() -> None:
    """The check above on a module that defines a file name again, twice."""
    root = Path(__file__).resolve().parents[1]
    names = {text for strings in _homes(root).values() for text in strings}
    where = "qvl_trt/llm/engine.py"
    source = (root / where).read_text()
    assert _defined_again(names, where, ast.parse(source)) == []
    source += '\nTIMING_CACHE_NAME = "timing.cache"\nSAVED = Path("model.engine")\n'
    assert [line.split(": ", 1)[1]
            for line in _defined_again(names, where, ast.parse(source))] == [
        "TIMING_CACHE_NAME = 'timing.cache'", "'model.engine'"]
