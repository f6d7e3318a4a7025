"""Tools in a chat request: tool_choice, how the model's template shows tools, forced calls.

- The tools go through the model's own chat template. A template that ignores `tools` (the
  embedded SmolLM2's does) would silently drop them, so such templates get the tools as a
  Hermes-style system prompt instead, and earlier calls/results as text (`fallback_messages`).
- The output convention (Hermes `<tool_call>` or Llama-3.1 JSON) is read off the rendered
  template once per tokenizer (`TemplateInfo`).
- tool_choice "required" or a named function constrains decoding to one call of an allowed
  tool, with the tool's parameter schema (`forced_call_grammar`).
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from engine.text.structured import json_in_lark
from server.core.errors import bad_request
from server.openai.protocol import ChatCompletionRequest, NamedToolChoice
from server.openai.tool_parser import HERMES, LLAMA3_JSON

_PROBE_MESSAGES = [{"role": "user", "content": "ping"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "fdserve_probe", "description": "probe", "parameters": {"type": "object", "properties": {}}}}]


@dataclass(frozen=True)
class TemplateInfo:
    supports_tools: bool
    style: str

    @staticmethod
    def detect(tokenizer: Any) -> TemplateInfo:
        try:
            plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=None, add_generation_prompt=True)
            with_tools = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True)
        except ValueError:
            return TemplateInfo(False, HERMES)
        supports = with_tools != plain and "fdserve_probe" in with_tools
        if supports and "<tool_call>" not in with_tools and "<|start_header_id|>" in with_tools:
            return TemplateInfo(True, LLAMA3_JSON)
        return TemplateInfo(supports, HERMES)


_template_info: weakref.WeakKeyDictionary[Any, TemplateInfo] = weakref.WeakKeyDictionary()  # per tokenizer object
_template_lock = threading.Lock()


def template_info(tokenizer: Any) -> TemplateInfo:
    with _template_lock:
        info = _template_info.get(tokenizer)
        if info is None:
            info = _template_info[tokenizer] = TemplateInfo.detect(tokenizer)
        return info


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # for the template; None when tools are off
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None
    style: str

    @property
    def parse_calls(self) -> bool:
        return self.tools is not None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(req: ChatCompletionRequest, info: TemplateInfo) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        names = {t["function"]["name"] for t in tools}
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                              "tool_choice")
        return ToolPlan(tools, "named", choice.function.name, info.style)
    mode = choice or ("auto" if tools else "none")
    if mode == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool in tools", "tool_choice")
    if mode == "none" or not tools:
        return ToolPlan(None, "none", None, info.style)
    return ToolPlan(tools, mode, None, info.style)


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    # Each function object as compact JSON, one a line: a coding agent's 25 tools take 3,958 tokens so,
    # against 4,662 as whole tool entries with the default separators (all of it prefilled on every new prompt).
    lines = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in tools)
    return ("You can call functions. Their signatures, as JSON schemas, are between <tools> and </tools>:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call a function, reply with a JSON object holding its name and arguments between "
            "<tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {"<argument>": <value>}}\n</tool_call>')


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Tools, calls and results as plain text, for templates that ignore them."""
    out = []
    for message in messages:
        msg = dict(message)
        if msg.get("tool_calls"):
            calls = "".join(
                "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": _arguments_object(c["function"].get("arguments"))},
                                               ensure_ascii=False) + "\n</tool_call>"
                for c in msg.pop("tool_calls"))
            msg["content"] = ((msg.get("content") or "") + calls).strip("\n")
        if msg.get("role") == "tool":
            msg["content"] = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
        out.append(msg)
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def forced_call_grammar(plan: ToolPlan) -> str:
    """A Lark grammar (llguidance) for exactly one call of the allowed tool(s)."""
    assert plan.tools and plan.forced
    arguments_key = "parameters" if plan.style == LLAMA3_JSON else "arguments"
    tools = [t for t in plan.tools if plan.named is None or t["function"]["name"] == plan.named]
    schemas = [_call_schema(t, arguments_key) for t in tools]
    call = json_in_lark(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    if plan.style == LLAMA3_JSON:
        return f"start: call\ncall: {call}\n"
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'
