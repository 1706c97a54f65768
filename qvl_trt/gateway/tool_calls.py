"""The generated text -> the assistant message: content and tool calls, streamed or not.

Qwen3-VL calls a function as its chat template tells it to (the template's tools section):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several for parallel calls, possibly after some text. With tool_choice
auto `TaggedCalls` reads such blocks out of the text as it streams: text that may be the
start of a tag is held back until it is known not to be one, a block is read whole, and one
whose JSON is not a call ({"name": string, "arguments": object}) stays in the content as the
model wrote it. With tool_choice required the answer is guided to a JSON list of
{"name", "parameters"} (`CallList`), with a named function to that function's arguments
(`NamedCall`, streamed as they come). Each reader turns text into `Delta`s: content text, or
a piece of call `index` (its id and name first, then its arguments, OpenAI's chunk shape).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .openai_api import Answer, Structure

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Delta:
    """Content text (`index` None), or a piece of tool call `index`: its first piece carries
    the call's id and function name, later ones more of its arguments (JSON text)."""

    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None

    def chunk(self) -> dict:
        """The delta of a `chat.completion.chunk`."""
        if self.index is None:
            return {"content": self.text}
        call: dict = {"index": self.index}
        if self.id is not None:
            call |= {"id": self.id, "type": "function"}
        function = {"arguments": self.text}
        if self.name is not None:
            function = {"name": self.name, **function}
        return {"tool_calls": [call | {"function": function}]}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class AnswerReader:
    """The text as content (Answer.TEXT); subclasses read calls out of it. `feed` each piece
    of text as it arrives, then `close`; `calls` counts the calls read so far."""

    def __init__(self) -> None:
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        return [Delta(text)] if text else []

    def close(self) -> list[Delta]:
        return []

    def _call(self, name: str, arguments: str) -> list[Delta]:
        index, self.calls = self.calls, self.calls + 1
        return [Delta("", index, call_id(), name), *([Delta(arguments, index)] if arguments
                                                     else [])]


class TaggedCalls(AnswerReader):
    """tool_choice auto: calls in Qwen's tags among the content. Whitespace next to a call
    is dropped (the template puts newlines between calls); without parallel calls, calls
    after the first are dropped."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self.pending = ""  # text not yet sent: a possible tag start, whitespace, or a block
        self.inside = False
        self.after_call = False  # blanks right after a call are dropped too

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        out: list[Delta] = []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return out
                block, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.inside = False
                out += self._block(block)
                continue
            start = self.pending.find(OPEN)
            if start < 0:
                # Keep back what may begin a tag, and trailing whitespace (it may precede one).
                cut = len(self.pending) - _tag_prefix(self.pending)
                head, tail = self.pending[:cut], self.pending[cut:]
                stripped = head.rstrip()
                out += self._text(stripped)
                self.pending = head[len(stripped):] + tail
                return out
            out += self._text(self.pending[:start].rstrip())
            self.pending = self.pending[start + len(OPEN):]
            self.inside = True

    def close(self) -> list[Delta]:
        """What is left: an unfinished block or a held-back tag start stays content, as do
        trailing blanks of an answer without calls."""
        rest = (OPEN if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return self._text(rest.rstrip() if self.calls else rest)

    def _text(self, text: str) -> list[Delta]:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return [Delta(text)] if text else []

    def _block(self, block: str) -> list[Delta]:
        call = _call_json(block)
        if call is None:  # not a call: stays content, as written
            return self._text(OPEN + block + CLOSE)
        if self.calls and not self.parallel:
            self.after_call = True
            return []
        name, arguments = call
        self.after_call = True
        return self._call(name, json.dumps(arguments, ensure_ascii=False))


class CallList(AnswerReader):
    """tool_choice required: the whole answer is a JSON list of {"name", "parameters"}
    (guided), read once complete; text that is not such a list (cut short by max_tokens)
    stays content."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        return []

    def close(self) -> list[Delta]:
        try:
            calls = json.loads(self.text)
        except ValueError:
            calls = None
        if not isinstance(calls, list) or not calls or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and
                isinstance(c.get("parameters"), dict) for c in calls):
            return [Delta(self.text)] if self.text else []
        return [d for c in calls
                for d in self._call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))]


class NamedCall(AnswerReader):
    """A named tool_choice: the whole answer is that function's arguments (guided), sent as
    they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        if not self.calls:
            return [*self._call(self.name, ""), *([Delta(text, 0)] if text else [])]
        return [Delta(text, 0)] if text else []

    def close(self) -> list[Delta]:
        return [] if self.calls else self._call(self.name, "")


def reader(structure: Structure) -> AnswerReader:
    """The reader of an answer to a request of this structure."""
    if structure.answer is Answer.TAGGED_CALLS:
        return TaggedCalls(structure.parallel_tool_calls)
    if structure.answer is Answer.CALL_LIST:
        return CallList()
    if structure.answer is Answer.NAMED_CALL:
        return NamedCall(structure.function)
    return AnswerReader()


def message(deltas: list[Delta]) -> dict:
    """The `message` of a non-streamed answer made of these deltas: content (null when the
    answer is only calls) and tool_calls (left out when there are none)."""
    content = "".join(d.text for d in deltas if d.index is None)
    calls: list[dict] = []
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            calls.append({"id": d.id, "type": "function",
                          "function": {"name": d.name, "arguments": ""}})
        calls[d.index]["function"]["arguments"] += d.text
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def finish_reason(reason: str, calls: int) -> str:
    """OpenAI's: an answer that ended by itself with calls ends with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_json(block: str) -> tuple[str, dict] | None:
    """(name, arguments) of a block's {"name": ..., "arguments": {...}}, else None."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or \
            not isinstance(call.get("arguments", {}), dict) or \
            set(call) - {"name", "arguments"}:
        return None
    return call["name"], call.get("arguments", {})


def _tag_prefix(text: str) -> int:
    """Characters at the end of `text` that may begin OPEN."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
