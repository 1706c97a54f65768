"""Fixtures for the tests, `make demo` and scripts/: tiny random Qwen3-VL checkpoints, the
offline Qwen tokenizer files, GPU profiles with small limits and the tiny reference-flavor
repository. Never imported by code that is served or shipped to users."""
