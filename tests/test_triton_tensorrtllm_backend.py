"""The stock tensorrtllm backend's parameter parsing, as `check_parameters` (and so
`qvl-trt validate`) applies it: every rule broken once on purpose."""

from __future__ import annotations

import dataclasses

import pytest

from qvl_trt.triton.tensorrtllm_backend import (
    PARAMETERS,
    EngineLimits,
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


def test_the_engines_context_limits_as_the_executor_reads_them(tmp_path):
    """The build config our engines get: max input len max_seq_len - 1 with chunked context,
    else min(max_seq_len - 1, max_num_tokens); chunks of max_num_tokens cut to whole blocks;
    chunking off without paged context FMHA; no chunk below one block."""
    from qvl_trt.llm.engine import engine_build_config
    from qvl_trt.profiles import load_profile
    from qvl_trt.testing.small_profile import small_profile_toml

    path = tmp_path / "profile.toml"
    path.write_text(small_profile_toml(max_seq_len=1024, max_num_tokens=100,
                                       tokens_per_block=32))
    build = engine_build_config(load_profile(str(path)), deepstack_layers=3)
    engine = EngineLimits.of_build_config(build)
    assert engine == EngineLimits(max_seq_len=1024, max_num_tokens=100, tokens_per_block=32,
                                  paged_context_fmha=True)
    assert (engine.max_input_len(True), engine.max_input_len(False)) == (1023, 100)
    assert engine.context_chunk == 96 and engine.chunking_problem() is None
    build["plugin_config"]["use_paged_context_fmha"] = False
    unpaged = EngineLimits.of_build_config(build)
    assert not unpaged.chunked(True) and unpaged.max_input_len(True) == 100
    small = dataclasses.replace(engine, max_num_tokens=31)
    assert small.context_chunk == 0
    assert "max_num_tokens 31 is below one KV block (tokens_per_block 32)" in \
        small.chunking_problem()
