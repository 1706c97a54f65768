"""The reference flavor's `tensorrt_llm` step: the stock backend's I/O, request contract and
streaming behaviour over the PyTorch reference decoder.

Requests are queued; a worker thread schedules them as the TensorRT-LLM executor does, by
iteration (in-flight batching, the decoder's DecodeBatch; upstream the schedulers pick each
iteration's requests, batch_manager/trtGptModelInflightBatching.cpp): before each step it
admits waiting requests up to max_batch_size, so a new request starts at the next step, and a
finished, cancelled or stopped one leaves the batch at once, freeing its slot. Each request's
tokens go to its own callback, so concurrent requests never see each other's tokens. As in the
TensorRT-LLM executor, the end token is left out of the output, stop-word tokens are kept, and
a streaming request gets one response per token (the end token's response is empty), a
non-streaming one a single response.

It is at least as strict as the stock backend (TensorRT-LLM
triton_backend/inflight_batcher_llm/src/utils.cc and model_instance_state.cc, and the
executor's request checks): it refuses what the backend or the executor refuses
(outputs not both requested, a missing MRoPE tensor, a prompt table of
the wrong dtype, width or size, a prompt above the executor's maximum input length, a malformed
stop_words_list, min_tokens below 0 or without an end id), clips what the executor clips
(request_output_len to the sequence length, top_k to TOP_K_MAX, both with a warning), and
refuses prompt_table_extra_ids of the wrong length, which the backend silently ignores. It
reads only the inputs the backend reads. It takes the engine's limits from the build config
beside its checkpoint, as the executor reads the engine's config.json, and the backend's
enable_chunked_context (absent: false): the longest prompt is max_seq_len - 1 with chunked
context, else min(max_seq_len - 1, max_num_tokens); with it, a context runs in chunks of
max_num_tokens rounded down to whole KV blocks (tensorrtllm_backend.EngineLimits, which cites
the upstream sources), which gives the logits of one pass. As the executor, it turns
chunking off with a warning on an engine without paged context FMHA; stricter, it refuses to
load an engine whose max_num_tokens is below one block, where the executor would never
schedule a longer prompt. A cancelled request (its Triton request cancelled, or
a stop request naming its id) ends within a token with a final response holding the tokens
not yet sent and no error, as the backend does: it cancels the executor request
(model_instance_state.cc WaitForCancel / handleStopRequest), which then finishes it
(llmRequest.h finishByReason(kCANCELLED)) and sends the last result, isFinal.

Guided decoding (llm/guided.py) follows the backend and the executor: a guide type without
its guide is refused at once; a guided request while the model's guided_decoding_backend is
empty fails alone at admission; a guide that does not compile fails every request of the
step that compiles it. Stricter than the backend, an unknown guide type (structural_tag
included) or a guide without a type is refused instead of running unguided, and a guided
request without an end id is refused instead of failing its whole step once the grammar is
complete. A guided answer
ends when its grammar is complete (the matcher then admits only the end tokens) or at its
output length.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, InputError
from ...llm.guided import BACKEND, Guide, GuidedDecoding, check_guided_ending
from ...manifest import BUILD_CONFIG_NAME
from .. import contract as c
from .. import tensorrtllm_backend as tb
from .backend import (
    error_message,
    guarded,
    model_parameters,
    pb,
    read_row,
    response,
    send_error,
)
from .block_reuse import BlockReuse

log = logging.getLogger(__name__)

# emit(new token ids, final): one response; fail(message): an error response (final).
Emit = Callable[[list[int], bool], None]
Fail = Callable[[str], None]
CLOSING = "tensorrt_llm is unloading; send the request again once the server is back"


def check_requested_outputs(names: Iterable[str]) -> None:
    """The stock backend's fillTritonResponse throws unless output_ids and sequence_length
    are both requested (none requested = all)."""
    names = set(names)
    missing = [n for n in c.LLM_OUTPUTS if names and n.name not in names]
    if missing:
        raise InputError(f"{', '.join(s.name for s in missing)} tensor must be present in list "
                         "of output tensors: request both output_ids and sequence_length")


@dataclass(frozen=True)
class LlmLimits:
    """What the engine takes per request: prompts of at most `max_input_len` tokens (the
    executor's, context_phase) in sequences of `max_seq_len`,
    prompt-table dtype and width, and at most `rows_per_request` rows (None: not known, not
    checked)."""

    hidden_size: int
    table_dtype: str  # numpy name: the model dtype
    max_input_len: int
    max_seq_len: int
    rows_per_request: int | None = None


@dataclass(frozen=True)
class LlmRequest:
    """One request by the stock backend's input tensors (one batch row)."""

    input_ids: tuple[int, ...]
    max_tokens: int
    end_id: int | None  # None: no end id (absent or negative, which no token equals)
    min_tokens: int
    streaming: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_words: tuple[tuple[int, ...], ...]
    prompt_table: Any  # numpy [rows, hidden] or None
    mrope_rotary_cos_sin: Any  # numpy fp32 [max_positions * rotary_dim]
    mrope_position_delta: int
    guide: Guide | None = None
    # What KV reuse matches besides the token ids: the backend passes them on only with a
    # prompt table (utils.cc getPromptTuningConfigFromTensors); None: 0 for every token.
    extra_ids: tuple[int, ...] | None = None

    @classmethod
    def from_inputs(cls, x: Mapping[str, np.ndarray], limits: LlmLimits) -> LlmRequest:
        """`x`: input name -> array of one batch row (no batch dim); optional ones may be
        missing. Defaults are the TensorRT-LLM executor's. input_lengths (read by the backend
        only for several batch rows) and prompt_vocab_size (never read) are ignored."""

        def scalar(name: str, default: Any = None) -> Any:
            value = x.get(name)
            return default if value is None else np.asarray(value).reshape(-1)[0].item()

        if x.get(c.INPUT_IDS) is None or x.get(c.REQUEST_OUTPUT_LEN) is None:
            raise InputError("input_ids and request_output_len are required")
        ids = np.asarray(x[c.INPUT_IDS]).reshape(-1)
        max_tokens = _output_len(ids.size, int(scalar(c.REQUEST_OUTPUT_LEN)), limits)
        if x.get(c.MROPE_ROTARY_COS_SIN) is None or x.get(c.MROPE_POSITION_DELTAS) is None:
            raise InputError("this engine uses MRoPE: mrope_rotary_cos_sin and "
                             "mrope_position_deltas are required")
        table = x.get(c.PROMPT_EMBEDDING_TABLE)
        if table is not None:
            _check_table(np.asarray(table), limits)
        extra = x.get(c.PROMPT_TABLE_EXTRA_IDS)
        if extra is not None and np.asarray(extra).size != ids.size:
            raise InputError(f"prompt_table_extra_ids has {np.asarray(extra).size} values for "
                             f"{ids.size} input ids: the backend would ignore them and KV reuse "
                             "would mix images; send one per input token")
        words = x.get(c.STOP_WORDS_LIST)
        end_id = scalar(c.END_ID)
        end_id = None if end_id is None or end_id < 0 else int(end_id)
        min_tokens = int(scalar(c.MIN_TOKENS, 0))
        _check_min_tokens(min_tokens, end_id)
        guide = Guide.from_inputs(*(None if x.get(s.name) is None else c.utf8(
            np.asarray(x[s.name]).reshape(-1)[0], s.name) for s in c.GUIDE_INPUTS))
        if guide is not None:
            check_guided_ending(end_id is not None, min_tokens)
        return cls(
            input_ids=tuple(int(t) for t in ids),
            max_tokens=max_tokens,
            end_id=end_id,
            min_tokens=min_tokens,
            streaming=bool(scalar(c.STREAMING, False)),
            temperature=float(scalar(c.TEMPERATURE, 1.0)),
            top_k=int(scalar(c.RUNTIME_TOP_K, 0)),
            top_p=float(scalar(c.RUNTIME_TOP_P, 1.0)),
            seed=scalar(c.SEED),
            stop_words=() if words is None else tuple(
                tuple(s) for s in c.word_list_sequences(words)),
            prompt_table=table,
            mrope_rotary_cos_sin=np.asarray(x[c.MROPE_ROTARY_COS_SIN]).reshape(-1),
            mrope_position_delta=int(scalar(c.MROPE_POSITION_DELTAS)),
            guide=guide,
            extra_ids=None if table is None or extra is None else tuple(
                int(v) for v in np.asarray(extra, np.uint64).reshape(-1)),
        )


def _output_len(prompt: int, asked: int, limits: LlmLimits) -> int:
    """The executor's length rules (LlmRequest::validate, TensorRT-LLM
    cpp/tensorrt_llm/batch_manager/llmRequest.cpp): a prompt longer than max_input_len is
    refused (the request gets an error response); prompt + request_output_len above
    max_seq_len clips the output length to what fits, with a warning."""
    if prompt > limits.max_input_len:
        raise InputError(f"Prompt length ({prompt}) exceeds maximum input length "
                         f"({limits.max_input_len}); send a shorter prompt or fewer or smaller "
                         "images")
    if prompt + asked > limits.max_seq_len:
        log.warning("Prompt length + number of requested output tokens (%d + %d) exceeds "
                    "maximum sequence length (%d); request_output_len changed to %d", prompt,
                    asked, limits.max_seq_len, limits.max_seq_len - prompt)
        return limits.max_seq_len - prompt
    return asked


def _check_min_tokens(min_tokens: int, end_id: int | None) -> None:
    """The executor refuses min_tokens < 0 (executor/samplingConfig.cpp checkMinTokens). The
    penalty kernel masks the logit at the request's end id until min_tokens
    (kernels/penaltyKernels.cu): without an end id that is index -1, out of the row, so it is
    refused here too."""
    if min_tokens < 0:
        raise InputError(f"min_tokens = {min_tokens} must be >= 0")
    if min_tokens and end_id is None:
        raise InputError(f"min_tokens = {min_tokens} holds back the end id, and the request "
                         "has none; send an end_id, or min_tokens 0")


def _check_table(table: np.ndarray, limits: LlmLimits) -> None:
    """The engine's prompt-table contract (promptTuningBuffers.cpp): model dtype, rows of
    hidden_size, at most max_prompt_embedding_table_size / max_batch_size rows."""
    if table.dtype != np.dtype(limits.table_dtype):
        raise InputError(f"prompt_embedding_table is {table.dtype}, the model computes in "
                         f"{limits.table_dtype}; send the table in the model dtype")
    if table.ndim != 2 or table.shape[1] != limits.hidden_size:
        raise InputError(f"prompt_embedding_table rows are {table.shape[1:]} wide, the model's "
                         f"hidden_size is {limits.hidden_size}")
    if limits.rows_per_request is not None and table.shape[0] > limits.rows_per_request:
        raise InputError(f"prompt_embedding_table has {table.shape[0]} rows, the engine takes "
                         f"{limits.rows_per_request} per request (max_prompt_embedding_table_"
                         "size / max_batch_size); send fewer or smaller images")


@dataclass(eq=False)  # jobs are compared by identity
class _Job:
    request: LlmRequest
    emit: Emit
    fail: Fail
    request_id: str = ""
    # The Triton request's own cancel flag (request.is_cancelled: a round trip to Triton),
    # asked at a step at most every `check_every` seconds, as the stock backend polls its
    # requests every cancellation_check_period_ms.
    is_cancelled: Callable[[], bool] = lambda: False
    check_every: float = 0.0
    stopped: bool = False  # a stop request named it
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # tokens already in a response
    done: bool = False
    next_check: float = 0.0

    def cancelled(self) -> bool:
        if self.stopped:
            return True
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.check_every
        return self.is_cancelled()


@dataclass(frozen=True)
class StepStats:
    """One iteration, as the executor's IterationStats count it (the stock backend's metrics,
    tensorrtllm_backend.REQUEST_METRICS): its number, the requests in its batch, and those
    among them in their context (prefill) phase and their prompt tokens; and the positions
    each request of the batch holds in the KV cache (its prompt and the tokens fed back)."""

    iteration: int
    active: int
    context_requests: int
    context_tokens: int
    held_tokens: tuple[int, ...]


class ReferenceLlm:
    def __init__(self, decoder: Any, *, max_batch_size: int,
                 on_step: Callable[[StepStats], None] = lambda stats: None,
                 on_finish: Callable[[int, int], None] = lambda prompt, output: None,
                 model_name: str = c.TENSORRT_LLM, cancel_check_s: float = 0.0,
                 guided: GuidedDecoding | None = None,
                 context_chunk: int | None = None) -> None:
        """`decoder.batch(guided, context_chunk=...)`: an empty in-flight batch
        (llm.reference.DecodeBatch) with guided decoding on (`guided`, else off), prefilling
        prompts in chunks of `context_chunk` positions (None: in one pass).
        `on_step(stats)`: after each iteration; `on_finish(prompt tokens, output tokens)`: at
        each request's final response. `model_name`: the model it serves, for errors.
        `cancel_check_s`: how often a request's own cancel flag is asked (0: at every step);
        a stop request counts at once."""
        self.decoder = decoder
        self._new_batch = partial(decoder.batch, guided, context_chunk=context_chunk)
        self.cancel_check_s = cancel_check_s
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.on_step = on_step
        self.on_finish = on_finish
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, list[_Job]] = {}  # request id -> its queued or running jobs
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="reference-llm", daemon=True)
        self._worker.start()

    def submit(self, request: LlmRequest, emit: Emit, fail: Fail, *, request_id: str = "",
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        job = _Job(request, emit, fail, request_id, is_cancelled, self.cancel_check_s)
        if request_id:
            with self._lock:
                self._jobs.setdefault(request_id, []).append(job)
        self._queue.put(job)

    def stop(self, request_id: str) -> None:
        """The stock backend's stop request: cancel the requests of `request_id` (none left:
        they may have finished already, not an error)."""
        if not request_id:
            raise InputError("Trying to stop a request but request ID is not provided")
        with self._lock:
            for job in self._jobs.get(request_id, []):
                job.stopped = True

    def close(self) -> None:
        """Unload: running requests end at the next token, queued ones get a final error."""
        self._closing.set()
        self._queue.put(None)
        self._worker.join(timeout=60)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._end(job, error=CLOSING)

    def _loop(self) -> None:
        batch = self._new_batch()
        running: dict[int, _Job] = {}  # batch key -> job
        admitted: list[_Job] = []  # since the last step: in their context phase
        iteration = 0
        while self._admit(batch, running, admitted):
            if not running:
                continue
            try:
                events = batch.step()
            except Exception as exc:  # answer every client of the batch, keep serving
                message = error_message(exc, self.model_name)
                for job in running.values():
                    self._end(job, error=message)
                running.clear()
                batch = self._new_batch()
                continue
            iteration += 1
            self.on_step(StepStats(iteration, len(running), len(admitted),
                                   sum(len(job.request.input_ids) for job in admitted),
                                   tuple(len(job.request.input_ids) + len(job.tokens)
                                         for job in running.values())))
            admitted.clear()
            for event in events:
                self._on_token(running[event.request], event)
            for key, job in list(running.items()):
                if self._check_cancel(job):
                    if key in batch:  # cancelled, stopped or a multi-token stop word
                        batch.drop(key)
                    del running[key]

    def _admit(self, batch: Any, running: dict[int, _Job], admitted: list[_Job]) -> bool:
        """Move waiting requests into the batch (and `admitted`), up to max_batch_size; wait
        for one while none runs. False: unloading."""
        while len(running) < self.max_batch_size:
            try:
                job = self._queue.get(block=not running)
            except queue.Empty:
                return True
            if job is None:
                for other in running.values():
                    self._check_cancel(other)  # unloading: a final error each
                return False
            if self._check_cancel(job):
                continue
            try:
                running[batch.add(_decode_request(job.request))] = job
                admitted.append(job)
            except InputError as exc:
                self._end(job, error=str(exc))
            except Exception as exc:
                self._end(job, error=error_message(exc, self.model_name))
        return True

    def _on_token(self, job: _Job, event: Any) -> None:
        if self._check_cancel(job):
            return
        r = job.request
        if event.token_id == r.end_id:
            self._end(job)
            return
        job.tokens.append(event.token_id)
        if event.finish_reason is not None or _ends_with_stop(job.tokens, r.stop_words):
            self._end(job)
        elif r.streaming:
            job.emit([event.token_id], False)
            job.sent = len(job.tokens)

    def _check_cancel(self, job: _Job) -> bool:
        """End a cancelled (or, at unload, any) request; True if it has ended."""
        if job.done:
            return True
        if self._closing.is_set():
            self._end(job, error=CLOSING)
        elif job.cancelled():
            self._end(job)
        return job.done

    def _end(self, job: _Job, *, error: str | None = None) -> None:
        """The final response: the tokens not yet sent (all of them unless streaming)."""
        job.done = True
        if job.request_id:
            with self._lock:
                jobs = self._jobs.get(job.request_id, [])
                if job in jobs:
                    jobs.remove(job)
                if not jobs:
                    self._jobs.pop(job.request_id, None)
        self.on_finish(len(job.request.input_ids), len(job.tokens))
        if error is not None:
            job.fail(error)
        else:
            job.emit(job.tokens[job.sent:], True)


def _decode_request(r: LlmRequest) -> Any:
    """The decoder's request: the end id and one-token stop words stop it in the decoder;
    longer stop words are matched here."""
    torch = _torch()
    from ...llm.sampling import DecodeRequest, SamplingParams

    singles = tuple(w[0] for w in r.stop_words if len(w) == 1)
    table = None if r.prompt_table is None else torch.from_numpy(
        np.ascontiguousarray(r.prompt_table))
    return DecodeRequest(
        input_ids=r.input_ids,
        mrope_rotary_cos_sin=torch.from_numpy(
            np.ascontiguousarray(r.mrope_rotary_cos_sin, np.float32)),
        mrope_position_delta=r.mrope_position_delta,
        prompt_table=table,
        sampling=SamplingParams(
            max_tokens=r.max_tokens, temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, seed=r.seed, min_tokens=r.min_tokens, end_id=r.end_id,
            stop_token_ids=(*((r.end_id,) if r.end_id is not None else ()), *singles)),
        guide=r.guide)


def _ends_with_stop(tokens: list[int], stop_words: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(w) > 1 and tuple(tokens[-len(w):]) == w for w in stop_words)


def _torch():
    from ...deps import require

    return require("torch", extra="export", why="run the reference decoder")


class ExecutorMetrics:
    """The stock backend's metrics (tensorrtllm_backend.REQUEST_METRICS and the groups after
    it), with its names, labels and meanings, set from the reference's iterations. Its KV
    cache blocks are counted as if the reference's cache were paged in blocks of the engine's
    tokens_per_block, room for max_batch_size whole sequences of max_seq_len; `reused` counts
    the blocks the executor would have reused (block_reuse.py; the reference recomputes
    them); its runtime memory and
    disaggregated serving groups are not published: the reference has no runtime allocator
    and no second server to count."""

    def __init__(self, model: str, version: str, max_batch_size: int,
                 engine: tb.EngineLimits) -> None:
        p = pb()
        self.families, self.series = [], {}  # the families must outlive their metrics
        groups = (tb.REQUEST_METRICS, tb.KV_CACHE_METRICS, tb.INFLIGHT_BATCHER_METRICS,
                  tb.GENERAL_METRICS, tb.OUTPUT_TOKEN_LEN, tb.INPUT_TOKEN_LEN)
        for group in groups:
            histogram = group in (tb.OUTPUT_TOKEN_LEN, tb.INPUT_TOKEN_LEN)
            family = p.MetricFamily(
                name=group.family, description=f"TRT LLM {group.family} (reference flavor)",
                kind=p.MetricFamily.HISTOGRAM if histogram else p.MetricFamily.GAUGE)
            self.families.append(family)
            for name in group.series:
                labels = {"model": model, "version": version, group.category: name}
                self.series[group.family, name] = family.Metric(
                    labels=labels, **({"buckets": list(tb.TOKEN_LEN_BUCKETS)} if histogram
                                      else {}))
        self._set(tb.REQUEST_METRICS, max=max_batch_size)
        self.tokens_per_block = max(engine.tokens_per_block, 1)
        self.max_blocks = max_batch_size * -(-engine.max_seq_len // self.tokens_per_block)
        self._set(tb.KV_CACHE_METRICS, max=self.max_blocks, free=self.max_blocks, used=0,
                  tokens_per=self.tokens_per_block, reused=0, fraction=0)

    def _set(self, group: tb.MetricGroup, **values: float) -> None:
        for name, value in values.items():
            self.series[group.family, name].set(value)

    def step(self, stats: StepStats) -> None:
        self._set(tb.REQUEST_METRICS, active=stats.active, scheduled=stats.active,
                  context=stats.context_requests, waiting=0)
        self._set(tb.INFLIGHT_BATCHER_METRICS, total_context_tokens=stats.context_tokens,
                  generation_requests=stats.active - stats.context_requests,
                  micro_batch_id=0, paused_requests=0)
        used = sum(-(-held // self.tokens_per_block) for held in stats.held_tokens)
        self._set(tb.KV_CACHE_METRICS, free=self.max_blocks - used, used=used,
                  fraction=used / self.max_blocks if self.max_blocks else 0)
        self._set(tb.GENERAL_METRICS, timestamp=time.time() * 1e6,
                  iteration_counter=stats.iteration)

    def reused(self, blocks: int) -> None:
        """The blocks reused so far."""
        self._set(tb.KV_CACHE_METRICS, reused=blocks)

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        self.series[tb.INPUT_TOKEN_LEN.family, "total_input_tokens"].observe(prompt_tokens)
        self.series[tb.OUTPUT_TOKEN_LEN.family, "total_output_tokens"].observe(output_tokens)


class LlmModel:
    """The tensorrt_llm python model's body over `decoder` (the reference decoder; the
    pipeline benchmark's token generator): the stock backend's request contract, responses,
    stop requests and metrics (ExecutorMetrics)."""

    def __init__(self, args: Mapping[str, str], decoder: Any, *, table_dtype: str,
                 engine: tb.EngineLimits, enable_chunked_context: bool,
                 rows_per_request: int | None, cancel_check_s: float = 0.0,
                 guided: GuidedDecoding | None = None,
                 enable_kv_cache_reuse: bool = False) -> None:
        """`engine`: the limits of the engine's build config; `enable_chunked_context`: the
        backend's parameter, applied as the executor applies it (EngineLimits.chunked);
        `enable_kv_cache_reuse`: the backend's, counted (BlockReuse)."""
        self.name = args["model_name"]
        max_input_len, context_chunk = context_phase(
            engine, enable_chunked_context, decoder.config.max_position_embeddings, self.name)
        self.limits = LlmLimits(hidden_size=decoder.config.hidden_size, table_dtype=table_dtype,
                                max_input_len=max_input_len, max_seq_len=engine.max_seq_len,
                                rows_per_request=rows_per_request)
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        self.metrics = ExecutorMetrics(self.name, args["model_version"], max_batch_size,
                                       engine)
        self.reuse = BlockReuse(self.metrics.tokens_per_block, self.metrics.max_blocks) \
            if enable_kv_cache_reuse else None
        self.llm = ReferenceLlm(decoder, max_batch_size=max_batch_size,
                                on_step=self.metrics.step, on_finish=self.metrics.finished,
                                model_name=self.name, cancel_check_s=cancel_check_s,
                                guided=guided, context_chunk=context_chunk)

    @classmethod
    def load(cls, args: Mapping[str, str], make_decoder: Callable[[Any], Any]) -> LlmModel:
        """The model of Triton's initialize(args): its typed parameters, the engine's build
        config (BUILD_CONFIG_NAME in the version folder), and the decoder
        `make_decoder(parameters)` builds."""
        params = c.ReferenceLlmParameters.from_parameters(model_parameters(args),
                                                          args["model_name"])
        folder = Path(args["model_repository"]) / args["model_version"]
        engine = tb.EngineLimits.of_build_config(read_build_config(folder))
        decoder = make_decoder(params)
        return cls(args, decoder, table_dtype=params.dtype, engine=engine,
                   enable_chunked_context=params.enable_chunked_context,
                   rows_per_request=params.prompt_table_rows_per_request,
                   cancel_check_s=params.cancellation_check_period_ms / 1000,
                   guided=guided_decoding(params, folder, decoder.config.vocab_size),
                   enable_kv_cache_reuse=params.enable_kv_cache_reuse)

    def execute(self, requests: Iterable[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            guarded(self.name, partial(send_error, sender), self._submit, request, sender)

    def _submit(self, request: Any, sender: Any) -> None:
        row = read_row(request, c.LLM_INPUTS)
        if row.get(c.STOP_REQUEST):
            # The stock backend's handleStopRequest: an empty final response.
            self.llm.stop(request.request_id())
            sender.send(flags=pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        check_requested_outputs(request.requested_output_names())
        llm_request = LlmRequest.from_inputs(row, self.limits)
        if self.reuse is not None:
            self.reuse.add(llm_request.input_ids, llm_request.extra_ids)
            self.metrics.reused(self.reuse.reused)
        self.llm.submit(llm_request, partial(_emit, sender),
                        partial(send_error, sender), request_id=request.request_id(),
                        is_cancelled=request.is_cancelled)

    def close(self) -> None:
        self.llm.close()


def context_phase(engine: tb.EngineLimits, enable_chunked_context: bool, positions: int,
                  model: str) -> tuple[int, int | None]:
    """(the longest prompt, the chunk a context runs in; None: one pass) as the executor
    derives them from the engine and enable_chunked_context, which it turns off with a
    warning on an engine without paged context FMHA (EngineLimits.chunked). `positions`: the
    checkpoint's max_position_embeddings, which the build makes the engine's max_seq_len (the
    per-request MRoPE table has that many rows). ConfigError for an engine whose chunks
    would hold no token (EngineLimits.chunking_problem: upstream loads it and never
    schedules a long prompt)."""
    if engine.max_seq_len != positions:
        raise ConfigError(f"{model}: the engine's max_seq_len {engine.max_seq_len} is not the "
                          f"checkpoint's max_position_embeddings {positions}; regenerate the "
                          "repository with `qvl-trt repo`")
    chunked = engine.chunked(enable_chunked_context)
    if enable_chunked_context and not chunked:
        log.warning("%s: %s (the engine was built without use_paged_context_fmha)", model,
                    tb.CHUNKING_DISABLED)
    if chunked and engine.chunking_problem() is not None:
        raise ConfigError(f"{model}: {engine.chunking_problem()}")
    return (engine.max_input_len(enable_chunked_context),
            engine.context_chunk if chunked else None)


def read_build_config(folder: Path) -> dict[str, Any]:
    """The build config `qvl-trt repo` writes beside the reference model's checkpoint."""
    path = folder / BUILD_CONFIG_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); regenerate the repository with "
                          "`qvl-trt repo`") from None


def guided_decoding(params: c.ReferenceLlmParameters, folder: Path,
                    vocab_size: int) -> GuidedDecoding | None:
    """Guided decoding as the stock backend sets it up from the same parameters
    (model_instance_state.cc getGuidedDecodingConfigFromParams): off unless both
    guided_decoding_backend and xgrammar_tokenizer_info_path are set; then the backend must be
    xgrammar and the file must exist (a relative path is the model's version folder's)."""
    backend, path = params.guided_decoding_backend, params.xgrammar_tokenizer_info_path
    if not backend or not path:
        return None
    if backend != BACKEND:
        raise ConfigError("Guided decoding is currently supported with 'xgrammar' backend. "
                          f"Invalid guided_decoding_backend parameter {backend!r} provided.")
    info = folder / path
    if not info.is_file():
        raise ConfigError(f"Xgrammar's tokenizer info path at {info} does not exist.")
    return GuidedDecoding.load(info, vocab_size)


def _emit(sender: Any, tokens: list[int], final: bool) -> None:
    ids = np.array([tokens], np.int32)  # (beam, tokens)
    sender.send(response({c.OUTPUT_IDS: ids,
                          c.SEQUENCE_LENGTH: np.array([len(tokens)], np.int32)}),
                flags=pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

