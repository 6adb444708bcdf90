"""Property-based fuzzing of both POST endpoints from the app's own OpenAPI schema.

schemathesis turns the served /openapi.json into hypothesis strategies: bodies that fit the
schema (positive) and bodies that break it (negative). Whatever comes, the answer is a 200 with
a well-formed body or a 4xx in the OpenAI error shape; never a 5xx. Generation is derandomized
(fixed seed) so CI sees the same cases every run. A short context and a small per-request token
cap keep the cost of the legal cases low: big requests are refused (400) before any work.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.robustness_helpers import HEADERS, openai_error, sse_data
from tests.server_helpers import Served, serve

VOCAB = 320
"""The tiny models' vocabulary (tests/tiny_models.py)."""
RUNS = [  # (endpoint, generation mode, tame the prompt, examples)
    ("/v1/completions", GenerationMode.POSITIVE, True, 100),
    ("/v1/completions", GenerationMode.POSITIVE, False, 50),
    ("/v1/completions", GenerationMode.NEGATIVE, False, 50),
    ("/v1/chat/completions", GenerationMode.POSITIVE, False, 100),
    ("/v1/chat/completions", GenerationMode.NEGATIVE, False, 50),
]


@pytest.fixture(scope="module")
def served(tiny_dirs) -> Iterator[Served]:
    yield from serve(
        tiny_dirs,
        model__max_model_len=96,
        cache__num_blocks=64,
        server__max_request_tokens=192,
        scheduler__max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def schema(served) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def _check(response: schemathesis.Response) -> str:
    """Assert the response is well formed; return a label for the tally."""
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        error = openai_error(status, response.json())
        return f"{status} {error['code'] or error['param'] or ''}".strip()
    assert status == 200, status
    if response.headers["content-type"][0].startswith("text/event-stream"):
        events = sse_data(response.text.split("\n"))
        # schemathesis stops reading a long stream (a client leaving: the server aborts it).
        if not response.stream_cut_short:
            assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(event) for event in events if event != "[DONE]"]
        assert chunks and all("error" not in chunk for chunk in chunks), chunks
        return "200 stream cut short" if response.stream_cut_short else "200 stream"
    body = response.json()
    assert body["choices"], body
    reasons = ("stop", "length", "tool_calls")
    assert all(c["finish_reason"] in reasons for c in body["choices"]), body
    return "200"


def _tame(case: schemathesis.Case) -> schemathesis.Case:
    """Make a schema-valid prompt also one the model takes (no empty text, ids in the
    vocabulary), so that most cases reach generation with their random sampling options."""
    body = case.body
    if isinstance(body, dict) and "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            body["prompt"] = prompt or "x"
        elif prompt and all(isinstance(p, int) for p in prompt):
            body["prompt"] = [abs(t) % VOCAB for t in prompt]
        elif prompt and all(isinstance(p, list) for p in prompt):
            body["prompt"] = [[abs(t) % VOCAB for t in ids] or [5] for ids in prompt]
        elif prompt:
            body["prompt"] = [text or "x" for text in prompt]
        else:
            body["prompt"] = "x"
    return case


@pytest.mark.parametrize(("path", "mode", "tame", "examples"), RUNS)
def test_fuzzed_requests_never_get_a_5xx(served, schema, path, mode, tame, examples):
    tally: Counter[str] = Counter()
    session = requests.Session()
    session.headers.update(HEADERS)
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy.map(_tame) if tame else strategy)
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(base_url=served.url, session=session, timeout=60)
        try:
            tally[_check(response)] += 1
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrequest body: {case.body!r}") from None

    fuzz()
    session.close()
    name = f"{path} {mode}{' tamed' if tame else ''}"
    print(f"\nfuzz {name}: {sum(tally.values())} cases {dict(sorted(tally.items()))}")
    assert sum(tally.values()) >= examples // 2  # hypothesis really ran the cases
    served.wait_idle(timeout=5)


# Structured output's fields hold free-form JSON schemas, regexes and grammars: the OpenAPI
# strategies above rarely put one together, so these are generated on purpose.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "properties", "items", "enum", "required", "pattern", "x"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
_TYPES = st.sampled_from(["object", "string", "integer", "array", "boolean", "nope"])
_SCHEMA = st.fixed_dictionaries({"type": _TYPES}, optional={"properties": _JSON, "items": _JSON})
_TEXT = st.text(alphabet="ab()[]|*+?{}:\"' \n0-9%start", max_size=24)
_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"])}, optional={"parameters": _SCHEMA | _JSON}
    )}
)  # fmt: skip
_FIELDS = st.one_of(
    st.fixed_dictionaries(
        {
            "response_format": st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["json_schema", "json_object", "text", "xml"]),
                    "json_schema": st.fixed_dictionaries(
                        {"name": st.just("x")}, optional={"schema": _SCHEMA | _JSON}
                    ),
                }
            )
        }
    ),  # fmt: skip
    st.fixed_dictionaries(
        {
            "structured_outputs": st.fixed_dictionaries(
                {},
                optional={
                    "json": _SCHEMA | _JSON,
                    "regex": _TEXT,
                    "choice": st.lists(st.text(max_size=4), max_size=3),
                    "grammar": _TEXT,
                },
            )
        }
    ),  # fmt: skip
    st.fixed_dictionaries({"guided_regex": _TEXT}),
    st.fixed_dictionaries({"guided_grammar": _TEXT}),
    st.fixed_dictionaries({"guided_json": _JSON}),
    st.fixed_dictionaries(
        {"tools": st.lists(_TOOL, max_size=2)},
        optional={
            "tool_choice": st.sampled_from(["none", "auto", "required", "bad"])
            | st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])}),
                }
            ),
            "parallel_tool_calls": st.booleans(),
        },
    ),  # fmt: skip
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_structured_output_fields_never_get_a_5xx(served, path):
    tally: Counter[str] = Counter()
    session = requests.Session()
    session.headers.update(HEADERS)

    @settings(max_examples=80, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(fields=_FIELDS, stream=st.booleans())
    def fuzz(fields: dict, stream: bool) -> None:
        body = {"model": "tiny", "max_tokens": 24, "stream": stream, **fields}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "hi"
        response = session.post(f"{served.url}{path}", json=body, timeout=60)
        try:
            tally[_check(schemathesis.Response.from_requests(response, verify=True))] += 1
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrequest body: {body!r}") from None

    fuzz()
    session.close()
    print(f"\nfuzz structured {path}: {dict(sorted(tally.items()))}")
    assert any(label.startswith("200") for label in tally), tally  # some reach generation
    assert any(label.startswith("400") for label in tally), tally  # and some are refused
