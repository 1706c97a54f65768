"""A benchmark fixture: a decoder stand-in that makes tokens at a fixed rate instead of running
a model, so that a benchmark measures what the served pipeline itself costs per token
(scripts/bench_pipeline_overhead.py). Never part of a repository `qvl-trt repo` writes: the
benchmark puts it into its own copy with `install_token_generator`.

It plugs into the reference tensorrt_llm model (runtime.reference_tensorrt_llm LlmModel and
ReferenceLlm), so the stock backend's contract, streaming responses, end and final flags,
cancellation and stop requests are those of the reference model, checked by the same code.
Each step (one token for every running request, as an in-flight batch) starts 1/rate after
the previous one: every stream gets `tokens_per_s`, whatever the number of streams."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError
from ..llm.layout import LlmConfig, read_llm_config
from ..llm.sampling import DecodeRequest, FinishReason, TokenEvent
from ..triton.layout import CHECKPOINT_DIR, MODEL_PY

SETTINGS = "token_generator.json"  # in the model's version folder: {"tokens_per_s": rate}

# The model.py of a tensorrt_llm folder served by the generator (same config.pbtxt, same
# checkpoint folder for the model's sizes).
MODEL = '''"""tensorrt_llm replaced by a benchmark fixture (qvl_trt.testing.token_generator): the
reference model's contract over tokens made at a fixed rate."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "qvl_trt_runtime.zip"))

from qvl_trt.testing.token_generator import TokenGenerator  # noqa: E402
from qvl_trt.triton.runtime.backend import exit_with_server  # noqa: E402
from qvl_trt.triton.runtime.reference_tensorrt_llm import LlmModel  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.model = LlmModel.load(args, lambda params: TokenGenerator.load(HERE))

    def execute(self, requests):
        self.model.execute(requests)
        return None

    def finalize(self):
        self.model.close()
'''


def install_token_generator(version_folder: Path, tokens_per_s: float) -> None:
    """Turn a reference tensorrt_llm version folder (of a benchmark's own repository) into the
    generator: its model.py replaced, the rate written beside it; the weights are dropped (the
    checkpoint's config stays: the model's sizes)."""
    folder = Path(version_folder)
    (folder / MODEL_PY).write_text(MODEL)
    (folder / SETTINGS).write_text(json.dumps({"tokens_per_s": tokens_per_s}))
    for path in (folder / CHECKPOINT_DIR).glob("*.safetensors"):
        path.unlink()
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)


class TokenGenerator:
    """The decoder interface ReferenceLlm drives (`config`, `batch()`)."""

    def __init__(self, config: LlmConfig, tokens_per_s: float) -> None:
        if tokens_per_s <= 0:
            raise ConfigError(f"tokens_per_s is {tokens_per_s}; give a rate > 0")
        self.config = config
        self.period = 1.0 / tokens_per_s

    @classmethod
    def load(cls, version_folder: Path) -> TokenGenerator:
        settings = json.loads((version_folder / SETTINGS).read_text())
        return cls(read_llm_config(version_folder / CHECKPOINT_DIR), settings["tokens_per_s"])

    def batch(self, guided: Any = None, *, context_chunk: int | None = None) -> GeneratorBatch:
        """A batch; `guided` is taken and not applied (the generator refuses guides), nor is
        `context_chunk` (it runs no context phase)."""
        return GeneratorBatch(self.period, self.config.vocab_size)


@dataclass(eq=False)
class _Stream:
    key: int
    request: DecodeRequest
    tokens: list[int]  # what it emits, in a cycle: the prompt's text ids
    made: int = 0


@dataclass
class GeneratorBatch:
    """DecodeBatch's interface (add, drop, `in`, len, step) at a fixed step rate."""

    period: float
    vocab_size: int  # fake (prompt-table) ids start here
    _streams: list[_Stream] = field(default_factory=list)
    _next_key: int = 0
    _next_step: float | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, key: int) -> bool:
        return any(s.key == key for s in self._streams)

    def add(self, request: DecodeRequest) -> int:
        if request.guide is not None:
            raise InputError("the token generator does not apply guides; send the request "
                             "without one")
        # Prompt ids that neither stop it nor are fake (visual) ids.
        stop = set(request.sampling.stop_token_ids)
        tokens = [t for t in request.input_ids if t not in stop and t < self.vocab_size]
        if not tokens:
            raise InputError("the token generator repeats the prompt's text ids; send a prompt "
                             "with text")
        key, self._next_key = self._next_key, self._next_key + 1
        self._streams.append(_Stream(key, request, tokens))
        return key

    def drop(self, key: int) -> None:
        if key not in self:
            raise KeyError(f"request {key} is not in the batch")
        self._streams = [s for s in self._streams if s.key != key]

    def step(self) -> list[TokenEvent]:
        """Wait for the step's time, then one token for each stream. After an idle spell (or
        a consumer slower than the rate) the clock restarts: no burst to catch up."""
        now = time.monotonic()
        if self._next_step is None or now - self._next_step > self.period:
            self._next_step = now
        time.sleep(max(0.0, self._next_step - now))
        self._next_step += self.period
        events = []
        for s in self._streams:
            token = s.tokens[s.made % len(s.tokens)]
            s.made += 1
            finish = FinishReason.LENGTH if s.made >= s.request.sampling.max_tokens else None
            events.append(TokenEvent(s.key, token, finish))
        self._streams = [s for s in self._streams if s.made < s.request.sampling.max_tokens]
        return events

