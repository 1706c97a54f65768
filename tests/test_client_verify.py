"""`verify` without a server: case files, first divergence, the must-match rule."""

from __future__ import annotations

import json

import pytest

from qvl_trt.cli.console import verify_json, verify_line
from qvl_trt.client.verify import Case, compare, first_divergence, load_cases, verify
from qvl_trt.errors import InputError


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one side stopped early
    assert first_divergence([], []) is None


def test_must_match_allows_late_drift_only():
    case = Case("c", "p")
    assert compare(case, [1, 2, 3, 4], [1, 2, 3, 4], None).passed
    assert not compare(case, [1, 2, 3, 4], [1, 2, 9, 4], None).passed  # default: all tokens
    late = compare(case, [1, 2, 3, 4], [1, 2, 9, 4], 2)
    assert late.passed and late.first_divergence == 2 and late.must_match == 2
    assert not compare(case, [1, 2, 3, 4], [1, 8, 3, 4], 2).passed
    strict = compare(Case("c", "p", must_match=4), [1, 2, 3, 4], [1, 2, 3, 5], 2)
    assert not strict.passed  # the case's own must_match wins over the command's


def test_verify_runs_both_sides_per_case():
    seen = []
    results = verify([Case("a", "x", max_tokens=3), Case("b", "y")],
                     reference=lambda req: [1, 2, 3][: req.max_tokens],
                     candidate=lambda req: [1, 2, 3] if req.prompt == "x" else [7],
                     on_case=seen.append)
    assert [r.passed for r in results] == [True, False] and seen == results
    assert results[1].first_divergence == 0


def test_case_files(tmp_path):
    (tmp_path / "img.png").write_bytes(b"not read until the request is built")
    (tmp_path / "list.json").write_text(json.dumps(
        [{"name": "n", "prompt": "p", "images": ["img.png"], "max_tokens": 4,
          "must_match": 2}, {"prompt": "q"}]))
    a, b = load_cases(tmp_path / "list.json")
    assert (a.name, a.images, a.max_tokens, a.must_match) == ("n", (tmp_path / "img.png",), 4, 2)
    assert (b.name, b.max_tokens, b.must_match) == ("case 2", 16, None)
    (tmp_path / "cases.jsonl").write_text('{"prompt": "p"}\n\n{"prompt": "q"}\n')
    assert [c.prompt for c in load_cases(tmp_path / "cases.jsonl")] == ["p", "q"]
    (tmp_path / "wrapped.json").write_text(json.dumps({"cases": [{"prompt": "p"}]}))
    assert len(load_cases(tmp_path / "wrapped.json")) == 1
    assert a.request().images == (b"not read until the request is built",)
    assert a.request().temperature == 0.0  # greedy
    (tmp_path / "clip.mp4").write_bytes(b"a video")
    (tmp_path / "video.json").write_text(json.dumps(
        [{"prompt": "p", "videos": ["clip.mp4"], "video_fps": 3}]))
    (video,) = load_cases(tmp_path / "video.json")
    assert (video.request().videos, video.request().video_fps) == ((b"a video",), 3.0)


@pytest.mark.parametrize("content, message", [
    ("[]", "non-empty list"),
    ('[{"prompt": 3}]', "prompt string"),
    ('[{"prompt": "p", "imgs": []}]', "unknown keys"),
    ('[{"prompt": "p", "images": ["missing.png"]}]', "does not exist"),
    ('[{"prompt": "p", "videos": ["missing.mp4"]}]', "video .*missing.mp4 does not exist"),
    ('[{"prompt": "p", "video_fps": 0}]', "video_fps must be a number above 0"),
    ('[{"prompt": "p", "max_tokens": 0}]', "max_tokens"),
    ('[{"prompt": "p", "must_match": -1}]', "must_match"),
    ("{not json", "not JSON or JSON lines"),
])
def test_bad_case_files(tmp_path, content, message):
    path = tmp_path / "cases.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_cases(path)
    with pytest.raises(InputError, match="cannot read"):
        load_cases(tmp_path / "absent.json")


def test_each_case_is_one_line_naming_the_first_divergence():
    same = compare(Case("same", "p"), [5, 6, 7], [5, 6, 7], None)
    early = compare(Case("early", "p"), [5, 6, 7], [5, 9], None)
    late = compare(Case("late", "p", must_match=2), [5, 6, 7], [5, 6], None)
    assert verify_line(same) == "[green]ok[/green] same: 3 tokens identical"
    assert verify_line(early) == ("[red]FAIL[/red] early: first divergence at token 1: "
                                  "reference 6, deployment 9 (3 must match)")
    assert verify_line(late) == ("[green]ok[/green] late: first divergence at token 2: "
                                 "reference 7, deployment end (2 must match)")
    assert [r["passed"] for r in verify_json([same, early, late])] == [True, False, True]
    assert verify_json([early])[0]["candidate"] == (5, 9)
