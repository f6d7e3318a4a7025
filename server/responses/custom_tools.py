"""Freeform (`custom`) tools, such as Codex's apply_patch, shown to the model as a function call.

A custom tool takes one string, not JSON arguments. The chat pipeline's tool parsers, forced
calls and templates all speak functions, so the tool is presented as a function with a single
string argument, `input`, whose description carries the tool's own description and grammar;
the call that comes back is unwrapped into a `custom_tool_call` item with that string.
"""
from __future__ import annotations

import json

from server.openai.protocol import FunctionDefinition
from server.responses.protocol import CustomTool

CUSTOM_INPUT_KEY = "input"


def custom_tool_definition(tool: CustomTool) -> FunctionDefinition:
    about = "The tool's whole input, as one string."
    spec = tool.format
    if spec is not None and spec.type == "grammar" and spec.definition:
        about += f" It must follow this {spec.syntax or 'lark'} grammar:\n{spec.definition}"
    parameters = {"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string", "description": about}},
                  "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}
    return FunctionDefinition(name=tool.name, description=tool.description, parameters=parameters)


def _loads_cut_off(arguments: str) -> object | None:
    """The arguments' JSON, also when the output budget cut the call inside its string."""
    for ending in ("", '"}', '\\"}'):
        try:
            value: object = json.loads(arguments + ending)
            return value
        except ValueError:
            continue
    return None


def custom_input(arguments: str) -> str:
    """The string a custom call carries, out of the function-call arguments the model wrote."""
    value = _loads_cut_off(arguments) if arguments else {}
    if value is None:
        return arguments  # not JSON: the text as written
    if isinstance(value, dict) and CUSTOM_INPUT_KEY in value:
        value = value[CUSTOM_INPUT_KEY]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
