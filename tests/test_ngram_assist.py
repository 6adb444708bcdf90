"""`speculative.ngram_assist`: a decoding request whose context's suffix occurred earlier may
verify a prompt lookup's continuation in place of the draft model's drafts. The output stays
the target's (greedy token for token, sampling in distribution), in a batch the lookup is
asked only for requests given K > 0, and the draft model gets no work for those it serves."""

from __future__ import annotations

import random
from array import array

import pytest

from engine.config import SpecConfig
from engine.spec.policy import AdaptiveDraftLength
from engine.spec.proposers.ngram import longest_match, prompt_lookup
from engine.types.request import Request, SamplingParams
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts
from tests.test_draft_length import memory_then_compute_bound
from tests.test_speculative import (
    PerRequestK,
    _chi_square_test,
    _exact_distribution,
    _params,
    _sample_continuations,
)

MAX_TOKENS = 24


def _brute_force(tokens: list[int], k: int, n_max: int, n_min: int) -> tuple[int, list[int]]:
    """The longest suffix n-gram with an earlier occurrence, and what followed the latest one."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), max(n_min, 1) - 1, -1):
        for end in range(size - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[size - n :]:
                return n, tokens[end + 1 : end + 1 + k]
    return 0, []


def test_longest_match_is_the_longest_latest_match_on_lists_and_on_a_requests_bytes():
    """The byte search finds what the brute force finds, with token values whose bytes also
    match across token boundaries (which must not count), and on `Request.token_bytes`
    extended token by token."""
    rng = random.Random(0)
    for trial in range(400):
        values = [0, 1, 256, 65536, 1 << 24, 257] if trial % 2 else [5, 6, 7]
        tokens = [rng.choice(values) for _ in range(rng.randint(1, 60))]
        n_max, n_min, k = rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 6)
        assert longest_match(tokens, k, n_max, n_min) == _brute_force(tokens, k, n_max, n_min)
    req = Request("r", tokens[:5], SamplingParams())
    for token in tokens[5:]:
        req.output_token_ids.append(token)
        assert longest_match(req.token_bytes(), 4, 6, 1) == _brute_force(req.all_token_ids, 4, 6, 1)


def test_greedy_with_lookups_equals_target_only(tiny_dirs):
    prompts = random_prompts([5, 9, 14, 22, 30, 12], vocab=300, seed=11)
    prompts = [p + p[: len(p) // 2] for p in prompts]  # repeats for the lookup to find
    expected = hf_greedy(tiny_dirs["llama"], prompts, MAX_TOKENS)
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), 8, "fixed", ngram_assist=2)
    engine = make_engine(tiny_dirs["llama"], spec=spec, max_num_batched_tokens=96)
    ids = [f"s{i}" for i in range(len(prompts))]
    ks = {rid: 0 if i == 0 else 1 + i % 4 for i, rid in enumerate(ids)}  # s0 never drafts
    engine.planner.policy = PerRequestK(ks)

    asked: list[tuple[list[int], int]] = []  # (context, decoding requests)
    lookup = engine.planner.lookup
    assert lookup is not None

    def recording_lookup(tokens: bytearray, k: int) -> tuple[int, list[int]]:
        running = engine.scheduler.running
        asked.append((array("i", tokens).tolist(), sum(not r.is_prefill for r in running)))
        return lookup(tokens, k)

    engine.planner.lookup = recording_lookup
    served: list[int] = []  # what the proposer was asked for the lookup's requests
    propose = engine.proposer.propose

    def recording_propose(sched, tables):
        for item in sched.scheduled:
            if item.looked_up:
                served.append(item.num_proposed_tokens)
                req = item.request
                assert 0 < len(item.forced) <= ks[req.request_id]
                assert item.forced == prompt_lookup(req.all_token_ids, len(item.forced), 4, 2)
        return propose(sched, tables)

    engine.proposer.propose = recording_propose
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, greedy(MAX_TOKENS))
    outputs = drain(engine)
    assert [outputs[rid] for rid in ids] == expected
    stats = engine.stats()
    assert served and not any(served)  # the draft model skipped every looked-up request
    assert 0 < stats.spec_lookup_accepted <= stats.spec_lookup_drafted
    assert stats.spec_drafted_tokens > 0  # and drafted for the others
    # s0 (K = 0) is looked up for only when it decodes alone: in a batch, only for K > 0.
    s0 = [batch for tokens, batch in asked if tokens[: len(prompts[0])] == prompts[0]]
    assert len(asked) > len(s0) and all(batch == 1 for batch in s0)


def test_no_lookup_without_a_draft_model_or_with_it_off(tiny_dirs):
    ngram = SpecConfig("ngram", max_draft_tokens=4, draft_length="fixed", ngram_assist=2)
    draft = SpecConfig("draft", str(tiny_dirs["llama_draft"]), 4, "fixed")
    for spec in (ngram, draft):
        assert make_engine(tiny_dirs["llama"], spec=spec).planner.lookup is None


@pytest.mark.parametrize(
    "params", [_params(temperature=1.0), _params(temperature=0.8, top_k=2)], ids=["plain", "top_k"]
)
def test_sampled_continuations_with_lookups_follow_the_target(tiny_vocab_pair, params):
    """Against the exact distribution of 4-token continuations: a lookup's drafts are
    verified with a one-hot q, the draft model's with its own, in one batch."""
    target, draft = tiny_vocab_pair
    exact = _exact_distribution(target, params)
    counts, stats, n = _sample_continuations(target, draft, params, ngram_assist=1)
    assert 0 < stats.spec_lookup_accepted < stats.spec_lookup_drafted  # both outcomes
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens  # the draft's too
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"


def test_adaptive_ngram_decoding_alone_verifies_priced_lookups_past_k_max(tiny_dirs):
    """With adaptive K a model-free `ngram` engine prices its lookups alone (as beside a draft
    model, per match length) and may verify more than K_max of them; the output stays greedy."""
    prompts = random_prompts([6, 10, 15], vocab=300, seed=5)
    prompts = [p + p for p in prompts]  # repeats for the lookup to find
    expected = hf_greedy(tiny_dirs["llama"], prompts, 48)
    spec = SpecConfig("ngram", max_draft_tokens=2, draft_length="adaptive")
    engine = make_engine(tiny_dirs["llama"], spec=spec)
    # Priced on a memory-bound target, not this machine's timings of a tiny model (where a
    # step's host time outweighs its pass and whether a lookup pays is the machine's call).
    engine.planner.cost_model = None
    engine.planner.policy = AdaptiveDraftLength(2, memory_then_compute_bound())
    for i, prompt in enumerate(prompts):  # one at a time: each decodes alone
        engine.add_request(f"r{i}", prompt, greedy(48))
        assert drain(engine)[f"r{i}"] == expected[i]
    stats = engine.stats()
    assert stats.spec_lookup_drafted == 0  # counted as the proposer's own drafts
    assert len(stats.spec_drafted_by_position) > 2 and stats.spec_accepted_tokens > 0
