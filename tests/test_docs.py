"""The documentation (README.md and docs/*.md) checked against the repository: every relative
link reaches a file (and its #anchor a heading), every command block marked
`<!-- test: cheap -->` runs, and docs/cli.md is what scripts/cli_reference.py makes of the CLI.
Each checker is also fed a broken input, so a check that cannot fail would show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CHEAP = "<!-- test: cheap -->"
README_MAX_LINES = 300
# Wording about how the project was made rather than about the project.
HISTORY = re.compile(r"(?i)\bissue \d|\bthe issue\b|\bissue's|/tmp/|/work/|this session|\d-core machine"
                     r"|\bcode index\b"
                     # design notes kept outside the repository: cite upstream, or docs/
                     r"|\b(?-i:STOCK_BACKEND|QWEN3VL|TRTLLM|ARCHITECTURE|TESTING|STYLE|TRITON)\.md\b")

_FENCE = re.compile(r"^```")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6}) +(.*?) *#*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The #anchors GitHub makes of a page's headings: lower case, punctuation dropped except
    `-` and `_`, spaces as `-`."""
    found = set()
    for line in _prose(text):
        match = _HEADING.match(line)
        if match:
            found.add(re.sub(r"[^\w\- ]", "", match.group(2).lower()).replace(" ", "-"))
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """One line per relative link of `text` (the content of `page`) whose file or heading is
    missing."""
    problems = []
    for line in _prose(text):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if path and not file.exists():
                problems.append(f"{page.name}: {target}: no file {path}")
                continue
            if anchor and file.suffix == ".md" and anchor not in anchors(
                    file.read_text() if path else text):
                problems.append(f"{page.name}: {target}: no heading #{anchor} in {file.name}")
    return problems


