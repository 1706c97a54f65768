"""Guided decoding (structured output) as the stock TensorRT-LLM 1.2 runtime does it, with
xgrammar 0.1.32 (TensorRT-LLM 1.2.1's requirements.txt pin, and the version its C++ library
is built from): the guide types and their request-time rules, xgrammar's tokenizer info file,
and the per-request grammar matcher whose token bitmask masks the logits before sampling.

Upstream, in NVIDIA/TensorRT-LLM (the 1.2 line: the two versions of each file read, before
and after the structural_tag and cache-limit changes of guidedDecoder.cpp, agree on this):
- triton_backend/inflight_batcher_llm/src/utils.cc getGuidedDecodingParamsFromTensors: the
  inputs `guided_decoding_guide_type` and `guided_decoding_guide` (TYPE_STRING); the type maps
  only json, json_schema, regex and ebnf_grammar. Any other type (structural_tag included, which
  the C++ executor knows but this mapping lacks) is silently dropped and the request runs
  unguided, as does a guide without a type. A type without a guide throws at request
  creation (executor/guidedDecodingParams.cpp: "The guide string must be provided unless
  using GuideType::kJSON.").
- triton_backend/inflight_batcher_llm/src/model_instance_state.cc
  getGuidedDecodingConfigFromParams: guided decoding is on only when both
  `guided_decoding_backend` (which must then be "xgrammar") and `xgrammar_tokenizer_info_path`
  are non-empty; the file must exist and is read as JSON {"encoded_vocab": [str],
  "tokenizer_str": str, "stop_token_ids": [int]} (`tokenizer_dir` is ignored by the C++ path).
- cpp/tensorrt_llm/executor/executorImpl.cpp fetchNewRequests: a guided request while guided
  decoding is off fails alone at admission ("Request is specified with GuidedDecodingParams,
  but GuidedDecoder is not setup ...").
- cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp: xgrammar's TokenizerInfo is built from the
  file (vocab type and add_prefix_space detected from tokenizer_str) with the engine's padded
  vocab size (trtGptModelInflightBatching.cpp: getVocabSizePadded), a GrammarCompiler with 8
  threads and its cache; at a request's first context chunk its guide is compiled
  (CompileBuiltinJSONGrammar, CompileJSONSchema with xgrammar's defaults any_whitespace=true
  and strict_mode=true, CompileRegex, CompileGrammar for EBNF) into a GrammarMatcher; at each
  later step the last token is accepted; then the matcher fills the bitmask, which a kernel
  applies to the logits before sampling. The compile runs inside the executor's forwardAsync:
  an invalid schema, regex or grammar throws there, and executorImpl.cpp terminates EVERY
  active request of that iteration with "Encountered an error in forwardAsync function: ...".
- Once the grammar is complete the matcher admits only the tokenizer info's stop tokens. A
  guided request that goes on past one (no end id: ignore_eos; an end token that is neither
  its end id nor a stop word) makes the next FillNextTokenBitmask throw, which again fails
  the whole step: such requests are refused up front here. min_tokens cannot hold the end id
  back from a complete grammar either: the penalty kernel (kernels/penaltyKernels.cu
  batchApplyPenalty) gives the held end id the finite -FLT_MAX while the mask gave every other
  token -inf, so the end id is still picked (or another admitted stop token, past which the
  step fails): guided requests with min_tokens are refused up front too.
- The bitmask work runs on the executor's own loop thread, on the host, right after the
  step's engine launch (trtGptModelInflightBatching.cpp forwardAsync: "XGrammar: build
  maskcache for context requests and perform maskgen for all requests. These need to be
  overlapped with the kernel execution of forward step"), its copy to the GPU on a stream of
  its own.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import write_json_atomic
from ..deps import require
from ..errors import ConfigError, FieldError, InputError
from .schema_subset import SchemaError, check_pattern, check_schema

# The tensorrt_llm model parameter value that turns guided decoding on (the only backend the
# C++ runtime takes).
BACKEND = "xgrammar"
# The executor's wording for the two failures that are not the request's own shape.
NOT_SET_UP = ("Request is specified with GuidedDecodingParams, but GuidedDecoder is not "
              "setup")
FORWARD_ERROR = "Encountered an error in forwardAsync function: "
# The compiled grammars a process keeps, least recently used first out (xgrammar's
# GrammarCompiler cache_limit_bytes, sized by CompiledGrammar.MemorySizeBytes).
GRAMMAR_CACHE_BYTES = 256 * 2**20
# Guides compiling at once, off the step thread (each compile also runs xgrammar's own
# threads).
COMPILE_WORKERS = 2


class GuideType(str, enum.Enum):
    """The guide types the tensorrtllm backend maps (utils.cc), by their wire strings."""

    JSON = "json"  # any JSON value; the guide text is not used
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF_GRAMMAR = "ebnf_grammar"


# Known to the C++ executor, but not mapped by the 1.2 Triton backend: it would run unguided.
STRUCTURAL_TAG = "structural_tag"


def check_guided_ending(has_end_id: bool, min_tokens: int) -> None:
    """Refuse a guided request that cannot end where its structure does (module docstring:
    past a complete grammar only end tokens are admitted): one without an end id (sent with
    ignore_eos), or one with min_tokens. The gateway answers with the same words."""
    if not has_end_id:
        raise FieldError("a guided answer needs its end token, which ignore_eos leaves out: "
                         "once the structure is complete only end tokens are admitted, and "
                         "generating past one fails the engine's whole step; leave ignore_eos "
                         "out", "ignore_eos")
    if min_tokens:
        raise FieldError("min_tokens with a guided answer: once the structure is complete "
                         "only end tokens are admitted, so the engine would end the answer "
                         "before min_tokens or fail its whole step; leave min_tokens out",
                         "min_tokens")


class GuideError(InputError):
    """A guide that xgrammar cannot compile. The stock executor finds out inside a step and
    fails every request of that step with it (FORWARD_ERROR)."""


@dataclass(frozen=True)
class Guide:
    """One request's guide: its type and text (None: the type takes none)."""

    type: GuideType
    text: str | None = None

    @classmethod
    def from_inputs(cls, guide_type: str | None, guide: str | None) -> Guide | None:
        """The guide of a request's two inputs (None where both are absent), refused where
        the stock backend would refuse it or silently run the request unguided."""
        if guide_type is None:
            if guide is not None:
                raise InputError("guided_decoding_guide is sent without "
                                 "guided_decoding_guide_type: the stock backend would ignore "
                                 "it and generate unguided text; send both")
            return None
        if guide_type == STRUCTURAL_TAG:
            raise InputError("guided_decoding_guide_type structural_tag is not carried by the "
                             "tensorrtllm backend of TensorRT-LLM 1.2 (it would generate "
                             "unguided text); send the structure as json_schema or "
                             "ebnf_grammar")
        try:
            kind = GuideType(guide_type)
        except ValueError:
            raise InputError(f"guided_decoding_guide_type {guide_type!r} is not one of "
                             f"{', '.join(t.value for t in GuideType)}; the stock backend "
                             "would ignore it and generate unguided text") from None
        if guide is None and kind is not GuideType.JSON:
            raise InputError("The guide string must be provided unless using "
                             f"GuideType::kJSON: send guided_decoding_guide with "
                             f"guided_decoding_guide_type {kind.value}")
        return cls(kind, guide)

    def check(self) -> None:
        """Refuse a guide xgrammar cannot compile before it reaches the engine: the executor
        compiles it inside a step, and its failure ends every request of that step. xgrammar's
        parsers alone, without the tokenizer (microseconds); a GuideError."""
        grammar = _xgrammar().Grammar
        parse = {
            GuideType.JSON: lambda text: None,
            GuideType.JSON_SCHEMA: lambda text: grammar.from_json_schema(
                text, any_whitespace=True, strict_mode=True),
            GuideType.REGEX: grammar.from_regex,
            GuideType.EBNF_GRAMMAR: grammar.from_ebnf,
        }[self.type]
        self.apply(parse, after="; the engine would fail every request of its step with it")
        # Then the subset a guide holds to cheaply and faithfully (the gateway's too): the
        # executor would take the rest, and fill its costly masks on its step's thread.
        try:
            if self.type is GuideType.JSON_SCHEMA:
                check_schema(json.loads(self.text))
            elif self.type is GuideType.REGEX:
                check_pattern(self.text)
        except SchemaError as exc:
            where = f"'s {exc.path}" if exc.path else ""
            raise GuideError(f"the {self.type.value} guide{where} {exc}; send a guide inside "
                             "the supported subset (docs/openai.md)") from None

    def apply(self, xgrammar_call: Callable[[str | None], Any], *, before: str = "",
              after: str = "") -> Any:
        """`xgrammar_call(text)`; what it raises becomes a GuideError saying the guide does
        not compile, with xgrammar's complaint between `before` and `after`."""
        try:
            return xgrammar_call(self.text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            raise GuideError(f"{before}the {self.type.value} guide does not compile: "
                             f"{_complaint(exc)}{after}") from None


def compact_json_schema(schema: str) -> str:
    """An EBNF grammar (for GuideType.EBNF_GRAMMAR) of the JSON that `schema` admits, laid
    out without free whitespace (`{"a": 1, "b": [2, 3]}`). The json_schema guide type compiles
    with xgrammar's any_whitespace=true and no whitespace limit (the executor passes no
    options), so a model can pad with spaces and newlines until max_tokens without ever
    finishing the structure; this grammar leaves it no such room. A schema xgrammar cannot
    convert raises an InputError."""
    try:
        grammar = _xgrammar().Grammar.from_json_schema(schema, any_whitespace=False,
                                                       strict_mode=True)
    except Exception as exc:
        raise InputError(f"the JSON schema does not compile: {_complaint(exc)}") from None
    return str(grammar)


# ---- the tokenizer info file --------------------------------------------------------------

@dataclass(frozen=True)
class TokenizerInfo:
    """xgrammar's tokenizer info file as the tensorrtllm backend reads it: the tokens in id
    order (encoded as the tokenizer stores them, added tokens included), the tokenizer's
    JSON, and the tokens that end a guided answer."""

    encoded_vocab: tuple[str, ...]
    tokenizer_str: str
    stop_token_ids: tuple[int, ...]

    @classmethod
    def of_tokenizer(cls, tokenizer_json: Path, stop_token_ids: Sequence[int]) -> TokenizerInfo:
        """From a tokenizer.json, as upstream's generate_xgrammar_tokenizer_info.py makes it
        (tensorrt_llm/llmapi/tokenizer.py _xgrammar_tokenizer_info: get_vocab() in id order,
        added tokens included, and the tokenizer's JSON), read straight from the file.
        `stop_token_ids`: every token that ends an answer (upstream takes eos_token_id alone;
        the deployment ends at each of the checkpoint's end tokens, so the grammar, once
        complete, must admit each)."""
        text = Path(tokenizer_json).read_text(encoding="utf-8")
        try:
            order = _parsed(text, _vocab_in_id_order)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{tokenizer_json} is not a tokenizers JSON file ({exc}); use "
                              "the checkpoint's tokenizer.json") from None
        if order is None:
            # The backend takes a token's place in the list as its id.
            raise ConfigError(f"{tokenizer_json}: the token ids are not 0..N-1 without gaps; "
                              "xgrammar's tokenizer info cannot describe it")
        info = cls(order, text, tuple(int(t) for t in stop_token_ids))
        info.check()
        return info

    @classmethod
    def read(cls, path: Path) -> TokenizerInfo:
        """The file as the backend parses it; a ConfigError names what is wrong."""
        try:
            data = _parsed(Path(path).read_text(encoding="utf-8"), json.loads)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not a readable JSON file ({exc}); regenerate the "
                              "repository with `qvl-trt repo`") from None
        ok = (isinstance(data, dict)
              and isinstance(data.get("encoded_vocab"), list)
              and all(isinstance(t, str) for t in data["encoded_vocab"])
              and isinstance(data.get("tokenizer_str"), str)
              and isinstance(data.get("stop_token_ids"), list)
              and all(isinstance(t, int) and not isinstance(t, bool)
                      for t in data["stop_token_ids"]))
        if not ok:
            raise ConfigError(f"{path} is not xgrammar's tokenizer info (an object with "
                              "encoded_vocab: [str], tokenizer_str: str, stop_token_ids: "
                              "[int]); regenerate the repository with `qvl-trt repo`")
        info = cls(tuple(data["encoded_vocab"]), data["tokenizer_str"],
                   tuple(data["stop_token_ids"]))
        info.check(str(path))
        return info

    def check(self, where: str = "tokenizer info") -> None:
        if not self.encoded_vocab or not self.stop_token_ids:
            raise ConfigError(f"{where}: the vocabulary and the stop tokens must not be empty")
        outside = [t for t in self.stop_token_ids if not 0 <= t < len(self.encoded_vocab)]
        if outside:
            raise ConfigError(f"{where}: stop_token_ids {outside} are not tokens of its "
                              f"{len(self.encoded_vocab)}-token vocabulary")

    def write(self, path: Path) -> None:
        write_json_atomic(Path(path), {"encoded_vocab": list(self.encoded_vocab),
                                       "tokenizer_str": self.tokenizer_str,
                                       "stop_token_ids": list(self.stop_token_ids)})


