"""What the step that calls tensorrt_llm (postprocessing, tensorrt_llm_bls) sends it: the
tensors the earlier steps made, with `mrope_rotary_cos_sin` built here, right before the
call, from preprocessing's `mrope_position_ids`.

The stock backend needs the table on every request (text-only ones too), and it is
max_seq_len x head_dim float32: 4 MiB at 8192 x 128, against 24 bytes a prompt token for the
position ids. Built here it crosses one hop (into tensorrt_llm) instead of two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import InputError
from ...mm.rope import MropeTable
from .. import contract as c
from .backend import pb


class LlmInputs:
    def __init__(self, mrope: MropeTable) -> None:
        """`mrope`: the caller's parameters' (`PostprocessingParameters.mrope_table()`)."""
        self.mrope = mrope

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The caller's tensors (name -> pb Tensor with a batch row, absent ones None) ->
        tensorrt_llm's inputs."""
        out = {name: t for name, t in tensors.items()
               if name != c.MROPE_POSITION_IDS and name not in c.TAKEN_BY_CALLER}
        positions, ids = tensors.get(c.MROPE_POSITION_IDS), tensors.get(c.INPUT_IDS)
        if positions is None or ids is None:
            raise InputError("mrope_position_ids and input_ids are required: send the "
                             "preprocessing step's outputs unchanged")
        positions, length = positions.as_numpy(), ids.as_numpy().shape[-1]
        if positions.shape != (1, 3, length):
            raise InputError(f"mrope_position_ids has shape {list(positions.shape)} for "
                             f"{length} input ids; expected [1, 3, {length}]: send the "
                             "preprocessing step's outputs unchanged")
        out[c.MROPE_ROTARY_COS_SIN] = pb().Tensor(c.MROPE_ROTARY_COS_SIN,
                                                  self.mrope(positions[0])[None])
        return out