def cheap_blocks(text: str) -> list[str]:
    """The fenced blocks right after a `<!-- test: cheap -->` line, as shell text."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != CHEAP:
            continue
        if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
            raise ValueError(f"line {i + 1}: {CHEAP} must be followed by a ``` block")
        end = next(j for j in range(i + 2, len(lines)) if _FENCE.match(lines[j]))
        blocks.append("\n".join(lines[i + 2:end]))
    return blocks


def run_block(block: str, work: Path) -> subprocess.CompletedProcess:
    """`block` in bash from a copy of the repository root made of links to its source entries,
    in `work` (so what the block writes lands there, never in the repository's own build/ or
    demo/, which are not linked), with this Python's bin first on PATH."""
    for entry in REPO.iterdir():
        if (not entry.name.startswith(".") and entry.name not in {"build", "demo"}
                and not (work / entry.name).exists()):
            (work / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def cli_reference_check(reference: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cli_reference.py"), "--check",
         "--reference", str(reference)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=60, check=False)


BLOCKS = [(page, i, block) for page in DOCS for i, block in enumerate(cheap_blocks(
    page.read_text()))]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert broken_links(page, page.read_text()) == []


def test_a_missing_file_or_heading_is_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading: yes\n")
    text = ("[ok](other.md#a-code-heading-yes) [here](#top) [web](https://example.com)\n"
            "[gone](missing.md) [bad](other.md#nowhere)\n"
            "```\n[in code](not-checked.md)\n# not a heading\n```\n# Top\n")
    assert broken_links(page, text) == [
        "page.md: missing.md: no file missing.md",
        "page.md: other.md#nowhere: no heading #nowhere in other.md",
    ]
    assert anchors(text) == {"top"}


def test_the_docs_have_cheap_blocks():
    # README: the core commands and a tiny checkpoint inspected and planned.
    assert len([b for b in BLOCKS if b[0].name == "README.md"]) >= 2


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory) -> Iterator[dict[tuple[str, int], Future]]:
    """Every cheap block run by `run_block`, each in a folder of its own, one per core at a
    time, all started when the first test asks."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        yield {(page.name, index): pool.submit(run_block, block,
                                               tmp_path_factory.mktemp(f"{page.stem}-{index}"))
               for page, index, block in BLOCKS}


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS])
def test_cheap_block_runs(page, index, block, block_runs):
    result = block_runs[page.name, index].result()
    assert result.returncode == 0, (f"{page.name} block {index} failed:\n{block}\n"
                                    f"{result.stdout}{result.stderr}")


def test_a_failing_block_fails_and_a_marker_needs_a_block(tmp_path):
    text = f"{CHEAP}\n```\necho made > out.txt\nfalse\necho unreached\n```\n"
    (block,) = cheap_blocks(text)
    result = run_block(block, tmp_path)
    assert result.returncode != 0
    assert (tmp_path / "out.txt").read_text() == "made\n"  # it ran where it writes
    assert not (REPO / "out.txt").exists()
    with pytest.raises(ValueError, match="must be followed by a ``` block"):
        cheap_blocks(f"{CHEAP}\n\nqvl-trt gpus\n")


def test_cli_reference_is_current():
    result = cli_reference_check(REPO / "docs" / "cli.md")
    assert result.returncode == 0, result.stderr


def test_a_stale_cli_reference_names_the_fix(tmp_path):
    stale = tmp_path / "cli.md"
    stale.write_text((REPO / "docs" / "cli.md").read_text().replace("--tp-size", "--tp"))
    result = cli_reference_check(stale)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: cli.md is stale: regenerate it with "
                                     "`python scripts/cli_reference.py > docs/cli.md`")


def support_matrix_check(page: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "support_matrix.py"), "--check", "--page",
         str(page)], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120, check=False)


def test_support_matrix_is_current(tmp_path):
    page = REPO / "docs" / "support-matrix.md"
    result = support_matrix_check(page)
    assert result.returncode == 0, result.stderr
    # Break on purpose: one changed cell is caught, naming the fix.
    text = page.read_text()
    assert "| `4060ti` | 16380 | - |" in text  # the 8B in fp16
    stale = tmp_path / "support-matrix.md"
    stale.write_text(text.replace("| `4060ti` | 16380 | - |", "| `4060ti` | 16380 | 2 / 1 |"))
    result = support_matrix_check(stale)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: the support matrix in support-matrix.md is stale: "
                                     "regenerate it with `python scripts/support_matrix.py`")


def test_readme_is_short_and_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block


def test_no_text_about_how_the_project_was_made():
    """The documentation, scripts, code, tests and CI speak of the project only (this file
    holds the patterns, so it is left out)."""
    paths = [*DOCS, REPO / "Makefile", *(REPO / "scripts").glob("*"), *(REPO / ".ci").glob("*"),
             *(REPO / ".github").rglob("*.yml"), *(REPO / "triton_repo").rglob("*.py"),
             *(REPO / "qvl_trt").rglob("*.py"), *(REPO / "qvl_trt").rglob("*.toml"),
             *(REPO / "build_configs").glob("*.toml"), *(REPO / "tests").glob("*.py")]
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path in paths if path != Path(__file__).resolve()
            for n, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert len(paths) > 100
    assert hits == []


def test_history_wording_is_caught():
    for line in ("Issue 14's bound holds", "run from /tmp/tv/bin/python", "the issue's clip",
                 "on this 2-core machine", "this session's runs",
                 '(code index: "NVIDIA H200")', "the rule (STOCK_BACKEND.md)"):
        assert HISTORY.search(line), line
    assert not HISTORY.search("github.com/NVIDIA/DCGM/issues/232 on this machine's GPUs")
    assert not HISTORY.search("see docs/triton.md and triton.md#ensemble-api")


def journal_problems(text: str) -> list[str]:
    """One line per benchmarks.md entry (a `### DATE, commit HASH...` heading) that lacks its
    date and commit, or a command, machine or result line."""
    problems = []
    for entry in re.split(r"^(?=### )", text, flags=re.M)[1:]:
        heading, _, body = entry.partition("\n")
        if not re.match(r"### \d{4}-\d{2}-\d{2}, commits? [0-9a-f]{7}", heading):
            problems.append(f"{heading}: not 'DATE, commit HASH'")
        for field in ("command", "machine", "result"):
            if not re.search(rf"^- {field}s?\b", body, flags=re.M):
                problems.append(f"{heading}: no '- {field}' line")
    return problems


def test_every_benchmark_entry_has_date_commit_command_machine_result():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.count("\n### ") >= 8
    assert journal_problems(text) == []


def test_an_undated_benchmark_entry_is_caught():
    text = "## X\n\n### Two idle runs\n\n- command: `x`\n- result: 1 s\n"
    assert journal_problems(text) == ["### Two idle runs: not 'DATE, commit HASH'",
                                      "### Two idle runs: no '- machine' line"]
