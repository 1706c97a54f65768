"""The CLI as users meet it: help without heavy packages, one-line errors, exit codes."""

from __future__ import annotations

import ast
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_harness import HEAVY, modules_loaded_by, run_cli

from qvl_trt.cli import app
from qvl_trt.deps import require
from qvl_trt.errors import DependencyError


def _command_names() -> list[str]:
    return sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def test_every_help_works_without_heavy_packages():
    names = _command_names()
    # independent interpreters: one per core at a time
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        top, *subs = pool.map(lambda args: run_cli(*args, "--help", block=HEAVY),
                              [(), *((name,) for name in names)])
    assert top.returncode == 0, top.stderr
    for name, sub in zip(names, subs, strict=True):
        assert name in top.stdout
        assert sub.returncode == 0, f"{name} --help failed: {sub.stderr}"
        assert "Usage: qvl-trt " + name in " ".join(sub.stdout.split())


# A command parses its options, calls the library function that does the work and renders
# what it returns (console.py); more than this many lines in its body means work has crept in.
MAX_COMMAND_BODY = 20


def _command_bodies() -> dict[str, int]:
    """`module.py:function` -> lines of its body after the docstring (lazy imports included),
    for every function in qvl_trt/cli decorated by `command(...)`, `app.command(...)` or
    `app.callback()`."""
    bodies = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "qvl_trt" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call)
                    and getattr(d.func, "id", getattr(d.func, "attr", "")) in ("command", "callback")
                    for d in node.decorator_list):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                bodies[f"{path.name}:{node.name}"] = body[-1].end_lineno - body[0].lineno + 1
    return bodies


def test_no_command_body_is_longer_than_twenty_lines():
    bodies = _command_bodies()
    # the walk sees every registered command and the app's callback
    assert {name.split(":")[1] for name in bodies} == \
        {c.callback.__name__ for c in app.registered_commands} | {app.registered_callback.callback.__name__}
    long = {name: n for name, n in sorted(bodies.items()) if n > MAX_COMMAND_BODY}
    assert long == {}, (f"command bodies over {MAX_COMMAND_BODY} lines: {long}; move the work "
                        "into the library module the command drives, the rendering into "
                        "console.py")


def _array_code(modules: set[str]) -> set[str]:
    """What the light commands must not pay for: numpy, protobuf, Pillow, numba, torch and
    the request code (mm/), which the command functions import when they run."""
    heavy = ("numpy", "google", "PIL", "numba", "torch")
    return {m for m in modules if m.split(".")[0] in heavy or m.startswith("qvl_trt.mm")}


def test_importing_the_cli_loads_no_array_code():
    assert _array_code(modules_loaded_by("import qvl_trt.cli")) == set()
    # the check sees such an import: the model config writer needs numpy and mm/
    assert {"numpy", "qvl_trt.mm.rope"} <= _array_code(
        modules_loaded_by("import qvl_trt.cli, qvl_trt.triton.model_configs"))


def test_user_error_is_one_line_without_traceback(tmp_path):
    result = run_cli("inspect", "--model", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: checkpoint directory") and "Traceback" not in result.stderr


def test_light_commands_run_without_heavy_packages(tiny_ckpt):
    from qvl_trt import __version__

    # Each command with a line its output must hold.
    for args, line in (
        (["gpus"], "GPU profiles"),
        (["doctor"], f"qvl-trt {__version__} on Python "),
        (["inspect", "-m", str(tiny_ckpt)],
         f"{tiny_ckpt}: Qwen3-VL custom, float32, 145 tensors, "),
        (["plan", "-m", str(tiny_ckpt), "-g", "4090d"],
         "plan: custom checkpoint, fp16 weights, chat workload, on 4090d (NVIDIA GeForce RTX 4090 D, 24564 MiB)"),
    ):
        result = run_cli(*args, block=HEAVY)
        assert result.returncode == 0, f"{args}: {result.stderr}"
        assert any(out.startswith(line) for out in result.stdout.splitlines()), \
            f"{args}: no line starting {line!r} in\n{result.stdout}"


def test_require_names_the_extra():
    with pytest.raises(DependencyError, match=r"pip install 'qvl-trt\[rtx\]'") as err:
        require("no_such_module_qvl", extra="rtx", why="build the vision engine")
    assert "build the vision engine" in str(err.value) and "\n" not in str(err.value)


def test_require_of_a_container_package_names_the_container_not_pip():
    with pytest.raises(DependencyError, match="TensorRT-LLM container") as err:
        require("no_such_module_qvl", extra="trtllm", why="build the LLM engine")
    assert "pip install" not in str(err.value) and "qvl-trt image" in str(err.value)


def test_version():
    from qvl_trt import __version__

    result = run_cli("--version", block=HEAVY)
    assert result.returncode == 0 and result.stdout.strip() == f"qvl-trt {__version__}"
