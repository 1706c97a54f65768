"""The postprocessing step: runs one request through tensorrt_llm and turns its token
responses into text.

It receives every tensorrt_llm input the earlier steps made and forwards them as a BLS
request (decoupled: tokens arrive as the engine makes them), the MRoPE table built from the
position ids first (llm_inputs.py). Each request is handled in its
own worker thread with its own `StreamDecoder`, so a character whose bytes are split across
streamed responses comes out whole and concurrent requests share nothing. When tensorrt_llm
signals the end, an unfinished character is flushed and the final response sent.

`Postprocessor.generate` is that loop; the client-facing tensorrt_llm_bls model (bls.py) runs
it too. It stops tensorrt_llm whenever it leaves before the end (an error response, an
exception, its own request cancelled, the model unloading): the stock backend keeps
generating a request nobody reads until it is cancelled.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...mm.detokenizer import StreamDecoder, TokenBytes
from .. import contract as c
from .backend import error_response, guarded, pb, response, row_of
from .llm_inputs import LlmInputs

log = logging.getLogger(__name__)

# The stock backend refuses a request that does not ask for both (fillTritonResponse:
# "... tensor must be present in list of output tensors").
LLM_REQUESTED_OUTPUTS = (c.OUTPUT_IDS, c.SEQUENCE_LENGTH)
UNLOADING = "the model is unloading; send the request again once the server is back"

# run(request, sender): handle one request, sending its responses (the last one final).
Run = Callable[[Any, Any], None]


class Postprocessor:
    def __init__(self, tokenizer_json: Path, *, llm_inputs: LlmInputs, llm_model: str,
                 workers: int, model_name: str = c.POSTPROCESSING) -> None:
        """`model_name`: the model it serves (postprocessing, or tensorrt_llm_bls), for errors;
        `llm_inputs` turns the earlier steps' tensors into tensorrt_llm's."""
        self.token_bytes = TokenBytes.from_tokenizer_json(tokenizer_json)
        self.llm_inputs = llm_inputs
        self.llm_model = llm_model
        self.model_name = model_name
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="postprocess")
        self._closing = threading.Event()

    def submit(self, request: Any, run: Run | None = None) -> None:
        """Handle a (decoupled) request in a worker with `run` (default: postprocessing's
        own); execute() returns at once."""
        sender = request.get_response_sender()
        self.pool.submit(self._guarded, run or self._run, request, sender)

    def close(self) -> None:
        """At unload: running requests stop tensorrt_llm at their next response, queued ones
        get a final error response (a decoupled request without one hangs its client)."""
        self._closing.set()
        self.pool.shutdown(wait=True)

    def _guarded(self, run: Run, request: Any, sender: Any) -> None:
        final = pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if self._closing.is_set():
            sender.send(error_response(UNLOADING), flags=final)
            return
        guarded(self.model_name, lambda message: sender.send(error_response(message),
                                                             flags=final), run, request, sender)

    def _run(self, request: Any, sender: Any) -> None:
        tensors = {s.name: pb().get_input_tensor_by_name(request, s.name)
                   for s in c.POSTPROCESSING_INPUTS}
        self.generate(self.llm_inputs(tensors), sender, request.is_cancelled)

    def generate(self, tensors: Mapping[str, Any], sender: Any,
                 is_cancelled: Callable[[], bool]) -> None:
        """Run tensorrt_llm on `tensors` (its inputs by name as `llm_inputs` makes them, absent
        optional ones None) and send the text to `sender`, the last response final.
        `is_cancelled` (the client's request) is asked between responses; a cancelled request
        gets an empty final response and tensorrt_llm is stopped."""
        final = pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        row = row_of(tensors, c.POSTPROCESSING_INPUTS)
        streaming = bool(row[c.STREAMING])
        end_id = int(row[c.END_ID])
        counts = {c.PROMPT_TOKENS: np.array([row[c.INPUT_LENGTHS]], np.int32)}
        # The id lets a stop request name this request (see _stop).
        request_id = uuid.uuid4().hex
        llm_request = pb().InferenceRequest(
            model_name=self.llm_model, request_id=request_id,
            inputs=[t for t in tensors.values() if t is not None],
            requested_output_names=list(LLM_REQUESTED_OUTPUTS))
        stream = StreamDecoder(self.token_bytes)
        text = ""
        responses = llm_request.exec(decoupled=True)
        finished = False
        try:
            for llm_response in responses:
                if llm_response.has_error():
                    sender.send(error_response(f"{self.llm_model}: "
                                               f"{llm_response.error().message()}"),
                                flags=final)
                    return
                if self._closing.is_set():
                    sender.send(error_response(UNLOADING), flags=final)
                    return
                if is_cancelled():
                    sender.send(flags=final)  # nobody reads it: only the stream's end
                    return
                ids = _new_tokens(llm_response, end_id)
                if ids is None:
                    continue  # the empty response that closes a decoupled stream
                text += stream.push(ids)
                if streaming and text:
                    sender.send(self._chunk(text, stream, counts))
                    text = ""
            finished = True
        finally:
            if not finished:
                self._stop(responses, request_id)
        text += stream.push([], final=True)
        sender.send(self._chunk(text, stream, counts), flags=final)

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
    def _chunk(text: str, stream: StreamDecoder, counts: dict[str, np.ndarray]) -> Any:
        return response({c.TEXT_OUTPUT: text, **counts,
                         c.COMPLETION_TOKENS: np.array([stream.tokens], np.int32)})


def _stop_request_inputs() -> list[Any]:
    one = np.ones((1, 1), np.int32)
    values = {c.INPUT_IDS: one, c.INPUT_LENGTHS: one, c.REQUEST_OUTPUT_LEN: one,
              c.STOP_REQUEST: np.ones((1, 1), bool)}
    return [pb().Tensor(name, value) for name, value in values.items()]


def _new_tokens(llm_response: Any, end_id: int) -> list[int] | None:
    """Beam 0's tokens of one tensorrt_llm response (the end token, if present, cut off), or
    None for a response without output_ids."""
    tensor = pb().get_output_tensor_by_name(llm_response, c.OUTPUT_IDS)
    if tensor is None:
        return None
    beams = tensor.as_numpy()
    ids = [int(t) for t in beams[(0,) * (beams.ndim - 1)]]
    return ids[: ids.index(end_id)] if end_id in ids else ids
