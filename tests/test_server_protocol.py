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


def test_nulls_mean_defaults_and_unknown_fields_are_kept_for_logging():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "n": None, "stop": None, "temperature": None, "best_of": 3}
    )
    assert (req.n, req.stop_strings, req.temperature) == (1, [], None)
    assert req.unknown_fields() == ["best_of"]


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
