"""Tool calling on /v1/chat/completions: the prompt, the grammar, and the calls parsed back.

The convention (docs/STRUCTURED_OUTPUT.md): a call is written as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, as Hermes- and Qwen-style chat templates ask. A chat template that takes
`tools` gets them and writes its own instructions; for one that does not, a system message
describes the functions and this convention.

- tool_choice "auto": the model writes text, calls, or both; complete blocks that name a
  tool and hold a JSON object of arguments become `tool_calls`, the rest stays content.
- "required" or a named function: the output is one or more blocks (exactly one without
  parallel_tool_calls, or for a named function) whose JSON the grammar holds to the function's
  parameters schema, so the arguments always validate.
- "none": tools are left out of the prompt and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from engine import JSON_STYLE, GrammarSpec
from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, Tool
from server.structured import check_schema_depth, closed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSetup:
    tools: list[Tool]
    mode: str
    """auto, required, or named (`function` must be called)."""
    parallel: bool
    function: str | None = None

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}


def tool_setup(req: ChatCompletionRequest) -> ToolSetup | None:
    """What the request's tools and tool_choice ask for (None: no tool calls); 400s for a
    choice that names no tool."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    check_tools(tools)
    names = [t.function.name for t in tools]
    if choice == "none":
        return None
    if not tools:
        raise APIError(f"tool_choice {_describe(choice)} needs tools.", 400, param="tool_choice")
    if isinstance(choice, str):
        return ToolSetup(tools, choice, req.parallel_tool_calls)
    name = choice.function.name
    if name not in names:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not among the tools.",
            400,
            param="tool_choice",
            code="unknown_tool",
        )
    return ToolSetup(tools, "named", False, name)


def check_tools(tools: list[Tool]) -> None:
    """400 (param tools) unless the names are unique and each function's parameters describe
    an object."""
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError("Tool names must be unique.", 400, param="tools")
    for tool in tools:
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise APIError(
                f"The parameters of {tool.function.name!r} must be the JSON schema of an "
                "object (the arguments).",
                400,
                param="tools",
            )


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def tool_grammar(setup: ToolSetup, number_digits: int = 0) -> GrammarSpec | None:
    """The grammar that enforces "required" or a named function (None for auto): blocks
    whose JSON is one allowed function's call, each function a %json rule of its own (so the
    `$defs` its parameters refer to stay at the root of its schema)."""
    if setup.mode == "auto":
        return None
    rules = []
    for tool in setup.tools:
        if setup.mode == "named" and tool.function.name != setup.function:
            continue
        check_schema_depth(tool.function.parameters, "tools")
        params = dict(closed(tool.function.parameters or _NO_ARGUMENTS))
        params.setdefault("type", "object")
        defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            **defs,
            "x-guidance": JSON_STYLE,
        }
        rules.append(f"fn{len(rules)}: %json {json.dumps(schema)}")
    more = ' ("\\n" call)*' if setup.parallel else ""
    alternatives = " | ".join(f"fn{i}" for i in range(len(rules)))
    lark = "\n".join(
        [f"start: call{more}", f'call: "{OPEN}\\n" ({alternatives}) "\\n{CLOSE}"', *rules]
    )
    return GrammarSpec("lark", lark + "\n", "tools", number_digits)  # JSON between the tags


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` argument itself."""
    return bool(template) and "tools" in str(template)


def tool_instructions(setup: ToolSetup) -> str:
    lines = [
        "You can call these functions (JSON schemas of their arguments):",
        *(
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description or "",
                    "parameters": t.function.parameters or _NO_ARGUMENTS,
                }
            )
            for t in setup.tools
        ),
        "To call a function, reply with a block like this, one per call:",
        f'{OPEN}\n{{"name": "<function name>", "arguments": {{<the arguments>}}}}\n{CLOSE}',
    ]
    if setup.mode == "auto":
        lines.append("If no function is needed, answer in text.")
    return "\n".join(lines)


def as_template_tools(setup: ToolSetup) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json", exclude_none=True) for t in setup.tools]


def render_tool_turns(message: ChatMessage, native: bool) -> dict[str, Any]:
    """A message's tool fields for the chat template: as they are for a template that knows
    tools (arguments decoded to objects, as Hugging Face templates expect), or written into
    the content in the convention above for one that does not."""
    entry: dict[str, Any] = {}
    if message.tool_calls:
        calls = [
            {"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}
            for c in message.tool_calls
        ]
        if native:
            entry["tool_calls"] = [
                {"type": "function", "id": c.id, "function": call}
                for c, call in zip(message.tool_calls, calls, strict=True)
            ]
        else:
            blocks = "\n".join(f"{OPEN}\n{json.dumps(call)}\n{CLOSE}" for call in calls)
            entry["content"] = (message.text() + "\n" + blocks).lstrip("\n")
    if native and message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    elif not native and message.role == "tool":  # many templates take no "tool" role
        entry["role"] = "user"
        entry["content"] = f"<tool_response>\n{message.text()}\n</tool_response>"
    return entry


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call(data: Any, names: set[str]) -> dict[str, Any] | None:
    """A block's JSON as a call in the OpenAI shape, or None if it is not a well-formed call."""
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


_DECODER = json.JSONDecoder()


def _block(rest: str, start: int, final: bool) -> tuple[int, Any] | None:
    """The block opened at rest[start]: (its end, its JSON) when it is one JSON value then
    CLOSE, (end, None) when it is not (it ends at the first CLOSE, or with the text), None
    while it may still become one. The JSON is read first: its strings may hold CLOSE."""
    i = start + len(OPEN)
    while i < len(rest) and rest[i].isspace():
        i += 1
    try:
        data, j = _DECODER.raw_decode(rest, i)
    except json.JSONDecodeError:  # not yet complete, or never
        if not final:
            return None
    else:
        while j < len(rest) and rest[j].isspace():
            j += 1
        if rest.startswith(CLOSE, j):
            return j + len(CLOSE), data
        if not final and CLOSE.startswith(rest[j:]):
            return None
    end = rest.find(CLOSE, start)
    if end < 0:
        return None if not final else (len(rest), None)
    return end + len(CLOSE), None


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that may still grow into OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class ToolCallParser:
    """Splits a choice's text, as it streams, into content and complete tool calls."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.text = ""
        self.done = 0
        """Characters of `text` already released as content or calls."""
        self.calls: list[dict[str, Any]] = []
        self._after_call = False
        """Whitespace is dropped until text follows a call (the line breaks between calls)."""

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """New content to release and newly completed calls (`final`: the text is whole)."""
        self.text += delta
        content, calls = "", []
        while True:
            rest = self.text[self.done :]
            start = rest.find(OPEN)
            if start < 0:
                release = len(rest) - (0 if final else _partial_open(rest))
                content += self._content(rest[:release])
                self.done += release
                break
            content += self._content(rest[:start])
            block = _block(rest, start, final)
            if block is None:  # the block is still being written
                self.done += start
                break
            end, data = block
            call = _call(data, self.setup.names)
            if call is None:
                content += self._content(rest[start:end])
            else:
                if self.setup.parallel or not (self.calls or calls):
                    calls.append(call)
                self._after_call = True
            self.done += end
        self.calls.extend(calls)
        return content, calls

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


def parse_tool_calls(text: str, setup: ToolSetup) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output: its content (None when there is none) and its tool calls."""
    content, calls = ToolCallParser(setup).feed(text, final=True)
    return (content if content.strip() or not calls else None), calls