def _vocab_in_id_order(text: str) -> tuple[str, ...] | None:
    """A tokenizer.json's tokens in id order, added ones included (None: the ids have gaps)."""
    data = json.loads(text)
    vocab = data["model"]["vocab"]
    # BPE and WordPiece map token -> id; Unigram lists [token, score] in id order.
    ids = dict(vocab) if isinstance(vocab, dict) else {t: i for i, (t, _) in enumerate(vocab)}
    ids |= {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    order = sorted(ids, key=ids.__getitem__)
    return tuple(order) if [ids[t] for t in order] == list(range(len(order))) else None


# Parsed files by content: the repository writer, `validate` and the tests read the same
# 7-14 MB tokenizer files many times in one process (0.2-0.3 s a parse); a few entries.
_PARSED: dict[tuple[Any, bytes], Any] = {}


def _parsed(text: str, parse: Any) -> Any:
    key = (parse, hashlib.blake2b(text.encode(), digest_size=16).digest())
    if key not in _PARSED:
        if len(_PARSED) >= 8:
            _PARSED.clear()
        _PARSED[key] = parse(text)
    return _PARSED[key]


# ---- matching -------------------------------------------------------------------------------

class GuidedDecoding:
    """xgrammar over one tokenizer info, for an engine whose logits are `vocab_size` wide (the
    padded vocabulary; token ids past the tokenizer's never become admissible, nor do the fake
    prompt ids, which lie past vocab_size). xgrammar's tables are built at the first guide
    (1-4 s on a CPU), not at model load."""

    def __init__(self, info: TokenizerInfo, vocab_size: int) -> None:
        if vocab_size < len(info.encoded_vocab):
            raise ConfigError(f"the engine's vocab_size {vocab_size} is below the tokenizer's "
                              f"{len(info.encoded_vocab)} tokens; the tokenizer info does not "
                              "belong to this checkpoint")
        self.info = info
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> Any:
        """xgrammar's GrammarCompiler, as guidedDecoder.cpp makes it."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = self.info
                # TokenizerInfo::DetectMetadataFromHF(tokenizer_str), then the constructor
                # with the padded vocab size (xgrammar's Python API reaches the detection only
                # through this helper).
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(info.tokenizer_str)
                tokenizer_info = xgr.TokenizerInfo(
                    list(info.encoded_vocab), meta["vocab_type"], vocab_size=self.vocab_size,
                    stop_token_ids=list(info.stop_token_ids),
                    add_prefix_space=meta["add_prefix_space"])
                # A cache as upstream's, bounded: xgrammar's default (-1) keeps every
                # distinct guide's compiled grammar for the life of the process.
                self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=8,
                                                     cache_enabled=True,
                                                     cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> GuidedDecoding:
        return cls(TokenizerInfo.read(path), vocab_size)

    def compile(self, guide: Guide) -> Future[GuideMatcher]:
        """`matcher(guide)` in a worker thread (xgrammar compiles without the GIL)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="guide")
        return self._pool.submit(self.matcher, guide)

    def matcher(self, guide: Guide) -> GuideMatcher:
        """A fresh matcher of `guide`; a GuideError carries xgrammar's complaint."""
        compiler = self.compiler
        compile_guide = {
            GuideType.JSON: lambda text: compiler.compile_builtin_json_grammar(),
            # Upstream passes the schema alone: these are xgrammar's defaults, spelled out.
            GuideType.JSON_SCHEMA: lambda text: compiler.compile_json_schema(
                text, any_whitespace=True, strict_mode=True),
            GuideType.REGEX: compiler.compile_regex,
            GuideType.EBNF_GRAMMAR: compiler.compile_grammar,
        }[guide.type]
        compiled = guide.apply(compile_guide, before=FORWARD_ERROR)
        return GuideMatcher(_xgrammar().GrammarMatcher(compiled), self.vocab_size)


