"""The chat template with tools: OpenAI's function tools, assistant turns that called them and
the tools' results render as Qwen's own template renders them (its tools section,
<tool_call> and <tool_response> blocks)."""

from __future__ import annotations

import json

import pytest

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.errors import InputError
from qvl_trt.mm.chat import PromptBuilder

TOOL = {"type": "function", "function": {
    "name": "weather", "description": "The weather.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "weather", "arguments": {"city": "Lyon"}}}]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": None, "tool_calls": CALLS},  # as OpenAI sends it
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]}]


@pytest.fixture(scope="module")
def prompts(tiny_ckpt) -> PromptBuilder:
    ckpt = open_checkpoint(tiny_ckpt)
    return PromptBuilder.from_checkpoint(ckpt.path, ckpt.token_ids)


def test_tools_calls_and_results_render_as_qwens_template_renders_them(prompts) -> None:
    text, images, videos = prompts.render(CHAT, [TOOL])
    # The template's own rendering of the same chat (content null is no text to it; strict
    # is OpenAI's flag, not part of what the model was trained to read).
    plain = {**TOOL, "function": {k: v for k, v in TOOL["function"].items() if k != "strict"}}
    hf = prompts.tokenizer.apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in CHAT], tools=[plain], tokenize=False,
        add_generation_prompt=True)
    assert text == hf and (images, videos) == (0, 0)
    assert json.dumps(plain) in text  # the tools section lists the function as JSON
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "weather", "arguments": {"city": '
            '"Lyon"}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
            "rain\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "# Tools" not in prompts.render(CHAT)[0]  # no tools: no tools section


@pytest.mark.parametrize("tools, words", [
    ([{"type": "file_search"}], "only function tools are supported"),
    ("weather", "tools must be a JSON list"),
    ([{"type": "function", "function": {"description": "x"}}], "has no function name"),
])
def test_tools_the_template_cannot_list_are_refused(prompts, tools, words) -> None:
    with pytest.raises(InputError, match=words):
        prompts.render(CHAT[:2], tools)
