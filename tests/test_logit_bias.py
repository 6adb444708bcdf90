"""logit_bias is part of the target's distribution (added to its logits before sampling, as in
the OpenAI API), so speculation keeps it exactly: greedy output with a bias is transformers'
greedy output with the same bias (its `sequence_bias`), speculation off and down every
drafting path, and a constrained request's biased output is the same with speculation or
without. Sampled output with a bias against its exact distribution: tests/test_speculative.py."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.config import SpecConfig
from engine.types.request import GrammarSpec, SamplingParams
from tests.engine_utils import drain, hf_greedy, make_engine, random_prompts

MAX_TOKENS = 24
PROMPTS = [p + p for p in random_prompts([6, 11, 4], vocab=300, seed=5)]  # repeats: n-grams
GRAMMAR = GrammarSpec("regex", r"(yes|no), [0-9]{1,3}( apples)?")
SPECS = {
    "off": lambda target, draft: None,
    "draft": lambda target, draft: SpecConfig("draft", str(draft), 6, "fixed"),
    "draft_is_target": lambda target, draft: SpecConfig("draft", str(target), 6, "fixed"),
    "draft_tree": lambda target, draft: SpecConfig(
        "draft", str(draft), 3, "fixed", draft_branches=2
    ),
    "ngram": lambda target, draft: SpecConfig("ngram", max_draft_tokens=6, draft_length="fixed"),
    "suffix": lambda target, draft: SpecConfig("suffix", max_draft_tokens=6, draft_length="fixed"),
}


def _run(engine, bias, constrained_bias) -> tuple[list[list[int]], list[int]]:
    """The greedy outputs of PROMPTS with `bias`, and of one constrained request beside them."""
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=bias
        )
        engine.add_request(f"p{i}", prompt, params)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, grammar=GRAMMAR, logit_bias=constrained_bias
    )
    engine.add_request("constrained", PROMPTS[0], params)
    outputs = drain(engine)
    return [outputs[f"p{i}"] for i in range(len(PROMPTS))], outputs["constrained"]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """(bias, transformers' greedy output with it; the constrained request's bias and its
    output with speculation off)."""
    target = tiny_dirs["llama"]
    plain = hf_greedy(target, PROMPTS, MAX_TOKENS)
    forbid = [t for t, _ in Counter(t for out in plain for t in out).most_common(4)]
    boost = sorted(set(random_prompts([12], vocab=300, seed=3)[0]) - set(forbid))
    bias = tuple([(t, -100.0) for t in forbid] + [(t, 2.0) for t in boost])
    biased = hf_greedy(target, PROMPTS, MAX_TOKENS, logit_bias=bias)
    tokens = [t for out in biased for t in out]
    # The bias matters: no forbidden token left, boosted ones among the model's own picks.
    assert not set(tokens) & set(forbid)
    assert 0 < sum(t in boost for t in tokens) < len(tokens)

    _, constrained_plain = _run(make_engine(target), (), ())
    constrained_bias = ((constrained_plain[0], -100.0),)  # the grammar's first pick, forbidden
    _, constrained = _run(make_engine(target), (), constrained_bias)
    assert constrained != constrained_plain
    return bias, biased, constrained_bias, constrained


@pytest.mark.parametrize("drafter", list(SPECS))
def test_greedy_with_a_bias_is_the_biased_targets_greedy_output(tiny_dirs, reference, drafter):
    bias, expected, constrained_bias, constrained = reference
    target, draft = tiny_dirs["llama"], tiny_dirs["llama_draft"]
    engine = make_engine(target, spec=SPECS[drafter](target, draft))
    outputs, constrained_out = _run(engine, bias, constrained_bias)
    assert outputs == expected
    assert constrained_out == constrained
    stats = engine.stats()
    if drafter != "off":
        assert stats.spec_drafted_tokens > 0
    if drafter == "draft_is_target":  # the draft sees the bias too: every draft is kept
        assert stats.spec_accepted_tokens == stats.spec_drafted_tokens
    if drafter == "draft":  # a different draft: rejections happened, the output still holds
        assert stats.spec_accepted_tokens < stats.spec_drafted_tokens
