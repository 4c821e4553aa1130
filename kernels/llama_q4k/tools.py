"""Tool calling for served model programs: OpenAI `tools` rendered through the model's own chat
template, and tool calls parsed back out of what the model wrote.

Formats, told apart by the chat template:
- "hermes" (Qwen 2.5/3, Hermes, and the fallback): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`
- "llama3" (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`.

A template that knows no tools (no `tools` variable in it) gets the tools and the hermes
instructions in a system message, its assistant tool calls written as hermes blocks and tool
results as user turns. `tool_choice` "required" or a named function makes the reply start with
the call's opening (and, for a named function without parameters, the whole call): the model
writes only what is left.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "mistral", "llama3")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def format_of(template: str | None) -> str:
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def knows_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def _arguments(raw: Any) -> Any:
    """Arguments as a template wants them: a dict where the client sent JSON text."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _hermes_block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the file's chat template."""
    out: list[dict[str, Any]] = []
    native = knows_tools(template)
    for message in messages:
        m = dict(message)
        calls = m.get("tool_calls") or []
        if calls:
            m["tool_calls"] = [
                {**c, "function": {**c.get("function", {}), "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                for c in calls
            ]
        if not native and calls:
            blocks = [_hermes_block(c["function"].get("name", ""), c["function"]["arguments"]) for c in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *blocks]))}
        elif not native and m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    described = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    instructions = (
        "You may call one or more of these functions to help with the user's request:\n"
        f"<tools>\n{described}\n</tools>\n"
        "To call one, reply with a JSON object of its name and arguments inside tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out, {}


def forced_start(tool_choice: Any, tools: list[dict[str, Any]], fmt: str) -> tuple[str, bool]:
    """(text the reply must start with, whether that text is the whole call). Empty for "auto"
    and "none"."""
    if tool_choice in (None, "auto", "none"):
        return "", False
    opener = {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS] [", "llama3": ""}[fmt]
    if tool_choice == "required":
        return opener, False
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
    name = (tool_choice.get("function") or {}).get("name")
    spec = next((t.get("function", {}) for t in tools if t.get("function", {}).get("name") == name), None)
    if spec is None:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    key = "parameters" if fmt == "llama3" else "arguments"
    start = opener + json.dumps({"name": name})[:-1] + f', "{key}": '
    params = spec.get("parameters") or {}
    if not params.get("properties") and not params.get("required"):
        closer = {"hermes": "{}}\n</tool_call>", "mistral": "{}}]", "llama3": "{}}"}[fmt]
        return start + closer, True
    return start, False


def _calls_from_json(value: Any, key: str) -> list[ToolCall]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get(key, item.get("arguments", item.get("parameters", {})))
        calls.append(ToolCall(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(the reply's text outside any calls, or None if nothing is left; the calls). Text that
    holds no well-formed call is all content."""
    if fmt == "mistral" and "[TOOL_CALLS]" in text:
        before, _, after = text.partition("[TOOL_CALLS]")
        try:
            value, end = json.JSONDecoder().raw_decode(after.strip())
        except json.JSONDecodeError:
            return text, []
        calls = _calls_from_json(value, "arguments")
        rest = (before + after.strip()[end:]).strip()
        return (rest or None, calls) if calls else (text, [])
    if fmt == "llama3":
        body = text.split("<|python_tag|>", 1)[-1].strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        calls = _calls_from_json(value, "parameters")
        return (body[end:].strip() or None, calls) if calls else (text, [])
    calls: list[ToolCall] = []
    pieces = []
    last = 0
    for match in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL):
        try:
            value = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        found = _calls_from_json(value, "arguments")
        if found:
            calls += found
            pieces.append(text[last : match.start()])
            last = match.end()
    if not calls:
        return text, []
    rest = ("".join(pieces) + text[last:]).strip()
    return rest or None, calls
