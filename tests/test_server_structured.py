"""Structured output and tool calls through the real server and the official openai client,
with speculation on (the tiny draft model, and n-gram lookup)."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server.tools import ToolCallParser, ToolSetup, parse_tool_calls
from tests.server_helpers import MODEL, error_of, serve
from tests.tiny_models import DRAFT_SHAPE, build_model

PROMPTS = [
    "Describe a pet as JSON.",
    "Another pet, please.",
    "def add(a, b):",
    "The quick brown fox",
    "Héllo wörld ✓",
    "for i in range(10):",
]


class Pet(BaseModel):
    name: str = Field(pattern=r"^[a-z]{1,8}$")
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


class Weather(BaseModel):
    city: str = Field(pattern=r"^[A-Z][a-z]{0,9}$")
    unit: Literal["celsius", "fahrenheit"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": Weather.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {"name": "adopt", "parameters": Pet.model_json_schema()},
    },
]


@pytest.fixture(scope="module")
def long_dirs(tiny_dirs, tmp_path_factory):
    """The tiny pair with room for tool descriptions (the tiny tokenizer spells them in about
    a thousand tokens)."""
    root = tmp_path_factory.mktemp("long")
    tokenizer = tiny_dirs["llama"]
    return {
        "llama": build_model(root / "target", max_positions=2048, tokenizer_dir=tokenizer),
        "llama_draft": build_model(
            root / "draft", seed=1, max_positions=2048, tokenizer_dir=tokenizer, **DRAFT_SHAPE
        ),
    }


@pytest.fixture(scope="module", params=["draft", "ngram"])
def served(request, long_dirs):
    yield from serve(
        long_dirs,
        speculative__method=request.param,
        model__max_model_len=2048,
        cache__num_blocks=1024,
        scheduler__max_num_batched_tokens=512,
    )


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_parse_returns_the_pydantic_model_for_every_prompt(served, stream):
    client = served.client
    for prompt in PROMPTS:
        kwargs = {"model": MODEL, "messages": _chat(prompt), "response_format": Pet}
        if stream:
            with client.chat.completions.stream(**kwargs, max_tokens=120) as events:
                for _ in events:
                    pass
                answer = events.get_final_completion()
        else:
            answer = client.chat.completions.parse(**kwargs, max_tokens=120)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", prompt
        assert isinstance(choice.message.parsed, Pet), prompt
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed
    stats = served.engine.stats()
    assert stats.spec_drafted_tokens > 0
    served.wait_idle()


def test_raw_json_schema_on_both_endpoints(served):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True},
    }
    for prompt in PROMPTS[:3]:
        chat = served.client.chat.completions.create(
            model=MODEL, messages=_chat(prompt), response_format=fmt, max_tokens=120, seed=1
        )
        Pet.model_validate_json(chat.choices[0].message.content)
        text = served.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=120, extra_body={"response_format": fmt}
        )
        Pet.model_validate_json(text.choices[0].text)
    obj = served.client.chat.completions.create(
        model=MODEL,
        messages=_chat("Any JSON object"),
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    if obj.choices[0].finish_reason == "stop":  # a random model may write a long object
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_regex_and_choice_extensions(served):
    out = served.client.completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=20,
        n=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    )
    assert {c.text for c in out.choices} <= {"yes", "no", "maybe so"}
    assert all(c.finish_reason == "stop" for c in out.choices)
    out = served.client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=30,
        extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
    )
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d", out.choices[0].text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_tool_calls_validate_against_their_parameters(served, stream):
    schemas = {"get_weather": Weather, "adopt": Pet}
    for prompt in PROMPTS[:4]:
        kwargs = {
            "model": MODEL,
            "messages": _chat(prompt),
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 200,
        }
        if stream:
            with served.client.chat.completions.stream(**kwargs) as events:
                for _ in events:
                    pass
                answer = events.get_final_completion()
        else:
            answer = served.client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        if choice.finish_reason == "length":  # the random model kept adding calls
            assert choice.message.tool_calls, prompt
            continue
        assert choice.finish_reason == "tool_calls", prompt
        assert choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            schemas[call.function.name].model_validate_json(call.function.arguments)


def test_a_named_function_is_called_once(served):
    answer = served.client.chat.completions.create(
        model=MODEL,
        messages=_chat("What is the weather?"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)


def test_auto_lets_the_model_answer_in_text(served):
    answer = served.client.chat.completions.create(
        model=MODEL, messages=_chat("Hello"), tools=TOOLS, max_tokens=12, temperature=0
    )
    choice = answer.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_earlier_tool_turns_render_in_the_prompt(served):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    answer = served.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4
    )
    assert answer.usage.prompt_tokens > 60  # the tool descriptions and both tool turns


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = _nested(70)  # past server/structured.py's MAX_SCHEMA_DEPTH (64)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS[:1] * 2}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_structured_requests_get_a_400(served, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(
            model=MODEL, messages=_chat("hi"), max_tokens=4, extra_body=body
        )
    error = error_of(info.value)
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    served.wait_idle()


# --- the tool-call parser ---------------------------------------------------------------

SETUP = ToolSetup(tools=[], mode="auto", parallel=True)
_CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def _setup(parallel: bool = True) -> ToolSetup:
    from server.protocol import Tool

    tool = Tool.model_validate({"type": "function", "function": {"name": "f"}})
    return ToolSetup([tool], "auto", parallel)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text <tool", "Just text <tool", []),
        (_CALL, None, [{"x": 1}]),
        ("Sure. " + _CALL + "\n" + _CALL, "Sure. ", [{"x": 1}, {"x": 1}]),
        (
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            [],
        ),
        ("<tool_call>{broken</tool_call> ok", "<tool_call>{broken</tool_call> ok", []),
        (
            '<tool_call>\n{"name": "f", "arguments": {"x": "a</tool_call>b"}}\n</tool_call>',
            None,
            [{"x": "a</tool_call>b"}],
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"x"',
            '<tool_call>\n{"name": "f", "arguments": {"x"',
            [],
        ),
    ],
    ids=["text", "one", "two", "unknown-name", "broken", "close-in-string", "unterminated"],
)
def test_tool_call_parser_streams_what_it_parses_whole(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, _setup())
    assert got_content == content
    assert [json.loads(c["function"]["arguments"]) for c in got_calls] == calls
    for cut in range(1, len(text)):  # streamed in two pieces, at every place
        parser = ToolCallParser(_setup())
        first, early = parser.feed(text[:cut])
        rest, late = parser.feed(text[cut:], final=True)
        assert (first + rest) == (content or ""), cut
        assert len(early) + len(late) == len(calls)
        assert "<tool_call>" not in first or content and "<tool_call>" in content


def test_without_parallel_calls_only_the_first_is_kept():
    _, calls = parse_tool_calls(_CALL + "\n" + _CALL, _setup(parallel=False))
    assert len(calls) == 1


def test_a_template_that_knows_tools_gets_them_and_the_earlier_calls(tiny_dirs):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from server.prompts import render_chat
    from server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    tok.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
        "{{ c.function.arguments.city }}]{% endfor %}{% endfor %}"
    )
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "cold"},
            ],
            "tools": TOOLS,
        }
    )
    from server.tools import tool_setup

    prompt = render_chat(SimpleNamespace(tokenizer=tok), req.messages, tool_setup(req))
    text = tok.decode(prompt.token_ids)
    assert "[tool get_weather][tool adopt]" in text  # the template's own tool format
    assert "[call get_weather Oslo]" in text  # arguments handed over as an object
    assert "<tool>cold" in text and "You can call" not in text


class Inner(BaseModel):
    kind: Literal["a", "b"]


class Outer(BaseModel):
    inner: Inner  # a $ref into the schema's $defs
    n: int = Field(ge=0, le=9)


def test_required_calls_with_nested_models_and_a_function_named_auto(served):
    tools = [
        {"type": "function", "function": {"name": "auto", "parameters": Outer.model_json_schema()}},
        TOOLS[0],
    ]
    answer = served.client.chat.completions.create(
        model=MODEL,
        messages=_chat("Go"),
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "auto"}},  # named, not "auto"
        max_tokens=200,
    )
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "auto"
    Outer.model_validate_json(call.function.arguments)


def test_schemas_with_combinators_compile_and_bad_ones_are_400s(served):
    both = {
        "type": "object",
        "allOf": [
            {"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
    }
    out = served.client.chat.completions.create(
        model=MODEL,
        messages=_chat("x"),
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": both}},
    )
    if out.choices[0].finish_reason == "stop":
        assert set(json.loads(out.choices[0].message.content)) >= {"a", "b"}
    for body, param in [
        ({"guided_json": "[" * 100_000}, "guided_json"),  # deeper than Python recurses
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),  # a language without a string
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            served.client.chat.completions.create(
                model=MODEL, messages=_chat("x"), max_tokens=4, extra_body=body
            )
        assert error_of(info.value)["param"] == param, body
    served.wait_idle()


def test_json_output_and_tool_calls_carry_the_number_digit_limit():
    """--max-json-number-digits reaches every grammar whose output is JSON (engine/sample/
    grammar.py enforces it), and no other: a regex's or a Lark grammar's digits are theirs."""
    from server.protocol import ChatCompletionRequest, CompletionRequest
    from server.structured import grammar_for
    from server.tools import tool_grammar, tool_setup

    def chat(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", messages=_chat("hi"), **fields)

    def completion(**fields) -> CompletionRequest:
        return CompletionRequest(model="m", prompt="hi", **fields)

    schema = Pet.model_json_schema()
    json_requests = [
        chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}}),
        chat(response_format={"type": "json_object"}),
        completion(guided_json=schema),
        completion(structured_outputs={"json": schema}),
    ]
    for req in json_requests:
        assert grammar_for(req, 7).number_digits == 7
        assert grammar_for(req).number_digits == 0
    for req in [completion(guided_regex="[0-9]+"), completion(guided_grammar='start: "1"+')]:
        assert grammar_for(req, 7).number_digits == 0
    setup = tool_setup(chat(tools=TOOLS, tool_choice="required"))
    assert setup is not None and tool_grammar(setup, 7).number_digits == 7


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": DEEP}}},
            "response_format",
        ),
        ({"guided_json": json.dumps(DEEP)}, "guided_json"),
        ({"guided_regex": "a" * (256 << 10) + "b"}, "guided_regex"),
        ({"guided_choice": ["x" * 1000] * 300}, "guided_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": DEEP}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
    ids=["response_format-deep", "guided_json-deep", "regex-long", "choice-long", "tools-deep"],
)
def test_grammars_past_the_size_and_depth_limits_get_a_400(served, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(
            model=MODEL, messages=_chat("hi"), max_tokens=4, extra_body=body
        )
    error = error_of(info.value)
    assert error["param"] == param, error
    assert re.search(r"the limit is \d+|more than 64 deep", error["message"]), error


def test_a_nested_schema_within_the_limit_compiles_and_a_slow_compile_is_a_400(served, monkeypatch):
    """The depth limit leaves room for real nesting; a grammar that takes longer than
    COMPILE_TIMEOUT to compile gets a 400 naming its field (not a hang, not a 500), and the
    server answers the next request."""
    import time

    from server import structured

    answer = served.client.chat.completions.create(
        model=MODEL, messages=_chat("hi"), max_tokens=4, extra_body={"guided_json": _nested(30)}
    )
    assert answer.choices[0].message.content.startswith("[")
    check = served.engine.check_grammar
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT", 0.2)
    monkeypatch.setattr(served.engine, "check_grammar", lambda spec: time.sleep(1) or check(spec))
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(
            model=MODEL, messages=_chat("hi"), max_tokens=4, extra_body={"guided_regex": "[ab]+"}
        )
    error = error_of(info.value)
    assert error["param"] == "guided_regex" and "compile within" in error["message"], error
    monkeypatch.undo()
    answer = served.client.chat.completions.create(
        model=MODEL, messages=_chat("hi"), max_tokens=4, extra_body={"guided_regex": "[ab]+"}
    )
    assert set(answer.choices[0].message.content) <= {"a", "b"}
    served.wait_idle()
