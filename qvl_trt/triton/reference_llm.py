"""The reference flavor's `tensorrt_llm` step: the stock backend's I/O and streaming behaviour
over the PyTorch reference decoder.

Requests are queued; a worker thread runs the waiting ones together as one batch of the
reference decoder (up to max_batch_size; later arrivals wait for the next batch) and sends
each request's tokens to its own callback, so concurrent requests never see each other's
tokens. As in the TensorRT-LLM executor, the end token is left out of the output, stop-word
tokens are kept, and a streaming request gets one response per token (the end token's
response is empty), a non-streaming one a single response.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from . import contract as c
from .preprocess import word_list_sequences

log = logging.getLogger(__name__)

# emit(new token ids, final): one response; fail(message): an error response (final).
Emit = Callable[[list[int], bool], None]
Fail = Callable[[str], None]


@dataclass(frozen=True)
class LlmRequest:
    """One request by the stock backend's input tensors (one batch row)."""

    input_ids: tuple[int, ...]
    max_tokens: int
    end_id: int | None
    streaming: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_words: tuple[tuple[int, ...], ...]
    prompt_table: Any  # numpy [rows, hidden] or None
    mrope_rotary_cos_sin: Any  # numpy fp32 [max_positions * rotary_dim]
    mrope_position_delta: int

    @classmethod
    def from_inputs(cls, x: Mapping[str, np.ndarray]) -> LlmRequest:
        """`x`: input name -> array of one batch row (no batch dim); optional ones may be
        missing. Defaults are the TensorRT-LLM executor's."""

        def scalar(name: str, default: Any = None) -> Any:
            value = x.get(name)
            return default if value is None else np.asarray(value).reshape(-1)[0].item()

        if x.get(c.INPUT_IDS) is None or x.get(c.REQUEST_OUTPUT_LEN) is None:
            raise InputError("input_ids and request_output_len are required")
        ids = np.asarray(x[c.INPUT_IDS]).reshape(-1)
        length = scalar(c.INPUT_LENGTHS, ids.size)
        if x.get(c.MROPE_ROTARY_COS_SIN) is None or x.get(c.MROPE_POSITION_DELTAS) is None:
            raise InputError("this engine uses MRoPE: mrope_rotary_cos_sin and "
                             "mrope_position_deltas are required")
        words = x.get(c.STOP_WORDS_LIST)
        return cls(
            input_ids=tuple(int(t) for t in ids[:length]),
            max_tokens=int(scalar(c.REQUEST_OUTPUT_LEN)),
            end_id=scalar(c.END_ID),
            streaming=bool(scalar(c.STREAMING, False)),
            temperature=float(scalar(c.TEMPERATURE, 1.0)),
            top_k=int(scalar(c.RUNTIME_TOP_K, 0)),
            top_p=float(scalar(c.RUNTIME_TOP_P, 1.0)),
            seed=scalar(c.SEED),
            stop_words=() if words is None else tuple(
                tuple(s) for s in word_list_sequences(words)),
            prompt_table=x.get(c.PROMPT_EMBEDDING_TABLE),
            mrope_rotary_cos_sin=np.asarray(x[c.MROPE_ROTARY_COS_SIN]).reshape(-1),
            mrope_position_delta=int(scalar(c.MROPE_POSITION_DELTAS)),
        )


@dataclass
class _Job:
    request: LlmRequest
    emit: Emit
    fail: Fail
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class ReferenceLlm:
    def __init__(self, decoder: Any, *, max_batch_size: int) -> None:
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="reference-llm", daemon=True)
        self._worker.start()

    def submit(self, request: LlmRequest, emit: Emit, fail: Fail) -> None:
        self._queue.put(_Job(request, emit, fail))

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=60)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            wave = [job]
            while len(wave) < self.max_batch_size:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # finish this wave, then stop
                    break
                wave.append(more)
            self._run_wave(wave)

    def _run_wave(self, wave: list[_Job]) -> None:
        try:
            self._decode(wave)
        except InputError as exc:
            if len(wave) == 1:
                wave[0].fail(str(exc))
            else:  # find the bad request: the others must not fail with it
                for job in wave:
                    self._run_wave([job])
        except Exception as exc:  # a bug: answer every waiting client, keep serving
            log.exception("reference decoder failed")
            for job in wave:
                if not job.done:
                    job.fail(f"reference decoder failed: {exc!r}")

    def _decode(self, wave: list[_Job]) -> None:
        torch = _torch()
        from ..llm.sampling import DecodeRequest, SamplingParams

        requests = []
        for job in wave:
            r = job.request
            singles = tuple(w[0] for w in r.stop_words if len(w) == 1)
            table = None if r.prompt_table is None else torch.from_numpy(
                np.ascontiguousarray(r.prompt_table))
            requests.append(DecodeRequest(
                input_ids=r.input_ids,
                mrope_rotary_cos_sin=torch.from_numpy(
                    np.ascontiguousarray(r.mrope_rotary_cos_sin, np.float32)),
                mrope_position_delta=r.mrope_position_delta,
                prompt_table=table,
                sampling=SamplingParams(
                    max_tokens=r.max_tokens, temperature=r.temperature, top_k=r.top_k,
                    top_p=r.top_p, seed=r.seed,
                    stop_token_ids=(*((r.end_id,) if r.end_id is not None else ()), *singles)),
            ))
        for event in self.decoder.stream(requests):
            job = wave[event.request]
            if job.done:
                continue  # finished here on a multi-token stop word; the decoder runs on
            r = job.request
            if event.token_id == r.end_id:
                self._finish(job, [])
                continue
            job.tokens.append(event.token_id)
            final = event.finish_reason is not None or _ends_with_stop(job.tokens, r.stop_words)
            if final:
                self._finish(job, [event.token_id])
            elif r.streaming:
                job.emit([event.token_id], False)

    @staticmethod
    def _finish(job: _Job, last: list[int]) -> None:
        job.done = True
        job.emit(last if job.request.streaming else job.tokens, True)


def _ends_with_stop(tokens: list[int], stop_words: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(w) > 1 and tuple(tokens[-len(w):]) == w for w in stop_words)


def _torch():
    from ..deps import require

    return require("torch", extra="export", why="run the reference decoder")