class GuideMatcher:
    """One request's grammar state: `accept` each generated token, `mask` the next logits."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by the token sampled last (upstream ignores the result, as here)."""
        return bool(self._matcher.accept_token(int(token_id)))

    def fill(self) -> None:
        """The bitmask of the tokens admissible next (one bit per id of vocab_size). After an
        end token was accepted xgrammar refuses ("GrammarMatcher has terminated after
        accepting the stop token"): in the executor that fails the step (FORWARD_ERROR)."""
        try:
            self._matcher.fill_next_token_bitmask(self.bitmask)
        except RuntimeError as exc:
            raise GuideError(f"{FORWARD_ERROR}{_complaint(exc)}") from None

    def apply(self, logits: Any) -> None:
        """Set the logits of inadmissible tokens (one row, vocab_size wide, on the CPU) to
        -inf, in place."""
        _xgrammar().apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device),
                                                vocab_size=self.vocab_size)

    def allowed(self) -> Any:
        """The admissible ids of the last fill, as a bool array over every bit of the mask
        (vocab_size rounded up to 32)."""
        import numpy as np

        words = self.bitmask.numpy().reshape(-1).astype(np.uint32).view(np.uint8)
        return np.unpackbits(words, bitorder="little").astype(bool)

    def accepts(self, text: str) -> bool:
        """Whether the grammar takes `text` from the matcher's state (and advances by it)."""
        return bool(self._matcher.accept_string(text))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def _complaint(exc: Exception) -> str:
    """xgrammar's message on one line, without its log prefix ("[12:00:00] /project/cpp/
    json_schema_converter.cc:3233: ")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return _LOG_PREFIX.sub("", text)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar():
    return require("xgrammar", extra="export", why="apply guided decoding (structured output)")
