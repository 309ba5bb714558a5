"""Tool calling in the chat API: the request's tools and tool_choice, checked, and what they ask of
the output.

`tool_mode` reads `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's rules: no choice
means "auto" with tools, "none" without). "auto" reads calls in the model's own format with the
server's `--tool-call-parser`; "required" and a named function are enforced by a constraint
(`constraint`), so even a small model's call parses: the model writes bare JSON, an array of
`{"name", "parameters"}` objects or the named function's arguments (`constraint_schema`).
A harmony model (gpt-oss, `--reasoning-parser openai_gptoss`) writes its calls in its own
channels under every choice: its constraint is a grammar of a harmony call
(tool_parsers/openai.py), read by the harmony call parser. `constrain` is where the constraint
becomes the request's structured-output constraint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from conveyor.frontend.tool_parsers import (
    TOOL_PARSERS,
    JsonArrayParser,
    NamedCallParser,
    ToolParser,
)
from conveyor.frontend.tool_parsers.openai import OpenAIParser, call_grammar
from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs, from_json_schema

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    choice: str                              # none | auto | required | named
    tools: tuple[dict, ...] = ()             # the functions: {"name", "parameters", ...}
    name: str | None = None                  # the named function
    parser: str | None = None                # auto: the --tool-call-parser
    parallel: bool = True                    # more than one call allowed
    harmony: bool = False                    # calls are harmony messages (gpt-oss)

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's output (None: the output is plain content). The server's
        parser gets the tools: a format may type its arguments by their schemas."""
        if self.choice == "none":
            return None
        if self.harmony:
            return OpenAIParser(self.tools)
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser](self.tools)
        if self.choice == "required":
            return JsonArrayParser()
        if self.choice == "named":
            return NamedCallParser(self.name)
        return None


def tool_mode(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool,
              parser: str | None, harmony: bool = False) -> ToolMode:
    """The request's ToolMode, or ValueError naming the field that is wrong. `parser` is the
    server's --tool-call-parser when --enable-auto-tool-choice is on, else None; `harmony`:
    the server reads gpt-oss's channels."""
    functions = tuple(_function(i, t) for i, t in enumerate(tools or ()))
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolMode("none", functions, harmony=harmony)
    if not functions:
        raise ValueError("tool_choice needs tools: the request has none")
    if tool_choice == "auto":
        if parser is None:
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and '
                             '--tool-call-parser to be set on the server')
        return ToolMode("auto", functions, parser=parser, parallel=parallel, harmony=harmony)
    if tool_choice == "required":
        return ToolMode("required", functions, parallel=parallel, harmony=harmony)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return ToolMode("named", functions, name=name, parallel=False, harmony=harmony)
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got '
                     f'{tool_choice!r}')


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
    f = tool.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ValueError(f"tools[{i}].function must be an object with a name")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return f


def constraint_schema(mode: ToolMode) -> dict | None:
    """The JSON schema the output must follow (None: no constraint). required: an array of
    calls, each a tool's name and its parameters (one call without parallel_tool_calls); named:
    the function's parameters."""
    if mode.choice == "named":
        f = next(f for f in mode.tools if f["name"] == mode.name)
        return f.get("parameters") or _ANY_OBJECT
    if mode.choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters") or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for f in mode.tools]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not mode.parallel:
        schema["maxItems"] = 1
    return schema


def constraint(mode: ToolMode) -> StructuredOutputs | None:
    """What holds the output to the choice's call (None: nothing): a harmony call's grammar, or
    `constraint_schema` as JSON."""
    if mode.choice not in ("required", "named"):
        return None
    if mode.harmony:
        return StructuredOutputs(grammar=call_grammar(
            [f for f in mode.tools if mode.choice == "required" or f["name"] == mode.name]))
    return from_json_schema(constraint_schema(mode))


def constrain(params: SamplingParams, mode: ToolMode) -> SamplingParams:
    """The sampling params with the output held to the choice's call by the structured-output
    backend; ValueError if the request already has a constraint of its own."""
    so = constraint(mode)
    if so is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError('tool_choice "required" or a named function cannot be combined with '
                         'response_format or another structured-output constraint')
    return msgspec.structs.replace(params, structured_outputs=so)


def history_tool_calls(calls: list, where: str) -> list[dict]:
    """An assistant message's tool_calls as chat templates expect them: arguments as an object
    (they come as a JSON string from OpenAI clients)."""
    out = []
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must have a function with a name")
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments is not valid "
                                 f"JSON") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object")
        out.append({**call, "type": call.get("type", "function"),
                    "function": {**f, "arguments": args}})
    return out
