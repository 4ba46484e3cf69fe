"""Tool calling: the tools shown to the model, a grammar for the calls it must make, and
the calls read back out of its text.

A chat template that knows tools (one that reads `tools`) renders them itself. One that
does not, SmolLM2's among them, gets them the way Hermes-style templates write them: a
system section listing each function's JSON schema inside <tools></tools>, the calls the
model makes as JSON objects inside <tool_call></tool_call>, and a tool's answer as a user
turn inside <tool_response></tool_response>.

`tool_choice` "required" or a function's name constrains the output by grammar to calls
matching the functions' parameter schemas (`call_grammar`); "auto" lets the model choose,
and any call it writes is parsed out of its text (`ToolCallText`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Sequence

from protos import specserve_pb2 as pb
from runtime.errors import InvalidArgument

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
TEMPLATE_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role, which templates know


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


def functions(tools: Sequence[pb.Tool]) -> list[Function]:
    """The request's tools, checked: unique names, parameters a JSON object schema."""
    found, seen = [], set()
    for i, tool in enumerate(tools):
        if not tool.name or tool.name in seen:
            raise InvalidArgument(f"tools[{i}].function.name", "must be a name not given to another tool")
        seen.add(tool.name)
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"tools[{i}].function.parameters", f"is not JSON: {e}") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters", "must be a JSON schema object")
        found.append(Function(tool.name, tool.description, parameters))
    return found


def check_choice(choice: str, tools: Sequence[Function]) -> str:
    """The tool choice ("" means auto); a function's name must be one of the tools'."""
    choice = choice or "auto"
    if choice not in ("none", "auto", "required") and choice not in {f.name for f in tools}:
        raise InvalidArgument("tool_choice", f"names no tool of the request: {choice!r}")
    if choice in ("auto", "required") and not tools:
        raise InvalidArgument("tool_choice", f"{choice!r} needs tools")
    return choice


def template_messages(messages: Sequence[pb.ChatMessage], tools: Sequence[Function],
                      template_knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools to hand it (None: the
    tools are written into the messages here)."""
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    if not tools:
        return rendered, None
    specs = [{"type": "function", "function": {"name": f.name, "description": f.description,
                                               "parameters": f.parameters}} for f in tools]
    if template_knows_tools:
        return rendered, specs
    section = SYSTEM_SECTION.format(tools="\n".join(json.dumps(s) for s in specs))
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{section}"}
    else:
        rendered.insert(0, {"role": "system", "content": section})
    return rendered, None


def _message(m: pb.ChatMessage, index: int) -> dict:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    content = m.content
    if m.tool_calls:
        calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': _arguments(c, index, j)})}"
                          f"\n{CLOSE}" for j, c in enumerate(m.tool_calls))
        content = f"{content}\n{calls}" if content else calls
    return {"role": TEMPLATE_ROLES.get(m.role, m.role), "content": content}


def _arguments(call: pb.ToolCall, message: int, index: int) -> dict:
    """A call's arguments sent back in the conversation: a JSON object (else an INVALID_ARGUMENT
    naming them, not a JSONDecodeError out of the router)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"messages[{message}].tool_calls[{index}].arguments",
                              "must be a JSON object, as JSON text")
    return arguments


def call_grammar(tools: Sequence[Function], choice: str, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of the output when it must call: one call (or,
    `parallel`, several) of the named function or of any of the tools, each a JSON object
    whose `name` is the function's and whose `arguments` its parameter schema validates."""
    schema = call_schema(tools, choice)
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'


def call_schema(tools: Sequence[Function], choice: str = "required") -> dict:
    """The JSON schema of one call: of the named function, or (`required`) of any of the tools."""
    named = [f for f in tools if choice in ("required", f.name)]
    return {"oneOf": [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False} for f in named]}


def parse_calls(text: str) -> tuple[str, list[pb.ToolCall]]:
    """The text outside <tool_call> blocks, and the calls inside them (a block whose JSON is
    not a call is left in the text)."""
    content, calls, rest = [], [], text
    while (start := rest.find(OPEN)) >= 0:
        end = rest.find(CLOSE, start)
        if end < 0:
            break
        call = _call(rest[start + len(OPEN):end])
        if call is None:
            content.append(rest[:end + len(CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(CLOSE):]
    content.append(rest)
    return "".join(content).strip(), calls


def _call(body: str) -> pb.ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return pb.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=value["name"], arguments=json.dumps(arguments))


class ToolCallText:
    """A request's streamed text when it may call tools: the text before the first call
    streams as it comes; from a <tool_call> on it is held, to be read as calls at the end.
    As much as could still become the opening tag is held back too."""

    def __init__(self):
        self.held, self.calling = "", False

    def add(self, delta: str) -> str:
        """The part of `delta` that is text for the client now."""
        self.held += delta
        if self.calling:
            return ""
        start = self.held.find(OPEN)
        if start >= 0:
            out, self.held, self.calling = self.held[:start], self.held[start:], True
            return out
        keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self.held.endswith(OPEN[:n])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str, list[pb.ToolCall]]:
        """The text still held that is not a call, and the calls."""
        if not self.calling:
            out, self.held = self.held, ""
            return out, []
        return parse_calls(self.held)
