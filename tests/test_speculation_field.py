"""The `speculation` extension field: per-request control of drafting, on both endpoints,
through the real server and the official openai client, and at the planner (a request's cap
applies after the policy's choice, with its own reason)."""

from __future__ import annotations

import openai
import pytest

from engine.config import SpecConfig
from engine.spec.planner import SpecPlanner
from engine.spec.policy import REASON_REQUEST
from engine.types.request import Request, RequestStatus, SamplingParams
from tests.server_helpers import MODEL, PROMPT, error_of, serve
from tests.test_planner import ForcingGrammar, RecordingPolicy


@pytest.fixture(scope="module", params=["draft", "ngram"])
def served(request, tiny_dirs):
    yield from serve(tiny_dirs, speculative__method=request.param)


def _complete(served, speculation=None, max_tokens=12):
    body = {"ignore_eos": True}
    if speculation is not None:
        body["speculation"] = speculation
    return served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, extra_body=body
    )


def _chat(served, speculation=None):
    body = {"ignore_eos": True}
    if speculation is not None:
        body["speculation"] = speculation
    return served.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=8,
        temperature=0.0,
        extra_body=body,
    )


def _drafted(out) -> int:
    return out.usage.model_extra["speculative"]["drafted_tokens"]


def test_greedy_output_is_the_same_whatever_the_request_chooses(served):
    method = served.settings.engine.spec.method
    plain = _complete(served)
    for speculation in (
        {"method": "off"},
        {"max_draft_tokens": 1},
        {"max_draft_tokens": 0},
        {"method": "auto", "max_draft_tokens": 2},
        {"method": method},
        {},
    ):
        out = _complete(served, speculation)
        assert out.choices[0].text == plain.choices[0].text, speculation
        if speculation.get("method") == "off" or speculation.get("max_draft_tokens") == 0:
            assert _drafted(out) == 0, speculation
    if method == "draft":  # the random tiny draft always drafts; a lookup only on repeats
        assert _drafted(plain) > 0
        spec = plain.usage.model_extra["speculative"]
        by = spec["by_proposer"]  # which proposer drafted what, summing to the totals
        assert by["draft"]["drafted_tokens"] > 0 and set(by) <= {"draft", "lookup"}
        for key in ("drafted_tokens", "accepted_tokens"):
            assert sum(counts[key] for counts in by.values()) == spec[key]
        capped = _complete(served, {"max_draft_tokens": 1})
        # At most one draft a step: no more drafts than tokens, and fewer than K = 2 gives.
        assert 0 < _drafted(capped) <= 12 and _drafted(capped) < _drafted(plain)
    served.wait_idle()


def test_chat_accepts_the_field(served):
    plain = _chat(served)
    off = _chat(served, {"method": "off"})
    assert off.choices[0].message.content == plain.choices[0].message.content
    assert _drafted(off) == 0
    assert off.usage.model_extra["speculative"]["by_proposer"] == {}
    served.wait_idle()


@pytest.mark.parametrize(
    ("speculation", "param"),
    [
        ({"method": "medusa"}, "speculation.method"),
        ({"method": "suffix"}, "speculation.method"),  # known, but not this server's
        ({"max_draft_tokens": 3}, "speculation.max_draft_tokens"),  # the server's K_max is 2
        ({"max_draft_tokens": -1}, "speculation.max_draft_tokens"),
        ({"max_draft_tokens": 1.5}, "speculation.max_draft_tokens"),
        ({"max_draft_tokens": "1"}, "speculation.max_draft_tokens"),
        ({"max_draft_tokens": True}, "speculation.max_draft_tokens"),
        ({"method": "off", "max_draft_tokens": 2}, "speculation.max_draft_tokens"),
        ({"draft_tokens": 1}, "speculation.draft_tokens"),
        ({"method": 3}, "speculation.method"),
        ("off", "speculation"),
    ],
)
def test_bad_speculation_gets_a_400_naming_the_field(served, speculation, param):
    for create in (_complete, _chat):
        with pytest.raises(openai.BadRequestError) as info:
            create(served, speculation)
        error = error_of(info.value)
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error"
    served.wait_idle()


def test_an_unknown_method_is_told_what_the_server_offers(served):
    with pytest.raises(openai.BadRequestError) as info:
        _complete(served, {"method": "medusa"})
    message = error_of(info.value)["message"]
    for offered in ("auto", "off", served.settings.engine.spec.method):
        assert offered in message


def _decoding(request_id: str, prompt: list[int], cap: int | None = None) -> Request:
    req = Request(request_id, prompt, SamplingParams(max_tokens=32, max_draft_tokens=cap))
    req.num_computed_tokens = len(prompt) - 1
    req.status = RequestStatus.RUNNING
    return req


def test_the_planner_caps_k_after_the_policy_with_its_own_reason():
    plain = _decoding("p", [1, 2, 3])
    off = _decoding("o", [4, 5, 6], cap=0)
    one = _decoding("one", [7, 8, 9], cap=1)
    low = _decoding("low", [7, 8, 9], cap=3)  # the policy already chose fewer
    forced = _decoding("g", [1, 2], cap=0)
    forced.grammar = ForcingGrammar([10, 11, 12])
    forced_one = _decoding("g1", [1, 2], cap=1)
    forced_one.grammar = ForcingGrammar([10, 11, 12])
    policy = RecordingPolicy({"p": 3, "o": 3, "one": 3, "low": 2, "g": 3, "g1": 3})
    spec = SpecConfig("draft", "unused", max_draft_tokens=3, ngram_assist=2)
    planner = SpecPlanner(spec, policy, proposer=None)
    planner.lookup = lambda tokens, k: (3, [9, 9, 9][:k])  # every request would find a lookup
    reqs = [plain, off, one, low, forced, forced_one]
    plans = planner.plan(reqs, 0)
    assert (plans[plain].k, plans[plain].reason) == (3, None)
    assert (plans[off].k, plans[off].reason, plans[off].given) == (0, REASON_REQUEST, None)
    assert (plans[one].k, plans[one].reason) == (1, REASON_REQUEST)
    assert (plans[low].k, plans[low].reason) == (2, "low_acceptance")
    assert plans[forced].k == 0 and not plans[forced].given
    assert plans[forced_one].given == [10]
    # Alone, a request may take a lookup with K = 0, but not one that turned drafting off.
    planner.policy = RecordingPolicy({"o": 0})
    assert planner.plan([off], 0)[off].k == 0


def test_the_engine_refuses_a_cap_above_its_k_max():
    from engine.types.validation import InvalidRequest, check_request

    for cap in (0, 2):
        check_request([1], SamplingParams(max_draft_tokens=cap), 100, 64, 64, 2)
    for cap in (3, -1):
        with pytest.raises(InvalidRequest) as info:
            check_request([1], SamplingParams(max_draft_tokens=cap), 100, 64, 64, 2)
        assert info.value.param == "speculation.max_draft_tokens"
