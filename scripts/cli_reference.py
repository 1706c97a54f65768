"""Write the CLI reference (docs/cli.md) from the Typer app in qvl_trt.cli: every command by
help panel, its help text and its arguments and options with their defaults.

    python scripts/cli_reference.py > docs/cli.md     # regenerate
    python scripts/cli_reference.py --check            # exit 1 when docs/cli.md is stale
"""

from __future__ import annotations

import argparse
import enum
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
REGENERATE = "python scripts/cli_reference.py > docs/cli.md"
HEADER = f"""# CLI reference

Generated from the `qvl-trt` command line by `{REGENERATE}`;
do not edit by hand (tests/test_docs.py fails when it is stale). Every command prints its part
with `--help`. What the commands do in depth: [build.md](build.md), [triton.md](triton.md),
[openai.md](openai.md), [deployment.md](deployment.md).

<!-- test: cheap -->
```
qvl-trt --help
qvl-trt build --help
```

User errors print one line starting with `error:` and exit 1; exit code 3 means a build stage
needs another machine (the message says which command finishes it).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(value: object) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)


def _default(param) -> str:
    """The default as the help shows it: `required`, blank when there is none."""
    if param.required:
        return "required"
    value = param.default
    if param.param_type_name == "option" and param.is_flag:
        if param.secondary_opts:  # --force / --no-force
            return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
        return "set" if value else ""
    if value is None or value == () or value == []:
        return ""
    if isinstance(value, (list, tuple)):
        return "`" + ", ".join(_value(v) for v in value) + "`"
    return f"`{_value(value)}`"


def _name(param, ctx) -> str:
    """`--opt`, `-o` TYPE for an option; NAME for an argument."""
    if param.param_type_name == "argument":
        return f"`{param.display_name_raw.upper()}`"
    names = param.opts
    if param.secondary_opts:
        names = [f"{param.opts[0]} / {param.secondary_opts[0]}", *param.opts[1:]]
    shown = ", ".join(f"`{n}`" for n in names)
    if not param.is_flag and not param.count:
        shown += f" {param.metavar or param.display_type(ctx)}"
    if param.multiple:
        shown += " (repeatable)"
    return shown


def _options(params, ctx) -> list[str]:
    lines = []
    if params:
        lines += ["| argument / option | default | |", "|---|---|---|"]
        for p in params:
            lines.append(f"| {_cell(_name(p, ctx))} | {_cell(_default(p))} | "
                         f"{_cell(p.help or '')} |")
        lines.append("")
    return lines


def _command(name: str, cmd, ctx) -> list[str]:
    lines = [f"### `qvl-trt {name}`", "", (cmd.help or "").strip(), ""]
    return lines + _options([p for p in cmd.params if not p.hidden], ctx)


def render() -> str:
    """The reference as Markdown: a section per help panel, in the app's order."""
    import typer

    from qvl_trt.cli import app

    group = typer.main.get_command(app)
    ctx = typer.Context(group, info_name="qvl-trt")
    panels: dict[str, list] = {}
    for name, cmd in group.commands.items():  # registration order: the help's order
        panels.setdefault(cmd.rich_help_panel or "Commands", []).append((name, cmd))
    lines = [HEADER, "## Global options", "",
             "Given before the command: `qvl-trt -v build ...`.", ""]
    lines += _options([p for p in group.params if not p.hidden], ctx)
    for panel, commands in panels.items():
        lines += [f"## {panel}", ""]
        lines += [f"- [`qvl-trt {name}`](#qvl-trt-{name})" for name, _ in commands]
        lines.append("")
        for name, cmd in commands:
            lines += _command(name, cmd, ctx)
    return "\n".join(lines).rstrip() + "\n"


def stale(reference: Path) -> str | None:
    """None when `reference` holds what render() makes, else the one-line reason and fix."""
    current = reference.read_text() if reference.is_file() else None
    if current == render():
        return None
    what = "is missing" if current is None else "is stale"
    return f"{reference.name} {what}: regenerate it with `{REGENERATE}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the reference file instead of printing; exit 1 "
                        "when it differs")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help="the file --check compares (default: docs/cli.md)")
    args = parser.parse_args(argv)
    if args.check:
        problem = stale(args.reference)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
