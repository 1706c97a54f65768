"""What `qvl-trt repo` is asked for: the build folders (by name), the repository's flavor and
the options of its writer (repository.py). Standard library only, so the CLI reads its
defaults here without loading the writer."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..dtypes import Dtype
from ..errors import ConfigError


class Flavor(str, enum.Enum):
    """How the vision_encoder and tensorrt_llm steps run; the I/O is the same."""

    TRT = "trt"  # vision TensorRT engine in a python model; the stock tensorrtllm backend
    REFERENCE = "reference"  # PyTorch vision tower and reference decoder, python models


def machine_cores() -> int:
    """CPU cores this process may run on (its affinity, as a container's CPU set limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1


def default_postprocessing_instances(cores: int | None = None) -> int:
    """One instance per four cores, 1 to 4. Each instance is a stub process of its own: its
    own GIL, and its own thread through which the python backend hands it every tensorrt_llm
    response (python_backend pb_stub.cc ParentToStubMQMonitor), so instances spread the
    token hop over cores. The per-token work is mostly those hand-offs, a fraction of a core
    per few thousand tokens/s (scripts/bench_pipeline_overhead.py prints it): four cover
    a large GPU's token rate, and each instance costs a process and its worker threads."""
    return max(1, min(4, (cores or machine_cores()) // 4))


# The default queue, per batch slot: four rounds of answers wait behind the running one, so
# five times the slots in requests are served without a refusal (the load benchmarks and
# agents send at 1x to 5x); past them a client is told at once, and --max-queue-wait bounds
# how long the admitted ones may wait.
QUEUE_PER_SLOT = 4


@dataclass(frozen=True)
class RepoOptions:
    flavor: Flavor = Flavor.TRT
    # Where the repository will be mounted when served (the tensorrtllm backend reads an
    # absolute engine path); None: where it is written.
    mount_path: str | None = None
    default_max_tokens: int = 512
    vision_cache_mib: int = 512
    image_url_allow_list: tuple[str, ...] = ()
    # One per CPU core of the machine the repository is generated on (preprocessing is CPU
    # work, one request at a time per instance); the serving machine is usually that one.
    preprocessing_instances: int = field(default_factory=lambda: machine_cores())
    # Instances of postprocessing and tensorrt_llm_bls (the token hop).
    postprocessing_instances: int = field(default_factory=default_postprocessing_instances)
    # Requests that may wait for a batch slot of a build's tensorrt_llm beyond its
    # max_batch_size ones running; more are refused as busy (the gateway's 429). None:
    # QUEUE_PER_SLOT x max_batch_size.
    max_queue: int | None = None
    # How long a request may wait for a slot before it is refused the same way (0: no bound).
    max_queue_wait_s: float = 0.0
    # Python models running PyTorch (reference flavor): "auto" = cuda when present.
    device: str = "auto"
    # The reference flavor's precision for the vision tower, the prompt table and the
    # decoder: float32 by default (it is the accuracy oracle, and what the in-process
    # reference pipeline computes on a CPU).
    reference_dtype: Dtype = Dtype.FLOAT32

    def __post_init__(self) -> None:
        for name in ("preprocessing_instances", "postprocessing_instances"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; give 1 or more")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError(f"--max-queue {self.max_queue} must be >= 0 (0: a request waits "
                              "for no slot: it runs at once or is refused)")
        if not self.max_queue_wait_s >= 0:
            raise ConfigError(f"--max-queue-wait {self.max_queue_wait_s} must be >= 0 seconds "
                              "(0: no bound)")

    def queue_for(self, max_batch_size: int) -> int:
        """The queue of a build whose tensorrt_llm has `max_batch_size` slots."""
        return QUEUE_PER_SLOT * max_batch_size if self.max_queue is None else self.max_queue


@dataclass(frozen=True)
class BuildInput:
    """A build folder, and the name of its models in the repository (None: upstream names,
    possible for one build only)."""

    path: Path
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> BuildInput:
        """`DIR` or `NAME=DIR` (the --build option)."""
        name, sep, path = text.partition("=")
        return cls(Path(path), name) if sep and name and "/" not in name else cls(Path(text))
