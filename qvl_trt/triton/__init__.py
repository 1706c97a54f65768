"""Triton: repository emitter, validator, server launcher, clients and benchmarks."""
