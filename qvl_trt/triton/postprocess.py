"""The postprocessing step: runs one request through tensorrt_llm and turns its token
responses into text.

It receives every tensorrt_llm input the earlier steps made and forwards them as a BLS
request (decoupled: tokens arrive as the engine makes them). Each request is handled in its
own worker thread with its own `StreamDecoder`, so a character whose bytes are split across
streamed responses comes out whole and concurrent requests share nothing. When tensorrt_llm
signals the end, an unfinished character is flushed and the final response sent.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import QvlError
from . import contract as c
from .detokenizer import StreamDecoder, TokenBytes
from .pb_io import error_response, pb, read_row, response

log = logging.getLogger(__name__)


class Postprocessor:
    def __init__(self, tokenizer_json: Path, *, llm_model: str, workers: int) -> None:
        self.token_bytes = TokenBytes.from_tokenizer_json(tokenizer_json)
        self.llm_model = llm_model
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="postprocess")

    def submit(self, request: Any) -> None:
        """Handle a (decoupled) request in a worker; execute() returns at once."""
        sender = request.get_response_sender()
        self.pool.submit(self._run, request, sender)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, request: Any, sender: Any) -> None:
        final = pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            row = read_row(request, c.POSTPROCESSING_INPUTS)
            streaming = bool(row[c.STREAMING])
            end_id = int(row[c.END_ID])
            counts = {c.PROMPT_TOKENS: np.array([row[c.INPUT_LENGTHS]], np.int32)}
            inputs = [pb().get_input_tensor_by_name(request, s.name)
                      for s in c.POSTPROCESSING_INPUTS]
            llm_request = pb().InferenceRequest(
                model_name=self.llm_model, inputs=[t for t in inputs if t is not None],
                requested_output_names=[c.OUTPUT_IDS])
            stream = StreamDecoder(self.token_bytes)
            text = ""
            for llm_response in llm_request.exec(decoupled=True):
                if llm_response.has_error():
                    sender.send(error_response(f"{self.llm_model}: "
                                               f"{llm_response.error().message()}"),
                                flags=final)
                    return
                ids = _new_tokens(llm_response, end_id)
                if ids is None:
                    continue  # the empty response that closes a decoupled stream
                text += stream.push(ids)
                if streaming and text:
                    sender.send(self._chunk(text, stream, counts))
                    text = ""
            text += stream.push([], final=True)
            sender.send(self._chunk(text, stream, counts), flags=final)
        except Exception as exc:  # QvlError is the client's; anything else a bug, logged
            if not isinstance(exc, QvlError):
                log.exception("postprocessing failed")
            sender.send(error_response(str(exc)), flags=final)

    @staticmethod
    def _chunk(text: str, stream: StreamDecoder, counts: dict[str, np.ndarray]) -> Any:
        return response({c.TEXT_OUTPUT: text, **counts,
                         c.COMPLETION_TOKENS: np.array([stream.tokens], np.int32)})


def _new_tokens(llm_response: Any, end_id: int) -> list[int] | None:
    """Beam 0's tokens of one tensorrt_llm response (the end token, if present, cut off), or
    None for a response without output_ids."""
    tensor = pb().get_output_tensor_by_name(llm_response, c.OUTPUT_IDS)
    if tensor is None:
        return None
    beams = tensor.as_numpy()
    ids = [int(t) for t in beams[(0,) * (beams.ndim - 1)]]
    return ids[: ids.index(end_id)] if end_id in ids else ids
