"""Fixtures for the tests, `make demo` and scripts/: tiny random Qwen3-VL checkpoints and the
offline Qwen tokenizer files. Never imported by code that is served or shipped to users."""
