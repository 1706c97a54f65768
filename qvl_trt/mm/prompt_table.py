"""The prompt-table layout that carries DeepStack through the stock TensorRT-LLM runtime.

The runtime only accepts prompt-table rows of width hidden_size, so visual token i (counted
over the whole request) owns 1+K consecutive rows: row (1+K)i is its main embedding and row
(1+K)i+1+k its DeepStack feature k. In the engine's input_ids the token carries the fake id
vocab_size + (1+K)i, which the prompt-tuning lookup maps to row (1+K)i; the model reads the
K rows after it for DeepStack.

KV-cache reuse keys blocks on (token id, extra id): fake ids repeat across requests, so each
visual token also carries its image's 64-bit content hash as `prompt_table_extra_ids`
(0 for text tokens). A request's cache scope (contract.CACHE_SCOPE, a tenant's) is folded into
every extra id, text tokens' too, and into the image hashes the vision cache keys on
(`scope_ids`): requests of two scopes then share no KV block and no cached image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import InputError


def rows_per_visual_token(deepstack_count: int) -> int:
    return 1 + deepstack_count


def fake_token_ids(input_ids: np.ndarray, *, image_token_id: int, vocab_size: int,
                   deepstack_count: int) -> np.ndarray:
    """input_ids with the i-th image token replaced by vocab_size + (1+K)i (int32)."""
    ids = np.array(input_ids, dtype=np.int32)
    visual = ids == image_token_id
    ids[visual] = vocab_size + rows_per_visual_token(deepstack_count) * np.arange(
        np.count_nonzero(visual), dtype=np.int32)
    return ids


def visual_token_positions(engine_ids: np.ndarray, *, vocab_size: int, deepstack_count: int) \
        -> tuple[np.ndarray, np.ndarray]:
    """Inverse of fake_token_ids: (sequence positions of visual tokens, their visual index)."""
    ids = np.asarray(engine_ids)
    positions = np.flatnonzero(ids >= vocab_size)
    offsets = ids[positions].astype(np.int64) - vocab_size
    per_token = rows_per_visual_token(deepstack_count)
    if np.any(offsets % per_token):
        raise InputError(f"fake ids {ids[positions][offsets % per_token != 0][:4].tolist()} are "
                         f"not vocab_size + {per_token} * i; the ids were not made by "
                         "fake_token_ids with this DeepStack count")
    return positions, offsets // per_token


def assemble_prompt_table(image_embeds: np.ndarray, deepstack: Sequence[np.ndarray],
                          dtype: np.dtype | None = None) -> np.ndarray:
    """[(1+K)V, hidden] from the vision outputs: main embeddings [V, hidden] and K DeepStack
    features [V, hidden] (all images of the request concatenated, in prompt order), in `dtype`
    (default: the embeddings'), written in one pass."""
    for k, feature in enumerate(deepstack):
        if feature.shape != image_embeds.shape:
            raise InputError(f"deepstack feature {k} has shape {list(feature.shape)}, the main "
                             f"embeddings {list(image_embeds.shape)}; they must match")
    rows, hidden = image_embeds.shape
    table = np.empty((rows, 1 + len(deepstack), hidden), dtype or image_embeds.dtype)
    for k, feature in enumerate([image_embeds, *deepstack]):
        table[:, k] = feature
    return table.reshape(-1, hidden)


def split_prompt_table(table, deepstack_count: int):
    """Inverse of assemble_prompt_table: (main [V, hidden], tuple of K DeepStack [V, hidden]).
    Only reshapes and slices, so a torch tensor works as well as a numpy array."""
    per_token = rows_per_visual_token(deepstack_count)
    if table.shape[0] % per_token:
        raise InputError(f"a prompt table of {table.shape[0]} rows is not {per_token} rows per "
                         "visual token")
    grouped = table.reshape(table.shape[0] // per_token, per_token, table.shape[-1])
    return grouped[:, 0], tuple(grouped[:, 1 + k] for k in range(deepstack_count))


def scope_ids(ids: np.ndarray, scope: str) -> np.ndarray:
    """uint64 ids (image hashes, extra ids) within a cache scope: as they are in the shared
    scope (""), else each replaced by 8 bytes of a keyed BLAKE2b of it, so no id of one scope
    equals an id of another (short of a 64-bit collision) and none is 0. One hash per
    distinct id: a prompt has few (0 for its text, one per image)."""
    ids = np.asarray(ids, np.uint64)
    if not scope:
        return ids
    key = hashlib.blake2b(scope.encode(), digest_size=32, person=b"qvl-cache-scope").digest()
    distinct, inverse = np.unique(ids, return_inverse=True)
    scoped = np.array([int.from_bytes(hashlib.blake2b(
        int(v).to_bytes(8, "little"), digest_size=8, key=key).digest(), "little") or 1
        for v in distinct], np.uint64)
    return scoped[inverse.reshape(ids.shape)]


def prompt_table_extra_ids(input_ids: np.ndarray, *, image_token_id: int,
                           image_hashes: Sequence[int], image_token_counts: Sequence[int],
                           scope: str = "") -> np.ndarray:
    """uint64 per token: the image's hash on its visual tokens, 0 on text tokens, both within
    `scope` (scope_ids: `image_hashes` are the unscoped ones)."""
    ids = np.asarray(input_ids)
    extra = np.zeros(ids.size, np.uint64)
    visual = ids == image_token_id
    if np.count_nonzero(visual) != sum(image_token_counts):
        raise InputError(f"the prompt holds {np.count_nonzero(visual)} image tokens, the images "
                         f"{sum(image_token_counts)}")
    extra[visual] = np.repeat(np.asarray(image_hashes, np.uint64), image_token_counts)
    return scope_ids(extra, scope)
