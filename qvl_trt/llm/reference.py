"""The PyTorch reference decoder: runs a converted TensorRT-LLM checkpoint on exactly the
inputs the TensorRT-LLM 1.2 engine receives.

Inputs per request are the engine's: input_ids with fake prompt ids, the prompt table with
1+K rows per visual token, `mrope_rotary_cos_sin` and `mrope_position_deltas`. The rotary
embedding follows the gpt attention plugin (GPT-NeoX halves: x[i] and x[i + dim/2] rotate
by frequency i):
- context phase: the token at sequence index t takes the (cos, sin) pairs of row t of the
  request's table (unfusedAttentionKernels_2_template.h, applyBiasRopeUpdateKVCacheV2:
  `mrope_rotary_cos_sin + batch_idx * rotary_embedding_max_positions * half_rotary_dim +
  rotary_position * half_rotary_dim`; attentionOp.cpp passes no delta to this phase);
- generation phase: the token at sequence index n (the KV-cache length, `tlength`) is
  rotated by the plain rope at position n + mrope_position_delta, the same on all three
  axes (decoderMaskedMultiheadAttentionTemplate.h: `position_idx = tlength +
  mrope_position_deltas[batch_idx]`), with the engine's fp32 inverse frequencies.
DeepStack: the visual token with fake id vocab_size + (1+K)i takes prompt-table row (1+K)i
as its embedding, and row (1+K)i+1+k is added to its hidden state after decoder layer k;
text tokens get nothing. Rows no fake id references are never read (assigned at visual
positions only, never multiplied by a 0/1 mask), as strict as the engine, whose table buffer
is never zeroed and whose text tokens read a stale row that `where` drops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..deps import require
from ..dtypes import WeightOnly
from ..errors import CheckpointError, InputError
from ..mm.prompt_table import split_prompt_table, visual_token_positions
from .guided import NOT_SET_UP, GuidedDecoding, GuideMatcher
from .layout import LlmConfig, merge, rank_files, read_llm_config
from .sampling import (
    DecodeRequest,
    DecodeResult,
    FinishReason,
    TokenEvent,
    choose_token,
    make_generator,
)
from .weight_only import dequantize, is_quantized, quantize


def load_weights(path: Path, config: LlmConfig) -> dict:
    """All weights of a converted checkpoint as unsplit torch tensors (ranks merged); weight-
    only linears as the engine's GEMM sees them: each rank's piece quantized on its own, as
    TensorRT-LLM's loader quantizes each rank file, and dequantized (q x scale in the model
    dtype, qvl_trt.llm.weight_only)."""
    require("torch", extra="export", why="load the converted checkpoint")
    safetensors_torch = require("safetensors.torch", extra="export", why="read weights")
    files = rank_files(path, config)
    ranks = [_weight_only(safetensors_torch.load_file(str(f)), config) for f in files]
    names = list(ranks[0])
    for file, rank in zip(files, ranks, strict=True):
        if list(rank) != names:
            raise CheckpointError(f"{file} holds other weights than rank 0; convert again")
    return {name: merge(name, [rank.pop(name) for rank in ranks], config) for name in names}


def _weight_only(tensors: dict, config: LlmConfig) -> dict:
    """One rank file's tensors with each weight-only linear replaced by the dequantized
    integers `quantize` makes of it."""
    mode = config.weight_only
    if mode is WeightOnly.NONE:
        return tensors
    return {name: dequantize(*quantize(tensor, mode, config.dtype), mode, config.dtype)
            if is_quantized(name) else tensor for name, tensor in tensors.items()}


@dataclass
class _Layer:
    input_norm: object
    qkv: object
    dense: object
    q_norm: object
    k_norm: object
    post_norm: object
    fc: object
    gate: object
    proj: object


class ReferenceDecoder:
    """Greedy/sampled generation with a KV cache over an in-flight batch of requests."""

    def __init__(self, config: LlmConfig, weights: dict, *, device: str = "cpu",
                 dtype: str | None = None) -> None:
        torch = require("torch", extra="export", why="run the reference decoder")
        self.config = config
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype or config.dtype)
        if config.rotary_embedding_dim != config.head_size:
            raise CheckpointError(f"rotary_embedding_dim {config.rotary_embedding_dim} != "
                                  f"head_size {config.head_size}: partial rotary is not a "
                                  "Qwen3-VL layout; convert again")

        def take(name: str):
            try:
                tensor = weights[name]
            except KeyError:
                raise CheckpointError(f"converted checkpoint lacks {name}; convert again") \
                    from None
            return tensor.to(device=self.device, dtype=self.dtype)

        self.embedding = take("transformer.vocab_embedding.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"transformer.layers.{i}."
            self.layers.append(_Layer(
                take(p + "input_layernorm.weight"), take(p + "attention.qkv.weight"),
                take(p + "attention.dense.weight"), take(p + "attention.q_layernorm.weight"),
                take(p + "attention.k_layernorm.weight"), take(p + "post_layernorm.weight"),
                take(p + "mlp.fc.weight"), take(p + "mlp.gate.weight"),
                take(p + "mlp.proj.weight")))
        self.final_norm = take("transformer.ln_f.weight")
        self.lm_head = take("lm_head.weight")  # merge() already dropped the TP padding
        # The engine's generation-phase rope table (create_sinusoidal_positions_for_attention_
        # plugin): inv_freq from float64 powers cast to fp32, angles in fp32.
        dim = config.rotary_embedding_dim
        powers = config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        self.inv_freq = (1.0 / powers.float()).to(self.device)

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu",
             dtype: str | None = None) -> ReferenceDecoder:
        """Load a folder written by `qvl-trt convert` (any TP size); `dtype` overrides the
        checkpoint's for computation (e.g. float32 on a CPU)."""
        config = read_llm_config(Path(path))
        return cls(config, load_weights(Path(path), config), device=device, dtype=dtype)

    # ---- public API ----------------------------------------------------------------------

    def batch(self, guided: GuidedDecoding | None = None, *,
              context_chunk: int | None = None) -> DecodeBatch:
        """An empty in-flight batch: requests join and leave between steps; `guided` applies
        the requests' guides (None: guided decoding is off, a guided request is refused);
        `context_chunk`: prefill prompts in chunks of that many positions, as the executor
        with chunked context (None: in one pass)."""
        return DecodeBatch(self, guided, context_chunk)

    def generate(self, requests: Sequence[DecodeRequest], *,
                 on_token: Callable[[TokenEvent], None] | None = None) -> list[DecodeResult]:
        """Run a batch of requests to completion; `on_token` sees every token as produced."""
        batch, keys = self._batch_of(requests)
        results: dict[int, DecodeResult] = {}
        while batch:
            for event in batch.step():
                if on_token is not None:
                    on_token(event)
                if event.finish_reason is not None:
                    results[event.request] = batch.result(event.request)
        return [results[key] for key in keys]

    def stream(self, requests: Sequence[DecodeRequest]) -> Iterator[TokenEvent]:
        """The tokens of a batch of requests, one event per token, as they are produced."""
        batch, _ = self._batch_of(requests)
        while batch:
            yield from batch.step()

    def _batch_of(self, requests: Sequence[DecodeRequest]) -> tuple[DecodeBatch, list[int]]:
        batch = self.batch()
        return batch, [batch.add(request) for request in requests]

    def _inputs(self, index: int, request: DecodeRequest) -> tuple:
        """The request's (prompt table, MRoPE table) as torch tensors, validated against the
        checkpoint; each problem is one line naming the request and the fix."""
        torch = require("torch", extra="export", why="run the reference decoder")
        c = self.config
        where = f"request {index}"
        if not request.input_ids:
            raise InputError(f"{where}: input_ids is empty; send at least one token")
        table = None if request.prompt_table is None else torch.as_tensor(request.prompt_table)
        rows = 0 if table is None else table.shape[0]
        if table is not None and (table.ndim != 2 or table.shape[1] != c.hidden_size
                                  or rows % c.rows_per_visual_token):
            raise InputError(
                f"{where}: prompt_table has shape {list(table.shape)}; expected "
                f"[(1+K) * visual tokens, {c.hidden_size}] with 1+K = {c.rows_per_visual_token}")
        for token in request.input_ids:
            if token < 0 or token >= c.vocab_size + max(rows - c.num_deepstack_layers, 0):
                raise InputError(
                    f"{where}: token id {token} is neither a vocabulary id (< {c.vocab_size}) "
                    f"nor a fake id indexing the {rows}-row prompt table")
        total = len(request.input_ids) + request.sampling.max_tokens
        if total > c.max_position_embeddings:
            raise InputError(
                f"{where}: {len(request.input_ids)} prompt tokens + max_tokens "
                f"{request.sampling.max_tokens} exceed max_position_embeddings "
                f"{c.max_position_embeddings} of the checkpoint; lower max_tokens or convert "
                "with a larger --max-seq-len")
        mrope = torch.as_tensor(request.mrope_rotary_cos_sin, dtype=torch.float32)
        expected = c.max_position_embeddings * c.rotary_embedding_dim
        if mrope.numel() != expected:
            raise InputError(
                f"{where}: mrope_rotary_cos_sin has {mrope.numel()} values; expected "
                f"max_position_embeddings x rotary_dim = {c.max_position_embeddings} x "
                f"{c.rotary_embedding_dim} = {expected}")
        return table, mrope.reshape(c.max_position_embeddings, c.rotary_embedding_dim // 2, 2)

    # ---- model ---------------------------------------------------------------------------

    def _prefill(self, requests: Sequence[DecodeRequest], inputs: list[tuple],
                 lengths: list[int], cache: _KvCache, chunk: int | None = None):
        """Run all prompts (right-padded to the longest) and fill the KV cache, in chunks of
        `chunk` positions (None: one pass). A chunk writes its K/V at its offset and attends
        to every earlier position through the cache, as the engine's chunked context does
        with paged context FMHA; its MRoPE rows and DeepStack rows are its positions', so an
        image across a boundary is split like any other run of tokens."""
        torch = require("torch", extra="export", why="run the reference decoder")
        c = self.config
        batch, longest = len(requests), max(lengths)
        hidden = torch.zeros(batch, longest, c.hidden_size, dtype=self.dtype, device=self.device)
        deepstack = torch.zeros(c.num_deepstack_layers, batch, longest, c.hidden_size,
                                dtype=self.dtype, device=self.device)
        cos = torch.ones(batch, longest, c.rotary_embedding_dim // 2, device=self.device)
        sin = torch.zeros_like(cos)
        for b, request in enumerate(requests):
            n = lengths[b]
            ids = torch.tensor(request.input_ids, dtype=torch.long, device=self.device)
            hidden[b, :n] = self.embedding[ids.masked_fill(ids >= c.vocab_size, 0)]
            at, visual = visual_token_positions(np.asarray(request.input_ids),
                                               vocab_size=c.vocab_size,
                                               deepstack_count=c.num_deepstack_layers)
            if at.size:
                table = inputs[b][0].to(device=self.device, dtype=self.dtype)
                main, features = split_prompt_table(table, c.num_deepstack_layers)
                at = torch.from_numpy(at).to(self.device)
                visual = torch.from_numpy(visual).to(self.device)
                hidden[b, at] = main[visual]
                for k, feature in enumerate(features):
                    deepstack[k, b, at] = feature[visual]
            pairs = inputs[b][1][:n].to(self.device)
            cos[b, :n], sin[b, :n] = pairs[..., 0], pairs[..., 1]
        positions = torch.arange(longest, device=self.device)
        valid = positions[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        # Query i sees keys j <= i of its own prompt; padded queries still see key 0.
        mask = (positions[None, :] <= positions[:, None])[None] & valid[:, None, :]
        out, step = [], chunk or longest
        for start in range(0, longest, step):
            end = min(start + step, longest)
            h = hidden[:, start:end]
            for index, layer in enumerate(self.layers):
                h = self._layer(index, layer, h, cos[:, start:end], sin[:, start:end],
                                mask[:, None, start:end, :end], cache, write_at=start)
                if index < c.num_deepstack_layers:
                    h = h + deepstack[index, :, start:end]
            out.append(h)
        cache.lengths[:] = torch.tensor(lengths, device=self.device)
        return _rms_norm(torch.cat(out, dim=1), self.final_norm, c.norm_epsilon)

    def _decode_step(self, token_ids: list[int], deltas: list[int], cache: _KvCache):
        """One token per active request; returns the final hidden states [rows, hidden]."""
        torch = require("torch", extra="export", why="run the reference decoder")
        c = self.config
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.embedding[ids][:, None]
        positions = cache.lengths + torch.tensor(deltas, device=self.device)
        angles = positions[:, None].float() * self.inv_freq[None]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        span = int(cache.lengths.max()) + 1
        keys = torch.arange(span, device=self.device)
        mask = (keys[None, :] <= cache.lengths[:, None])[:, None, None]
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, mask, cache,
                                 write_at=cache.lengths)
        cache.lengths += 1
        return _rms_norm(hidden[:, 0], self.final_norm, c.norm_epsilon)

    def _layer(self, index: int, layer: _Layer, hidden, cos, sin, mask, cache: _KvCache,
               write_at):
        """One decoder layer. `write_at` an int: the (prefill) positions start there in
        every row; else one token per row at those positions."""
        torch = require("torch", extra="export", why="run the reference decoder")
        F = torch.nn.functional
        c = self.config
        batch, seq = hidden.shape[:2]
        hd, heads, kv_heads = c.head_size, c.num_attention_heads, c.num_key_value_heads
        x = _rms_norm(hidden, layer.input_norm, c.norm_epsilon)
        q, k, v = (x @ layer.qkv.T).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q = _rms_norm(q.reshape(batch, seq, heads, hd), layer.q_norm, c.norm_epsilon)
        k = _rms_norm(k.reshape(batch, seq, kv_heads, hd), layer.k_norm, c.norm_epsilon)
        q = _rotate(q, cos, sin).transpose(1, 2)
        k = _rotate(k, cos, sin).transpose(1, 2)
        v = v.reshape(batch, seq, kv_heads, hd).transpose(1, 2)
        keys, values = cache.store(index, k, v, write_at, span=mask.shape[-1])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        hidden = hidden + out.transpose(1, 2).reshape(batch, seq, heads * hd) @ layer.dense.T
        x = _rms_norm(hidden, layer.post_norm, c.norm_epsilon)
        return hidden + (F.silu(x @ layer.fc.T) * (x @ layer.gate.T)) @ layer.proj.T

    def _logits(self, hidden):
        return (hidden @ self.lm_head.T).float()


# How long a step with nothing to run but compiling guides waits for one before it returns.
COMPILE_POLL_S = 0.05


@dataclass(eq=False)
class _Sequence:
    """One request of a DecodeBatch and its own sampling state."""

    key: int
    request: DecodeRequest
    inputs: tuple  # _inputs(): (prompt table, MRoPE table)
    generator: object
    tokens: list[int] = field(default_factory=list)
    generation_logits: list = field(default_factory=list)
    context_logits: object = None
    finish: FinishReason | None = None
    # Its guide's matcher: compiling (off the step thread) from add() on, ready when it joins.
    compiling: Future[GuideMatcher] | None = None
    matcher: GuideMatcher | None = None

    @property
    def capacity(self) -> int:
        """The KV-cache positions it may fill."""
        return len(self.request.input_ids) + self.request.sampling.max_tokens


class DecodeBatch:
    """In-flight (iteration-level) batching, as the TensorRT-LLM executor schedules: add()
    queues a request for the next step(); a step runs the context phase of the requests
    added since the last one and one generation step of the others, one token each; a request
    that finished leaves after its step and drop() takes one out at once, freeing its KV-cache
    row. Each request keeps its own seeded generator and its own cache row, so its tokens do
    not depend on what else is in the batch.

    With `context_chunk` the context phase runs in chunks of that many positions, all of them
    in the step the request joins; the executor runs one chunk per iteration, beside the
    other requests' decodes, which changes when tokens come, not which.

    The running requests share one KV cache, a row each, as wide as the longest row needs;
    joining and leaving copy it (a cat or index_select per layer), a step does not.

    Guided requests follow the executor (batch_manager/guidedDecoder.cpp): at each step after
    its first the matcher accepts the token sampled last; then the matcher's bitmask masks its
    logits before sampling. A guide that does not compile raises from step() (a GuideError),
    as the executor's forwardAsync fails every request of that iteration. Unlike the executor,
    which compiles a guide in the step itself (its context phase), so that a costly one stalls
    every other request's token, the guide compiles in a worker thread from add() on
    (xgrammar releases the GIL) and the request joins at the first step after it is ready;
    the masks are filled in the step, as upstream does."""

    def __init__(self, decoder: ReferenceDecoder, guided: GuidedDecoding | None = None,
                 context_chunk: int | None = None) -> None:
        self.decoder = decoder
        self.guided = guided
        self.context_chunk = context_chunk
        self._waiting: list[_Sequence] = []  # added, prefilled at the next step
        self._rows: list[_Sequence] = []  # running: row i of the cache
        self._cache: _KvCache | None = None
        self._finished: dict[int, _Sequence] = {}  # finished in the last step
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._rows)

    def __contains__(self, key: int) -> bool:
        return any(s.key == key for s in (*self._waiting, *self._rows))

    def add(self, request: DecodeRequest) -> int:
        """Validate `request` (InputError naming it by its key) and queue it for the next
        step; returns its key, the `request` of its TokenEvents."""
        if request.guide is not None and self.guided is None:
            raise InputError(f"{NOT_SET_UP}: this model's guided_decoding_backend is empty; "
                             "send the request without a guide, or regenerate the repository "
                             "with `qvl-trt repo` (it turns guided decoding on)")
        key = self._next_key
        inputs = self.decoder._inputs(key, request)
        self._next_key += 1
        sequence = _Sequence(key, request, inputs, make_generator(request.sampling.seed))
        if request.guide is not None:
            sequence.compiling = self.guided.compile(request.guide)
        self._waiting.append(sequence)
        return key

    def drop(self, key: int) -> None:
        """Take a request out now (e.g. cancelled): it makes no further token."""
        if key not in self:
            raise KeyError(f"request {key} is not in the batch")
        self._waiting = [s for s in self._waiting if s.key != key]
        self._keep([s for s in self._rows if s.key != key])

    def result(self, key: int) -> DecodeResult:
        """The result of a request that finished in the last step."""
        torch = require("torch", extra="export", why="run the reference decoder")
        s = self._finished[key]
        return DecodeResult(
            token_ids=tuple(s.tokens), finish_reason=s.finish,
            prompt_tokens=len(s.request.input_ids),
            visual_tokens=sum(t >= self.decoder.config.vocab_size for t in s.request.input_ids),
            context_logits=s.context_logits,
            generation_logits=torch.stack(s.generation_logits) if s.generation_logits
            else None)

    def step(self) -> list[TokenEvent]:
        """One token for every request in the batch: the running ones first, then those that
        joined, in order."""
        torch = require("torch", extra="export", why="run the reference decoder")
        decoder = self.decoder
        logits = []
        # Only the model runs in inference mode: the caller owns what comes out.
        with torch.inference_mode():
            if self._rows:
                logits.append(decoder._logits(decoder._decode_step(
                    [s.tokens[-1] for s in self._rows],
                    [s.request.mrope_position_delta for s in self._rows], self._cache)))
            joining = self._joining()
            if joining:
                joined_logits, joined = self._prefill(joining)
                logits.append(joined_logits)
                self._cache = joined if self._cache is None else self._cache.join(joined)
        for s in joining:
            if s.context_logits is not None:
                # A copy on the CPU, like the generation logits: an ordinary tensor.
                s.context_logits = s.context_logits.to("cpu", copy=True)
        rows = self._rows = self._rows + joining
        logits = torch.cat(logits) if rows else None
        events = []
        self._guide(logits)
        for row, s in enumerate(rows):
            sampling = s.request.sampling
            token = choose_token(logits[row], sampling, s.generator, len(s.tokens))
            s.tokens.append(token)
            if s.request.return_generation_logits:
                s.generation_logits.append(logits[row].cpu())
            if token in sampling.stop_token_ids:
                s.finish = FinishReason.STOP
            elif len(s.tokens) >= sampling.max_tokens:
                s.finish = FinishReason.LENGTH
            events.append(TokenEvent(s.key, token, s.finish))
        self._finished = {s.key: s for s in rows if s.finish is not None}
        if self._finished:
            self._keep([s for s in rows if s.finish is None])
        return events

    def _joining(self) -> list[_Sequence]:
        """The waiting requests that join this step: those without a guide or whose guide has
        compiled (a GuideError of one that did not raises here). With nothing else to do, the
        step waits a little for a compile rather than return at once."""
        compiling = [s.compiling for s in self._waiting if s.compiling is not None]
        if compiling and not self._rows and len(compiling) == len(self._waiting):
            wait(compiling, timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        joining = [s for s in self._waiting if s.compiling is None or s.compiling.done()]
        self._waiting = [s for s in self._waiting if s not in joining]
        for s in joining:
            if s.compiling is not None:
                s.matcher, s.compiling = s.compiling.result(), None
        return joining

    def _guide(self, logits) -> None:
        """Mask the guided rows' logits: a running one's matcher accepts its last token (none
        at its first step); then each fills its bitmask."""
        for row, s in enumerate(self._rows):
            if s.matcher is None:
                continue
            if s.tokens:
                s.matcher.accept(s.tokens[-1])
            s.matcher.fill()
            s.matcher.apply(logits[row])

    def _prefill(self, joining: list[_Sequence]):
        """The context phase of the requests that join (right-padded to the longest):
        their last-token logits and their own KV cache."""
        torch = require("torch", extra="export", why="run the reference decoder")
        decoder = self.decoder
        lengths = [len(s.request.input_ids) for s in joining]
        cache = _KvCache(decoder, len(joining), max(s.capacity for s in joining))
        hidden = decoder._prefill([s.request for s in joining], [s.inputs for s in joining],
                                  lengths, cache, self.context_chunk)
        for b, s in enumerate(joining):
            if s.request.return_context_logits:
                s.context_logits = decoder._logits(hidden[b, : lengths[b]])
        last = hidden[torch.arange(len(joining), device=decoder.device),
                      torch.tensor(lengths, device=decoder.device) - 1]
        return decoder._logits(last), cache

    def _keep(self, rows: list[_Sequence]) -> None:
        """Keep only `rows` of the running requests (their cache shrunk to what they need)."""
        if rows == self._rows:
            return
        if rows:
            index = [self._rows.index(s) for s in rows]
            self._cache.keep(index, capacity=max(s.capacity for s in rows))
        else:
            self._cache = None
        self._rows = rows


class _KvCache:
    """K and V per layer, [rows, kv_heads, capacity, head_dim], and each row's length."""

    def __init__(self, decoder: ReferenceDecoder, batch: int, capacity: int) -> None:
        torch = require("torch", extra="export", why="run the reference decoder")
        c = decoder.config
        shape = (batch, c.num_key_value_heads, capacity, c.head_size)
        self.k = [torch.zeros(shape, dtype=decoder.dtype, device=decoder.device)
                  for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=decoder.device)

    def store(self, layer: int, k, v, write_at, *, span: int):
        """Write new K/V (from position `write_at` in every row, or one token per row at the
        positions `write_at` holds) and return the cached K/V of the first `span` positions."""
        torch = require("torch", extra="export", why="run the reference decoder")
        if isinstance(write_at, int):
            self.k[layer][:, :, write_at: write_at + k.shape[2]] = k
            self.v[layer][:, :, write_at: write_at + v.shape[2]] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            self.k[layer][rows, :, write_at] = k[:, :, 0]
            self.v[layer][rows, :, write_at] = v[:, :, 0]
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def join(self, other: _KvCache) -> _KvCache:
        """Its rows followed by `other`'s, as wide as the wider one (zero-padded)."""
        torch = require("torch", extra="export", why="run the reference decoder")
        width = max(self.k[0].shape[2], other.k[0].shape[2])

        def cat(a, b):
            return torch.cat([_widen(a, width), _widen(b, width)])

        self.k = [cat(a, b) for a, b in zip(self.k, other.k, strict=True)]
        self.v = [cat(a, b) for a, b in zip(self.v, other.v, strict=True)]
        self.lengths = torch.cat([self.lengths, other.lengths])
        return self

    def keep(self, rows: list[int], *, capacity: int) -> None:
        """Only `rows`, `capacity` positions wide: a copy, so the rest is freed."""
        torch = require("torch", extra="export", why="run the reference decoder")
        index = torch.tensor(rows, device=self.lengths.device)
        self.k = [t[:, :, :capacity].index_select(0, index) for t in self.k]
        self.v = [t[:, :, :capacity].index_select(0, index) for t in self.v]
        self.lengths = self.lengths.index_select(0, index)


def _widen(t, width: int):
    """[rows, heads, positions, dim] zero-padded to `width` positions."""
    torch = require("torch", extra="export", why="run the reference decoder")
    return torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2]))


def _rms_norm(x, weight, eps: float):
    """Qwen3's RMSNorm: normalised in fp32, cast back, then scaled (as transformers does)."""
    torch = require("torch", extra="export", why="run the reference decoder")
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x, cos, sin):
    """GPT-NeoX rope on [batch, seq, heads, dim] with per-token cos/sin [batch, seq, dim/2]."""
    torch = require("torch", extra="export", why="run the reference decoder")
    cos = torch.cat([cos, cos], dim=-1)[:, :, None].to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1)[:, :, None].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
