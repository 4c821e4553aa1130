"""Tool calls for served model programs (kernels/llama_q4k/tools.py): parsed out of the three
output formats, and rendered through a chat template that knows tools or one that does not."""

from __future__ import annotations

import json

import pytest

from kernels.llama_q4k.tools import forced_start, format_of, parse_tool_calls, prepare_messages

CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
     None, [("a", {}), ("b", {"x": 1})]),
    ("hermes", "<tool_call>not json</tool_call> plain", "<tool_call>not json</tool_call> plain", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ("llama3", '{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("llama3", "The answer is 42.", "The answer is 42.", []),
])
def test_calls_are_parsed_from_each_format(fmt, text, content, calls) -> None:
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_format_follows_the_template() -> None:
    assert format_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert format_of("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert format_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert format_of(None) == "hermes"


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    shaped, extra = prepare_messages(messages, [WEATHER], "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert extra == {}
    assert shaped[0]["role"] == "system" and "get_weather" in shaped[0]["content"] and "<tool_call>" in shaped[0]["content"]
    assert shaped[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert shaped[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, extra = prepare_messages(messages, [WEATHER], "{% if tools %}{{ tools | tojson }}{% endif %}")
    assert extra == {"tools": [WEATHER]} and native[0]["role"] == "user"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates take a dict


def test_a_required_or_named_tool_choice_starts_the_reply() -> None:
    assert forced_start("auto", [CLOCK], "hermes") == ("", False)
    assert forced_start("required", [CLOCK], "mistral") == ("[TOOL_CALLS] [", False)
    whole, complete = forced_start({"type": "function", "function": {"name": "get_time"}}, [CLOCK, WEATHER], "hermes")
    assert complete and parse_tool_calls(whole, "hermes")[1][0].name == "get_time"
    start, complete = forced_start({"type": "function", "function": {"name": "get_weather"}}, [CLOCK, WEATHER], "llama3")
    assert not complete and start == '{"name": "get_weather", "parameters": '
    with pytest.raises(ValueError):
        forced_start({"type": "function", "function": {"name": "missing"}}, [CLOCK], "hermes")
