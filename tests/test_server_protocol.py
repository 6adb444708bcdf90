"""Request validation at the edge: accepted forms, defaults, and errors that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.errors import validation_message
from server.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_nulls_mean_defaults():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "n": None, "stop": None, "temperature": None, "best_of": None}
    )
    assert (req.n, req.stop_strings, req.temperature) == (1, [], None)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
FUNCTION = {"type": "function", "function": {"name": "f", "x": 1}}
SCHEMA = {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}
VLLM = {"regex": "a+", "disable_fallback": True}
CALL = {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "x": 1}}]}
UNSUPPORTED = [  # (request model, fields beside the required ones, the unsupported key)
    (CompletionRequest, {"best_of": 3}, "best_of"),
    (CompletionRequest, {"suffix": "y"}, "suffix"),
    (CompletionRequest, {"stream_options": {"x": 1}}, "stream_options.x"),
    (CompletionRequest, {"speculation": {"k": 1}}, "speculation.k"),
    (CompletionRequest, {"structured_outputs": VLLM}, "structured_outputs.disable_fallback"),
    (ChatCompletionRequest, {"store": True}, "store"),
    (ChatCompletionRequest, {"response_format": {"type": "text", "x": 1}}, "response_format.x"),
    (ChatCompletionRequest, {"response_format": SCHEMA}, "response_format.json_schema.x"),
    (ChatCompletionRequest, {"tools": [{"x": 1, **FUNCTION}]}, "tools[0].x"),
    (ChatCompletionRequest, {"tools": [FUNCTION]}, "tools[0].function.x"),
    (ChatCompletionRequest, {"tool_choice": FUNCTION}, "tool_choice.NamedToolChoice.function.x"),
    (ChatCompletionRequest, {"messages": [CALL]}, "messages[0].tool_calls[0].function.x"),
]


@pytest.mark.parametrize(("model", "fields", "where"), UNSUPPORTED)
def test_fields_the_server_does_not_implement_are_named(model, fields, where):
    base = {"prompt": "x"} if model is CompletionRequest else CHAT
    with pytest.raises(ValidationError) as info:
        model.model_validate({**base, **fields})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    message, param = validation_message(errors)
    assert f"{where}: this field is not supported" in message
    assert param.startswith(where.split(".")[0])


def test_a_chat_messages_other_keys_are_kept_for_its_template():
    message = {"role": "assistant", "content": "x", "reasoning_content": "y"}
    req = ChatCompletionRequest.model_validate({"messages": [message]})
    assert req.messages[0].model_extra == {"reasoning_content": "y"}


def test_logit_bias_keys_are_token_ids_and_values_are_bounded():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"0": -100, "17": 2.5}})
    assert req.logit_biases == ((0, -100.0), (17, 2.5))
    assert CompletionRequest(prompt="x", logit_bias={}).logit_biases == ()
    for bad in ({"017": 1}, {"-1": 1}, {" 1": 1}, {"1": 100.5}, {str(i): 1 for i in range(301)}):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate({"prompt": "x", "logit_bias": bad})
        assert info.value.errors()[0]["loc"] == ("logit_bias",)


def test_stop_accepts_a_string_or_a_list():
    assert CompletionRequest(prompt="x", stop="END").stop_strings == ["END"]
    assert CompletionRequest(prompt="x", stop=["a", "b"]).stop_strings == ["a", "b"]


def test_chat_content_parts_and_usage_option():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                },
                {"role": "assistant", "content": None},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 7,
        }
    )
    assert [m.text() for m in req.messages] == ["be brief", ""]
    assert req.include_usage and req.output_limit == 7


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_completion_fields_are_named(body, where):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    message, param = validation_message(errors)
    assert param == where and message.startswith(where)


def test_nested_locations_read_like_paths():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    message, param = validation_message(errors)
    assert param == "messages[0].role" and "wizard" in message


def test_malformed_json_message():
    message, param = validation_message(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 1),
                "msg": "JSON decode error",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert message == "Malformed JSON body: Expecting value" and param is None
