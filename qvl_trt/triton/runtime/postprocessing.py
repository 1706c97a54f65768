"""The postprocessing step: runs one request through tensorrt_llm and turns its token
responses into text.

It receives every tensorrt_llm input the earlier steps made and forwards them as a BLS
request (decoupled: tokens arrive as the engine makes them), the MRoPE table built from the
position ids first (llm_inputs.py). That request always streams, also for a client that asked
for one response: the stock backend answers `streaming=false` once, at the end, and only
between tokens can the loop see that its client went away. A non-streamed answer gathers the
tokens and goes out in one final response. Each request is read in its own
worker thread with its own `StreamDecoder`, so a character whose bytes are split across
streamed responses comes out whole and concurrent requests share nothing. Streamed text is
sent by the instance's sender thread through each request's `Outbox`: tokens that arrive
while a response is on its way ride in the next one, so when sending falls behind the
engine, responses grow instead of a backlog. When tensorrt_llm signals the end, an
unfinished character is flushed and the final response sent.

`TokenStream` is that loop; the client-facing tensorrt_llm_bls model (tensorrt_llm_bls.py)
runs one too, with its own pool and its own way to its inputs. It stops tensorrt_llm
whenever it leaves before the end (an error response, an exception, its own request
cancelled, the model unloading): the stock backend keeps generating a request nobody reads
until it is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BusyError, StepError, UnavailableError
from ...llm.sampling import FinishReason
from ...mm.detokenizer import StreamDecoder, TokenBytes
from .. import contract as c
from .admission import Admission, Ticket
from .backend import error_message, guarded, pb, response, row_of, send_error
from .llm_inputs import LlmInputs

log = logging.getLogger(__name__)

# The stock backend refuses a request that does not ask for both (fillTritonResponse:
# "... tensor must be present in list of output tensors").
LLM_REQUESTED_OUTPUTS = (c.OUTPUT_IDS, c.SEQUENCE_LENGTH)
# How often a request, streaming or not, asks whether its client cancelled: each ask is a
# round trip to Triton (python_backend pb_cancel.cc), which, asked once a token, cost about 7
# of the 44 context switches per token at 16 streams (scripts/bench_pipeline_overhead.py). The
# stock backend polls its own requests every cancellation_check_period_ms (100 in our configs).
CANCEL_CHECK_S = 0.05
# Threads per instance sending streamed responses, each send a round trip to Triton. One
# serves every request in turn and woke the fewest threads per token (9 context switches per
# token in the stub against 12-16 with 2-16 senders, at 16 streams); instances add more.
SENDERS = 1
TRUE = np.ones((1, 1), bool)  # a BOOL input of one batch row
# Why a request was refused (the label `reason` of qvl_llm_requests_refused_total).
QUEUE_FULL, QUEUE_WAIT, PROBE_IN_FLIGHT = "queue_full", "queue_wait", "probe_in_flight"
# Seconds a request waited for a batch slot: from none to several long answers on a CPU.
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 20, 30,
                      45, 60, 90, 120, 180, 300, 450, 600, 900)

# inputs(request): the earlier steps' tensors of one request (name -> pb Tensor with a batch
# row, absent optional ones None), which LlmInputs turns into tensorrt_llm's.
StepInputs = Callable[[Any], Mapping[str, Any]]


def postprocessing_inputs(request: Any) -> dict[str, Any]:
    """The postprocessing model's: its own inputs, which the ensemble's earlier steps made."""
    return {s.name: pb().get_input_tensor_by_name(request, s.name)
            for s in c.POSTPROCESSING_INPUTS}


class TokenStream:
    """The token path of a model that runs tensorrt_llm (postprocessing, tensorrt_llm_bls):
    each request in a worker of the model's own pool, its earlier steps' tensors from
    `inputs`, then tensorrt_llm by BLS, its tokens sent back as text (`generate`)."""

    def __init__(self, tokenizer_json: Path, *, inputs: StepInputs, llm_inputs: LlmInputs,
                 llm_model: str, workers: int, admission: Admission,
                 model_name: str = c.POSTPROCESSING, instance_name: str = "") -> None:
        """`model_name`, `instance_name`: the model and instance it serves, for errors and
        metrics; `llm_inputs` turns the earlier steps' tensors into tensorrt_llm's;
        `admission`: tensorrt_llm's batch slots and queue (`workers` holds each request it
        admits)."""
        self.token_bytes = TokenBytes.from_tokenizer_json(tokenizer_json)
        self.inputs = inputs
        self.llm_inputs = llm_inputs
        self.llm_model = llm_model
        self.model_name = model_name
        self.admission = admission
        self.metrics = QueueMetrics(model_name, instance_name)
        admission.on_change = partial(self.metrics.report, admission)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="postprocess")
        # Streamed responses are sent from here while each request's worker reads on.
        self.senders = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="send")
        self._closing = threading.Event()

    def submit(self, request: Any) -> None:
        """Admit a (decoupled) request to one of the build's places and handle it in a worker,
        or refuse it at once (a BusyError: every place is taken); execute() returns at once."""
        sender = request.get_response_sender()
        probe = _is_probe(request)
        try:
            ticket = self.admission.enter(probe=probe)
        except UnavailableError as exc:  # BusyError included
            if isinstance(exc, BusyError):
                self.metrics.refused(PROBE_IN_FLIGHT if probe else QUEUE_FULL)
            send_error(sender, error_message(exc, self.model_name))
            return
        self.pool.submit(self._guarded, request, sender, ticket)

    def close(self) -> None:
        """At unload: running requests stop tensorrt_llm at their next response, waiting and
        queued ones get a final error response (a decoupled request without one hangs its
        client)."""
        self._closing.set()
        self.admission.close()
        self.pool.shutdown(wait=True)
        self.senders.shutdown(wait=True)  # idle by now: a request waits for its sends

    def _guarded(self, request: Any, sender: Any, ticket: Ticket) -> None:
        try:
            guarded(self.model_name, partial(send_error, sender),
                    _refuse if self._closing.is_set() else self._run, request, sender, ticket)
        finally:
            self.admission.leave(ticket)

    def _run(self, request: Any, sender: Any, ticket: Ticket) -> None:
        inputs = self.inputs(request)
        media = inputs.get(c.MEDIA_TOKENS)  # the caller's own (c.TAKEN_BY_CALLER)
        tensors = self.llm_inputs(inputs)
        try:
            admitted = self.admission.wait(ticket, request.is_cancelled)
        except BusyError:
            self.metrics.refused(QUEUE_WAIT)
            raise
        if not admitted:  # the client went away while it waited
            sender.send(flags=pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if not ticket.probe:
            self.metrics.waited(ticket.waited_s)
        self.generate(tensors, sender, request.is_cancelled,
                      None if media is None else media.as_numpy().reshape(-1))

    def generate(self, tensors: Mapping[str, Any], sender: Any,
                 is_cancelled: Callable[[], bool],
                 media_tokens: Sequence[int] | None = None) -> None:
        """Run tensorrt_llm on `tensors` (its inputs by name as `llm_inputs` makes them, absent
        optional ones None) and send the text to `sender`, the last response final; `streaming`
        among them is the client's choice, tensorrt_llm is always asked to stream. Streamed
        text goes through an `Outbox`: tokens that arrive while a response is being sent ride
        in the next one; a non-streamed answer is one final response. `is_cancelled` (the
        client's request) is asked as tokens arrive, at most every CANCEL_CHECK_S (streaming:
        before a response is sent); a cancelled request gets an empty final response and
        tensorrt_llm is stopped. `media_tokens`: the prompt's (image, video) tokens, which
        every response carries (None: a repository without them, whose responses do not)."""
        final = pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        row = row_of(tensors, c.POSTPROCESSING_INPUTS)
        streaming = bool(row[c.STREAMING])
        end_id = int(row[c.END_ID])
        counts = {c.PROMPT_TOKENS: np.array([row[c.INPUT_LENGTHS]], np.int32)}
        if media_tokens is not None:
            counts |= {c.IMAGE_TOKENS: np.array(media_tokens[:1], np.int32),
                       c.VIDEO_TOKENS: np.array(media_tokens[1:2], np.int32)}
        tail = StopTail(c.word_list_sequences(row[c.STOP_WORDS_LIST]),
                        int(row[c.REQUEST_OUTPUT_LEN]))
        # The id lets a stop request name this request (see _stop).
        request_id = uuid.uuid4().hex
        # Streaming also for a non-streamed answer: with streaming=false the backend sends its
        # executor's one result at the end (model_instance_state.cc WaitForResponse), and the
        # loop would read a cancel only then, the engine busy to max_tokens meanwhile.
        llm_request = pb().InferenceRequest(
            model_name=self.llm_model, request_id=request_id,
            inputs=[t for t in {**tensors, c.STREAMING: pb().Tensor(c.STREAMING, TRUE)}.values()
                    if t is not None],
            requested_output_names=list(LLM_REQUESTED_OUTPUTS))
        stream = StreamDecoder(self.token_bytes)
        cancelled = _polled(is_cancelled)
        outbox = Outbox(self._streamer(stream, tail, sender, counts, cancelled) if streaming
                        else None, self.senders)
        responses = llm_request.exec(decoupled=True)
        finished = False
        try:
            finished = self._read(responses, outbox, end_id,
                                  (lambda: outbox.stopped) if streaming else cancelled)
        finally:
            rest = outbox.close()  # no response may follow the final one
            if not finished:
                self._stop(responses, request_id)
        if outbox.error is not None:
            raise outbox.error
        if not finished:
            sender.send(flags=final)  # cancelled: nobody reads it, only the stream's end
        else:
            text = stream.push(tail.finish(rest), final=True)
            sender.send(self._chunk(text, tail, counts, tail.finish_reason()), flags=final)

    def _read(self, responses: Any, outbox: Outbox, end_id: int,
              cancelled: Callable[[], bool]) -> bool:
        """Put tensorrt_llm's tokens into `outbox` until its stream ends (True), or the client
        cancelled (False). Raises tensorrt_llm's error (relayed with its kind, the stock
        backend's unmarked text as the request's), or an UnavailableError while unloading."""
        for llm_response in responses:
            if llm_response.has_error():
                raise StepError(c.ErrorKind.relay(llm_response.error().message(),
                                                  self.llm_model))
            if self._closing.is_set():
                raise _unloading()
            if cancelled():
                return False
            if outbox.error is not None:
                raise outbox.error
            ids = _new_tokens(llm_response, end_id)
            if ids is not None:  # None: the empty response that closes a decoupled stream
                outbox.put(ids)
        return True

    def _streamer(self, stream: StreamDecoder, tail: StopTail, sender: Any,
                  counts: dict[str, np.ndarray],
                  cancelled: Callable[[], bool]) -> Callable[[list[int]], bool]:
        """The outbox's `send` of a streaming request: one response with the text of the
        tokens read since the last; False once `cancelled()` (the client's, `_polled`)."""

        def send(ids: list[int]) -> bool:
            if cancelled():
                return False
            text = stream.push(tail.push(ids))
            if text:
                sender.send(self._chunk(text, tail, counts))
            return True

        return send

    def _stop(self, responses: Any, request_id: str) -> None:
        """Stop tensorrt_llm's generation of a request we leave early, then read the stream
        to its end (the backend answers a cancelled request with a final response)."""
        try:
            cancel = getattr(responses, "cancel", None)
            if cancel is not None:
                # ResponseIterator.cancel(): python_backend r25.04 and later (PR #398).
                cancel()
            else:
                # Triton 2.51 (python_backend r24.10) has no cancel(): the stock backend's stop
                # request, `stop=true` with the request's id (model_instance_state.cc
                # handleStopRequest), answered by one empty final response. Triton still
                # checks the required inputs, hence the placeholder ones.
                stop = pb().InferenceRequest(
                    model_name=self.llm_model, request_id=request_id,
                    inputs=_stop_request_inputs(),
                    requested_output_names=list(LLM_REQUESTED_OUTPUTS))
                for _ in stop.exec(decoupled=True):
                    pass
            for _ in responses:
                pass
        except Exception:  # the client already has its answer; keep serving
            log.exception("could not stop %s request %s", self.llm_model, request_id)

    @staticmethod
    def _chunk(text: str, tail: StopTail, counts: dict[str, np.ndarray],
               finish_reason: str = "") -> Any:
        return response({c.TEXT_OUTPUT: text, **counts,
                         c.COMPLETION_TOKENS: np.array([tail.generated], np.int32),
                         c.FINISH_REASON: finish_reason})


class QueueMetrics:
    """One instance's share of its build's admission (runtime/admission.py), as metrics
    labelled by model and instance (each instance is a process of its own; summed they are
    the build's): requests waiting for a batch slot, requests holding one, how long each
    waited, and the refused ones by reason. Thread-safe (every worker updates them)."""

    def __init__(self, model: str, instance: str) -> None:
        p = pb()
        labels = {"model": model, "instance": instance}
        # The families must outlive their metrics: keep both.
        self.families = [
            p.MetricFamily(name=c.LLM_REQUESTS_WAITING, kind=p.MetricFamily.GAUGE,
                           description="requests waiting for a batch slot of tensorrt_llm"),
            p.MetricFamily(name=c.LLM_REQUESTS_RUNNING, kind=p.MetricFamily.GAUGE,
                           description="requests holding a batch slot of tensorrt_llm"),
            p.MetricFamily(name=c.LLM_QUEUE_WAIT, kind=p.MetricFamily.HISTOGRAM,
                           description="how long a request waited for a batch slot"),
            p.MetricFamily(name=c.LLM_REQUESTS_REFUSED, kind=p.MetricFamily.COUNTER,
                           description="requests refused as busy: queue_full (every slot and "
                           "queue place taken), queue_wait (no slot within max_queue_wait), "
                           "probe_in_flight"),
        ]
        waiting, running, wait, refused = self.families
        self._waiting = waiting.Metric(labels=labels)
        self._running = running.Metric(labels=labels)
        self._wait = wait.Metric(labels=labels, buckets=list(QUEUE_WAIT_BUCKETS))
        self._refused = {reason: refused.Metric(labels={**labels, "reason": reason})
                         for reason in (QUEUE_FULL, QUEUE_WAIT, PROBE_IN_FLIGHT)}
        # One update at a time: a python-backend Metric is not thread-safe. Each set,
        # increment or observe rewrites the metric's record in shared memory and hands its
        # handle to the parent (python_backend src/metric.cc SaveToSharedMemory), so two
        # threads updating at once hand over a record already freed: tritonserver 2.51
        # crashed with SIGSEGV in libtriton_python.so under 60 concurrent requests.
        self._lock = threading.Lock()

    def report(self, admission: Admission) -> None:
        with self._lock:
            self._waiting.set(admission.waiting)
            self._running.set(admission.running)

    def waited(self, seconds: float) -> None:
        with self._lock:
            self._wait.observe(seconds)

    def refused(self, reason: str) -> None:
        with self._lock:
            self._refused[reason].increment(1)


class StopTail:
    """The end of one request's tokens. The engine ends an answer with a stop word (a stop
    string's tokens, or an end id besides end_id) and keeps it; OpenAI leaves the stop string
    out, so it is cut here, where the stop words are known, for every client alike. While
    streaming, the last tokens that could still begin a stop word are held back until more
    tokens show they do not, or the answer ends. Also the finish reason."""

    def __init__(self, stop_words: Sequence[Sequence[int]], max_tokens: int) -> None:
        """`stop_words`: the request's (contract.word_list_sequences of stop_words_list);
        `max_tokens`: its request_output_len."""
        self.words = tuple(tuple(w) for w in stop_words)
        self.prefixes = frozenset(w[:n] for w in self.words for n in range(1, len(w) + 1))
        self.longest = max(map(len, self.words), default=0)
        self.max_tokens = max_tokens
        self.generated = 0  # tokens the engine made, a final stop word's included
        self.stopped = False  # a stop word ended the answer
        self._held: list[int] = []

    def push(self, ids: Sequence[int]) -> list[int]:
        """The tokens that can be sent now."""
        self.generated += len(ids)
        held = self._held + list(ids)
        keep = next((n for n in range(min(len(held), self.longest), 0, -1)
                     if tuple(held[-n:]) in self.prefixes), 0)
        self._held = held[len(held) - keep:]
        return held[: len(held) - keep]

    def finish(self, ids: Sequence[int]) -> list[int]:
        """The last tokens: the ones held back and `ids`, without a final stop word."""
        rest = self.push(ids) + self._held
        self._held = []
        for word in self.words:
            if tuple(rest[-len(word):]) == word:
                self.stopped = True
                return rest[: -len(word)]
        return rest

    def finish_reason(self) -> str:
        """"stop": a stop word, or the end token (which the engine does not count, so
        fewer tokens than allowed); "length": every allowed token was generated."""
        stop = self.stopped or self.generated < self.max_tokens
        return (FinishReason.STOP if stop else FinishReason.LENGTH).value


class Outbox:
    """One request's tokens on their way to its client. Streaming, tokens read from
    tensorrt_llm wait here while a response is being sent, and the next response carries all
    of them: a client (or a server) slower than the engine gets fewer, larger responses
    instead of a growing backlog, and a token costs one read rather than one send (measured
    by scripts/bench_pipeline_overhead.py). At most one `send` runs at a time, on `pool`;
    `close` waits for it, so nothing is sent after the final response."""

    def __init__(self, send: Callable[[list[int]], bool] | None, pool: Executor) -> None:
        """`send(ids)`: send one response for `ids`, False if the client has cancelled (the
        outbox then stops sending); None: hold every token for the final response."""
        self._send = send
        self._pool = pool
        self._lock = threading.Condition()
        self._ids: list[int] = []
        self._busy = False  # a drain is scheduled or running
        self._closed = False
        self.stopped = False  # a send answered False
        self.error: Exception | None = None  # a send raised it

    def put(self, ids: list[int]) -> None:
        with self._lock:
            self._ids += ids
            if self._busy or self._closed or self._send is None:
                return
            self._busy = True
        self._schedule()

    def close(self) -> list[int]:
        """No more sends: wait for the one in flight, then hand over the tokens not sent."""
        with self._lock:
            self._closed = True
            while self._busy:
                self._lock.wait()
            ids, self._ids = self._ids, []
        return ids

    def _drain(self) -> None:
        """One response with every token waiting, then back in the pool's queue if more
        came meanwhile: a few sender threads serve every request in turn."""
        with self._lock:  # once closing, the tokens are the final response's
            ids, self._ids = ([], self._ids) if self._closed else (self._ids, [])
        try:
            if ids and not self._send(ids):
                self.stopped = True
        except Exception as exc:  # the request's worker raises it
            self.error = exc
        with self._lock:
            if self._ids and not (self._closed or self.stopped or self.error):
                self._schedule()
                return
            self._busy = False
            self._lock.notify_all()

    def _schedule(self) -> None:
        """Queue a drain (`_busy` is set). A pool already shut down refuses it: then nothing
        is in flight and the tokens wait for close()."""
        try:
            self._pool.submit(self._drain)
        except RuntimeError:
            with self._lock:  # reentrant: _drain holds it
                self._busy = False
                self._lock.notify_all()


def _unloading() -> UnavailableError:
    return UnavailableError("the model is unloading; send the request again once the server "
                            "is back")


def _refuse(request: Any, sender: Any, ticket: Ticket) -> None:
    """The run of a request that arrives while the model unloads."""
    raise _unloading()


def _is_probe(request: Any) -> bool:
    """The request's health_probe flag (contract.HEALTH_PROBE; preprocessing checks that it is
    a probe's one-token text request)."""
    flag = pb().get_input_tensor_by_name(request, c.HEALTH_PROBE)
    return flag is not None and bool(flag.as_numpy().reshape(-1)[0])


def _polled(is_cancelled: Callable[[], bool]) -> Callable[[], bool]:
    """`is_cancelled`, asked at most every CANCEL_CHECK_S (the answer in between: the last
    one); once true, true (a cancel is never taken back)."""
    next_check, cancelled = 0.0, False

    def check() -> bool:
        nonlocal next_check, cancelled
        now = time.monotonic()
        if not cancelled and now >= next_check:
            cancelled = is_cancelled()
            next_check = now + CANCEL_CHECK_S
        return cancelled

    return check


def _stop_request_inputs() -> list[Any]:
    one = np.ones((1, 1), np.int32)
    values = {c.INPUT_IDS: one, c.INPUT_LENGTHS: one, c.REQUEST_OUTPUT_LEN: one,
              c.STOP_REQUEST: TRUE}
    return [pb().Tensor(name, value) for name, value in values.items()]


def _new_tokens(llm_response: Any, end_id: int) -> list[int] | None:
    """Beam 0's tokens of one tensorrt_llm response (the end token, if present, cut off), or
    None for a response without output_ids."""
    tensor = pb().get_output_tensor_by_name(llm_response, c.OUTPUT_IDS)
    if tensor is None:
        return None
    beams = tensor.as_numpy()
    ids = beams[(0,) * (beams.ndim - 1)].tolist()
    return ids[: ids.index(end_id)] if end_id in ids else ids
