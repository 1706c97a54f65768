"""Talks to a running deployment: requests (generate/infer), the accuracy check against the
reference (verify) and the load benchmark with its metrics and reports (bench)."""
