"""Which KV-cache blocks of a prompt the TensorRT-LLM executor would reuse: the reference
tensorrt_llm counts them as the stock backend's `reused` KV block metric (it recomputes every
prompt itself, so reuse changes its counts, never its answers).

As the executor matches them (TensorRT-LLM cpp/include/tensorrt_llm/batch_manager/
llmRequest.h `initialize`, kvCacheManager.cpp): each prompt token is the pair (token id, its
prompt_table_extra_id; 0 for every token when the request has no prompt table or no extra
ids), the prompt is cut into blocks of tokens_per_block, and a block is keyed by its pairs
under the key of the block before it, from the first block on. So an extra id that differs
at token i makes block i//tokens_per_block and every later one a miss: a cache scope folded
into every extra id (mm/prompt_table.py scope_ids) shares no block at all. At most
prompt length - 1 tokens are reused (llmRequest.h: "Up to inputLen - 1 tokens can be
reused"); only whole blocks are counted here (the executor may also copy a partly matching
block). The cache holds at most `capacity` blocks, the least recently used leaving first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class BlockReuse:
    def __init__(self, tokens_per_block: int, capacity: int) -> None:
        self.tokens_per_block = max(tokens_per_block, 1)
        self.capacity = capacity
        self.reused = 0  # blocks reused so far (the executor's kvCacheStats.reusedBlocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def add(self, input_ids: Sequence[int], extra_ids: Sequence[int] | None) -> int:
        """A prompt's blocks: how many were cached (counted in `reused`); all of them are
        cached from now on."""
        n = self.tokens_per_block
        whole = (len(input_ids) - 1) // n  # the last prompt token is never reused
        pairs = np.zeros((whole * n, 2), np.uint64)
        pairs[:, 0] = np.asarray(input_ids[:whole * n], np.int64).astype(np.uint64)
        if extra_ids is not None:
            pairs[:, 1] = np.asarray(extra_ids[:whole * n], np.uint64)
        parent, hits, missed = b"", 0, False
        for block in range(whole):
            parent = hashlib.blake2b(parent + pairs[block * n:(block + 1) * n].tobytes(),
                                     digest_size=16).digest()
            if not missed and parent in self._blocks:
                hits += 1
            else:
                missed = True
            self._blocks[parent] = None
            self._blocks.move_to_end(parent)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        self.reused += hits
        return hits
