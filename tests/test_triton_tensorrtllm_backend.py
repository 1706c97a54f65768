"""The stock tensorrtllm backend's parameter parsing, as `check_parameters` (and so
`qvl-trt validate`) applies it: every rule broken once on purpose."""

from __future__ import annotations

import pytest

from qvl_trt.triton.tensorrtllm_backend import (
    PARAMETERS,
    check_parameters,
    parse_bool,
    parse_float,
    parse_int,
)

GOOD = {
    "gpt_model_type": "inflight_fused_batching",
    "gpt_model_path": "/models/tensorrt_llm/1/engine",
    "tokenizer_dir": "",
    "xgrammar_tokenizer_info_path": "",
    "guided_decoding_backend": "",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "enable_chunked_context": "true",
    "kv_cache_free_gpu_mem_fraction": "0.9",
    "max_tokens_in_paged_kv_cache": "8192",
}


def test_what_the_writer_emits_parses():
    assert check_parameters(GOOD) == []


@pytest.mark.parametrize("key", ["gpt_model_type", "tokenizer_dir",
                                 "xgrammar_tokenizer_info_path", "guided_decoding_backend"])
def test_a_missing_no_fallback_key_is_refused(key):
    params = {k: v for k, v in GOOD.items() if k != key}
    (problem,) = check_parameters(params)
    assert problem.startswith(f"parameter {key} is missing") and "fails the load" in problem


@pytest.mark.parametrize("key, value, words", [
    ("enable_chunked_context", "yes", "booleans are True/true/TRUE/1"),
    ("batch_scheduler_policy", "guaranteed_no_evic", "choose one of max_utilization"),
    ("gpt_model_type", "inflight", "would fail the load"),
    ("decoding_mode", "greedy", "would use its default"),
    ("max_tokens_in_paged_kv_cache", "8192abc", "not a whole number"),
    ("max_tokens_in_paged_kv_cache", "4294967296", "not a whole number"),
    ("kv_cache_free_gpu_mem_fraction", "nan", "not a number"),
    ("kv_cache_free_gpu_mem_fraction", "ninety", "not a number"),
    ("kv_cache_free_gpu_mem_fraction_", "0.9", "not read by the tensorrtllm backend"),
    ("worker_path", "/opt/worker", "use executor_worker_path"),
    ("sink_token_length", "4", "ignores the MRoPE table"),
    ("prompt_table_offloading", "true", "drops the DeepStack rows"),
])
def test_a_value_the_backend_would_misread_is_refused(key, value, words):
    problems = check_parameters({**GOOD, key: value})
    assert len(problems) == 1 and problems[0].startswith(f"parameter {key}") and \
        words in problems[0], problems


def test_guards_accept_off():
    assert check_parameters({**GOOD, "sink_token_length": "0",
                             "prompt_table_offloading": "false"}) == []


def test_guided_decoding_only_with_xgrammar():
    on = {**GOOD, "xgrammar_tokenizer_info_path": "/t.json"}
    assert check_parameters({**on, "guided_decoding_backend": "xgrammar"}) == []
    (problem,) = check_parameters({**on, "guided_decoding_backend": "outlines"})
    assert "supports only xgrammar" in problem
    # A backend without the info path is "not set" for the backend.
    assert check_parameters({**GOOD, "guided_decoding_backend": "outlines"}) == []


def test_parsers_match_the_backend():
    assert [parse_bool(t) for t in ("True", "true", "TRUE", "1")] == [True] * 4
    assert [parse_bool(t) for t in ("False", "false", "FALSE", "0")] == [False] * 4
    assert parse_bool("yes") is None and parse_bool("True ") is None
    assert parse_int("-3") == -3 and parse_int("2147483647") == 2**31 - 1
    assert parse_int("2147483648") is None and parse_int("1.5") is None
    assert parse_float("1e-1") == 0.1 and parse_float("inf") is None


def test_every_required_key_is_a_string_or_choice():
    required = sorted(k for k, p in PARAMETERS.items() if p.required)
    assert required == ["gpt_model_type", "guided_decoding_backend", "tokenizer_dir",
                        "xgrammar_tokenizer_info_path"]
