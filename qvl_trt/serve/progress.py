"""What the server itself reports of its progress, read from Triton's /metrics (the
Prometheus text format), the same on both flavors:
- each tensorrt_llm model's iteration counter: the stock backend's
  nv_trt_llm_general_metrics{general_type="iteration_counter"} (triton/tensorrtllm_backend.py
  says where it comes from), which the reference tensorrt_llm publishes too;
- Triton's own per-model counters of finished requests and executions
  (nv_inference_request_success, nv_inference_request_failure, nv_inference_exec_count: core
  src/metrics.cc), which count the python models' work.
Any of them moving is progress (serve/liveness.py)."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from ..triton import tensorrtllm_backend as tb

TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure",
                   "nv_inference_exec_count")
# One sample: NAME{LABELS} VALUE [TIMESTAMP]; label values are quoted, with \" and \\ escapes.
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """The samples of a metrics page: (name, labels) -> value."""
    samples: Samples = {}
    for line in text.splitlines():
        match = None if line.startswith("#") else _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = frozenset((k, v.replace('\\"', '"').replace("\\\\", "\\"))
                          for k, v in _LABEL.findall(labels or ""))
        try:
            samples[name, pairs] = float(value)
        except ValueError:
            continue
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and want <= pairs)


def iterations(samples: Samples) -> float:
    """The iterations of every tensorrt_llm model so far (each a step of its whole batch)."""
    return total(samples, tb.GENERAL_METRICS.family,
                 **{tb.GENERAL_METRICS.category: tb.ITERATION_COUNTER})


def progress_counters(samples: Samples) -> tuple[float, ...]:
    """The counters whose change is progress: the tensorrt_llm models' iterations, then
    Triton's request and execution counts, each summed over the models."""
    return (iterations(samples), *(total(samples, name) for name in TRITON_COUNTERS))


def read_metrics(url: str, timeout_s: float = 5.0) -> Samples | None:
    """The samples at `url` (a /metrics page), or None while it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as page:
            return parse_metrics(page.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None
