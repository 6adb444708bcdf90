"""Seeds that survive speculation: a seeded request's text is fixed by its seed alone.

Its token at output position t is the exponential race argmax p_t / E_t with noise keyed by
(seed, t) (engine/sample/sampler.py), so the text must not change with speculation off, with
a fixed K, with adaptive K, with a draft model or n-gram drafts, or with the other requests
in the batch. (That it is still distributed as the target is checked in test_speculative.py.)
"""

from __future__ import annotations

import pytest

from engine.config import SpecConfig
from engine.types.request import SamplingParams
from tests.engine_utils import drain, greedy, make_engine, random_prompts

MAX_TOKENS = 20


def _seeded(seed: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.9)
    return SamplingParams(max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    prompts = random_prompts([6, 13, 21, 9], vocab=300, seed=51)
    return [p + p[: len(p) // 2] for p in prompts]  # something for the n-gram drafter


# The seeded requests under test, and 15 neighbours of every kind (other seeds, unseeded
# sampling, greedy) for the crowded runs.
CASES = [
    _seeded(7),
    _seeded(8, top_p=0.9, top_k=40),
    _seeded(9, temperature=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    _seeded(10, min_tokens=4),
]
NEIGHBOURS = [
    _seeded(100 + i)
    if i % 3 == 0
    else SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    if i % 3 == 1
    else greedy(MAX_TOKENS)
    for i in range(15)
]


def _run(model_dirs, prompts, spec: SpecConfig | None, crowd: bool, **engine_kw):
    engine = make_engine(model_dirs["llama"], spec=spec, **engine_kw)
    others = random_prompts([5 + i for i in range(15)], vocab=300, seed=52)
    texts = []
    for case_no, (prompt, params) in enumerate(zip(prompts, CASES, strict=True)):
        engine.add_request(f"case{case_no}", prompt, params)
        if crowd:
            for j, (other, other_params) in enumerate(zip(others, NEIGHBOURS, strict=True)):
                engine.add_request(f"n{case_no}-{j}", other, other_params)
        outputs = drain(engine)
        texts.append(outputs[f"case{case_no}"])
    return texts, engine.stats()


def _draft(tiny_dirs, name="llama_draft", **kw) -> SpecConfig:
    kw.setdefault("max_draft_tokens", 4)
    return SpecConfig("draft", str(tiny_dirs[name]), **kw)


@pytest.fixture(scope="module")
def reference(tiny_dirs, prompts):
    texts, _ = _run(tiny_dirs, prompts, None, crowd=False)
    return texts


@pytest.mark.parametrize(
    "setup",
    [
        "off_crowded",
        "draft_fixed",
        "draft_fixed_crowded",
        "draft_adaptive_crowded",
        "draft_is_target_crowded",
        "draft_tree_crowded",
        "ngram_fixed_crowded",
        "token_verification_crowded",
        "tight_pool_crowded",
    ],
)
def test_same_seed_same_text(tiny_dirs, prompts, reference, setup):
    crowd = setup.endswith("crowded")
    engine_kw = {}
    spec: SpecConfig | None
    if setup.startswith("off"):
        spec = None
    elif setup.startswith("draft_fixed"):
        spec = _draft(tiny_dirs, draft_length="fixed")
    elif setup.startswith("draft_adaptive"):
        spec = _draft(tiny_dirs, draft_length="adaptive")
    elif setup.startswith("draft_is_target"):
        spec = _draft(tiny_dirs, "llama", draft_length="fixed")
    elif setup.startswith("draft_tree"):
        spec = _draft(tiny_dirs, draft_length="fixed", max_draft_tokens=3, draft_branches=3)
    elif setup.startswith("ngram"):
        spec = SpecConfig("ngram", max_draft_tokens=3, draft_length="fixed")
    elif setup.startswith("token"):
        spec = _draft(tiny_dirs, draft_length="fixed", verification="token")
    else:  # a pool that forces preemption while the crowd runs
        spec = _draft(tiny_dirs, draft_length="fixed")
        engine_kw = {"num_blocks": 40}
    texts, stats = _run(tiny_dirs, prompts, spec, crowd, **engine_kw)
    assert texts == reference
    if spec is not None:
        assert stats.spec_drafted_tokens > 0
    if setup.startswith("draft_is_target"):  # the same race on the same distribution
        assert stats.spec_accepted_tokens > 0.9 * stats.spec_drafted_tokens
    if setup.startswith("tight_pool"):
        assert stats.preemptions > 0


def test_different_seeds_differ_and_unseeded_requests_still_sample(tiny_dirs, prompts):
    engine = make_engine(tiny_dirs["llama"])
    for i in range(4):
        engine.add_request(f"s{i}", prompts[0], _seeded(i))
    outputs = drain(engine)
    assert len({tuple(outputs[f"s{i}"]) for i in range(4)}) == 4
