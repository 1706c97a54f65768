"""MRoPE for Qwen3-VL: the 3D position ids of a prompt (HF `get_rope_index`) and the per-request
cos/sin table the TensorRT-LLM 1.2 engine takes as `mrope_rotary_cos_sin`.

How TensorRT-LLM 1.2 consumes the table (position_embedding_type rope_m, GPT-NeoX halves):
- Host side (tensorrt_llm/runtime/multimodal_model_runner.py, Qwen2-VL path): the table of a
  request is [max_position_embeddings, rotary_dim/2, 2] float32 flattened, row j holding
  (cos, sin) for every frequency of the token at sequence index j (its T/H/W position ids
  already mixed per frequency slot); rows past the prompt use position 0, i.e. (1, 0).
  `mrope_position_deltas` is HF's rope delta (max position + 1 - prompt length).
- Context phase (cpp/tensorrt_llm/kernels/unfusedAttentionKernels/
  unfusedAttentionKernels_2_template.h, applyBiasRopeUpdateKVCacheV2): a token reads the
  float2 at `mrope_rotary_cos_sin + batch_idx * rotary_embedding_max_positions *
  half_rotary_dim + rotary_position * half_rotary_dim + i` for frequency i, where
  rotary_position is its index in the sequence (past KV length + index in the chunk); the
  delta is not used. x[i] and x[i + half] rotate by that (cos, sin).
- Only the fused (FMHA) context path reads the table, and TensorRT-LLM has it for fp16/bf16
  alone (cpp/tensorrt_llm/common/attentionOp.cpp: "Fall back to unfused MHA because of
  unsupported data type"); the unfused path applies plain RoPE at the 1-D index. So float32
  engines and context_fmha off are refused (qvl_trt.llm.engine): image tokens would sit at
  wrong positions while text-only prompts still look right.
- The table is ignored, and the delta-shifted 1D rope used instead (wrong for image tokens),
  by the v1 kernel that invokeApplyBiasRopeUpdateKVCacheDispatch falls back to when
  max_kv_seq_len > rotary_embedding_max_positions: the table must span the engine's
  max_position_embeddings, which the build sets to max_seq_len.
- Generation phase: the token at sequence index n gets the plain rope at n + delta, the same
  position on the three axes, as HF decodes (cache length + rope delta). Masked MHA
  (cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/
  decoderMaskedMultiheadAttentionTemplate.h): `position_idx = tlength +
  mrope_position_deltas[batch_idx]`; XQA (decoderXQAImpl*.cpp) passes only the deltas to
  invokeQKVPreprocessing, whose v1 kernel then rotates at `token_idx_in_seq +
  mrope_position_deltas[batch_idx]` from the inverse frequencies. The table is not read.

Frequency slot i of head_dim/2 takes its position from axis T, H or W. Qwen3-VL interleaves
them (slot i % 3 for the first 3 * section slots of H and W, T elsewhere); Qwen2-VL used
contiguous blocks. The inverse frequencies are TensorRT-LLM's (float64 power rounded to
float32, RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin); torch's pow in
HF can differ by one float32 ulp in a slot (for theta 5e6 and head_dim 128, slot 19), an
angle difference below 1e-9 per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..checkpoint import TextDims
from ..errors import InputError

AXIS_T, AXIS_H, AXIS_W = 0, 1, 2


@dataclass(frozen=True)
class RopeIndex:
    position_ids: np.ndarray  # [3, seq] int64: T, H, W position of every prompt token
    delta: int  # decode token at sequence index n sits at position n + delta on all axes


def rope_index(input_ids: np.ndarray, image_grid_thw: np.ndarray | Sequence[Sequence[int]], *,
               image_token_id: int, spatial_merge_size: int) -> RopeIndex:
    """HF Qwen3-VL `get_rope_index` for one prompt whose images are runs of `image_token_id`.

    Text tokens take the running position on all axes; an image starting at position s takes
    T = s, H = s + merged row, W = s + merged column, and the text after it continues at
    s + max(h, w) / merge.
    """
    ids = np.asarray(input_ids)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    if ids.ndim != 1 or ids.size == 0:
        raise InputError(f"input_ids must be one non-empty sequence, got shape {ids.shape}")
    edges = np.diff(np.concatenate(([0], (ids == image_token_id).astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if len(starts) != len(grids):
        raise InputError(f"the prompt holds {len(starts)} image token runs but "
                         f"{len(grids)} image grids were given")
    positions = np.empty((3, ids.size), np.int64)
    cursor, text_start = 0, 0
    for start, end, (t, h, w) in zip(starts, ends, grids.tolist(), strict=True):
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        if t != 1 or end - start != rows * cols:
            raise InputError(f"an image run of {end - start} tokens does not match grid "
                             f"{(t, h, w)} ({rows * cols} merged tokens of one frame)")
        positions[:, text_start:start] = cursor + np.arange(start - text_start)
        cursor += start - text_start
        positions[AXIS_T, start:end] = cursor
        positions[AXIS_H, start:end] = cursor + np.repeat(np.arange(rows), cols)
        positions[AXIS_W, start:end] = cursor + np.tile(np.arange(cols), rows)
        cursor += max(h, w) // spatial_merge_size
        text_start = end
    positions[:, text_start:] = cursor + np.arange(ids.size - text_start)
    return RopeIndex(positions, int(positions.max()) + 1 - ids.size)


def mrope_slot_axes(mrope_section: Sequence[int], interleaved: bool) -> np.ndarray:
    """Axis (0=T, 1=H, 2=W) of each of the sum(mrope_section) frequency slots."""
    t, h, w = (int(s) for s in mrope_section)
    if not interleaved:
        return np.repeat(np.arange(3), (t, h, w))
    axes = np.full(t + h + w, AXIS_T)
    axes[AXIS_H:3 * h:3] = AXIS_H
    axes[AXIS_W:3 * w:3] = AXIS_W
    return axes


def rotary_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """[head_dim/2] float32 inverse frequencies, computed as TensorRT-LLM does."""
    return np.float32(1.0) / (theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)


@dataclass(frozen=True)
class MropeTable:
    """What a request's MRoPE table depends on besides its position ids: the text model's
    rotary settings and the engine's positions (max_seq_len). The table is 4 MiB at 8192 x 128
    while the position ids are [3, seq]: the ids cross the pipeline and the step that calls
    the LLM builds the table right before the call (triton/runtime/llm_inputs.py), from these
    settings as its model parameters."""

    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...]  # T, H, W frequency slots
    mrope_interleaved: bool
    max_positions: int

    @classmethod
    def of(cls, text: TextDims, max_positions: int) -> MropeTable:
        return cls(text.head_dim, text.rope_theta, tuple(text.mrope_section),
                   text.mrope_interleaved, max_positions)

    def __call__(self, position_ids: np.ndarray) -> np.ndarray:
        """The request's `mrope_rotary_cos_sin`: [max_positions * head_dim] float32, row j =
        (cos, sin) per frequency for the token at sequence index j, (1, 0) past the prompt."""
        seq = position_ids.shape[1]
        if seq > self.max_positions:
            raise InputError(f"prompt has {seq} tokens but the MRoPE table holds "
                             f"{self.max_positions} positions (the engine's max_seq_len); "
                             "shorten the prompt")
        axes = mrope_slot_axes(self.mrope_section, self.mrope_interleaved)
        angles = position_ids[axes].T.astype(np.float32) * rotary_inv_freq(self.head_dim,
                                                                            self.rope_theta)
        table = np.empty((self.max_positions, self.head_dim // 2, 2), np.float32)
        table[:seq, :, 0] = np.cos(angles)
        table[:seq, :, 1] = np.sin(angles)
        table[seq:].view(np.complex64)[...] = 1  # (cos, sin) = (1, 0) in one 8-byte store
        return table.reshape(-1)


def mrope_cos_sin_table(position_ids: np.ndarray, text: TextDims, max_positions: int) \
        -> np.ndarray:
    """`MropeTable.of(text, max_positions)(position_ids)`."""
    return MropeTable.of(text, max_positions)(position_ids)
