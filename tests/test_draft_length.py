"""The adaptive draft-length policy: K from batch size, acceptance and a cost model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import SpecConfig
from engine.spec.cost.calibration import (
    _TABLE_CHUNK,
    _log_sizes,
    _nonneg_lstsq,
    calibrate_runners,
    table_chunks,
)
from engine.spec.cost.model import CostModel, PassShape
from engine.spec.policy import REASON_ACCEPTANCE, REASON_BATCH, AdaptiveDraftLength
from engine.spec.policy.adaptive import PROBE_STEPS
from engine.spec.policy.catch_up import CATCH_UP_STEPS
from engine.spec.policy.reuse import PLAIN_REUSE_STEPS
from engine.types.request import Request, SamplingParams
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def memory_then_compute_bound() -> CostModel:
    """10 ms flat up to 16 tokens (weights dominate), then +0.5 ms per token; 1 ms drafts."""
    seconds = [0.010 + 0.0005 * max(0, n - 16) for n in SIZES]
    return CostModel(SIZES, seconds, draft_fixed=0.001, draft_per_token=0.00002)


def _requests(n: int, accepted: int, trials: int, context: int = 3, **params) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [1] * context, SamplingParams(max_tokens=64, **params))
        req.spec.accepted, req.spec.trials = accepted, trials
        reqs.append(req)
    return reqs


def test_high_acceptance_alone_drafts_k_max():
    policy = AdaptiveDraftLength(8, memory_then_compute_bound())
    choice = policy.choose(_requests(1, accepted=900, trials=1000, temperature=0))
    assert choice.ks == [8] and choice.reasons == [None]


def test_a_lookup_is_priced_by_its_match_length_and_may_outrun_k_max():
    """Alone, a lookup whose matched length was mostly kept verifies long chains (past K_max),
    a length mostly refused verifies none, and a lookup no better
    than the draft model's expected rate leaves the step to the draft."""
    seconds = [0.010 + 0.001 * (n - 1) for n in SIZES]  # each row a tenth of a pass
    policy = AdaptiveDraftLength(4, CostModel(SIZES, seconds, 0.001, 0.00002))
    for _ in range(200):
        policy.observe_lookup(8, 16, 16)  # long matches: copied text, every draft kept
        policy.observe_lookup(1, 4, 0)  # one-token matches: none kept
    alone = _requests(1, accepted=0, trials=1000, temperature=0)[0]  # a hopeless draft
    assert policy.lookup_length(alone, 0, 8, 16, batch=1) == 16  # past K_max = 4
    assert policy.lookup_length(alone, 0, 1, 16, batch=1) == 0
    assert policy.lookup_length(alone, 2, 8, 16, batch=4) == 2  # in a batch: the policy's K
    good = _requests(1, accepted=990, trials=1000, temperature=0)[0]  # a near-perfect draft
    for _ in range(200):
        policy.observe_lookup(3, 4, 1)  # three-token matches: a quarter kept
    assert policy.lookup_length(good, 4, 3, 16, batch=1) == 0  # the draft is expected faster
    assert policy.lookup_length(good, 4, 8, 16, batch=1) == 16


def test_long_matches_share_a_rate_per_range_of_lengths():
    """Past 4 tokens a match's length is priced by its range (5-7, 8-15, 16 on): what lookups
    matching 9 tokens taught prices one matching 12, and nothing of it prices a 6-token one."""
    seconds = [0.010 + 0.001 * (n - 1) for n in SIZES]
    policy = AdaptiveDraftLength(4, CostModel(SIZES, seconds, 0.001, 0.00002))
    for _ in range(200):
        policy.observe_lookup(9, 16, 16)  # 8-15 tokens matched: copied text, every draft kept
        policy.observe_lookup(6, 4, 0)  # 5-7 tokens matched: none kept
    estimates = policy.estimates
    assert estimates.lookup_acceptance(12) == estimates.lookup_acceptance(9) > 0.95
    assert estimates.lookup_acceptance(5) == estimates.lookup_acceptance(7) < 0.1
    alone = _requests(1, accepted=0, trials=1000, temperature=0)[0]
    assert policy.lookup_length(alone, 0, 12, 16, batch=1) == 16
    assert policy.lookup_length(alone, 0, 7, 16, batch=1) == 0
    assert estimates.lookup_acceptance(16) == estimates.lookup_acceptance(0)  # unseen: all's


def test_a_sampled_requests_own_lookups_reprice_its_next_ones():
    """Lookups that one sampled request keeps (copied text) and another refuses (free chat)
    are priced per request: at the same match length, alone, the first verifies a longer chain
    and the second a shorter one (then none), where a fresh request goes by the engine-wide
    rate."""
    seconds = [0.010 + 0.001 * (n - 1) for n in SIZES]
    policy = AdaptiveDraftLength(4, CostModel(SIZES, seconds, 0.001, 0.00002))
    copying, chatting, fresh = _requests(3, accepted=0, trials=0, temperature=0.7)
    for _ in range(50):
        policy.observe_lookup(2, 4, 2)  # two-token matches: about half kept, engine-wide
    assert policy.lookup_length(fresh, 0, 2, 16, batch=1) > 0
    for _ in range(10):
        policy.observe_lookup(2, 4, 4, copying)
        policy.observe_lookup(2, 4, 0, chatting)
    assert policy.estimates.lookup_factor(copying) > 1 > policy.estimates.lookup_factor(chatting)
    assert policy.lookup_length(copying, 0, 2, 16, batch=1) > policy.lookup_length(
        fresh, 0, 2, 16, batch=1
    )
    assert policy.lookup_length(chatting, 0, 2, 16, batch=1) < policy.lookup_length(
        fresh, 0, 2, 16, batch=1
    )
    for _ in range(20):
        policy.observe_lookup(2, 2, 0, chatting)
    assert policy.lookup_length(chatting, 0, 2, 16, batch=1) == 0
    assert policy.estimates.lookup_factor(fresh) == 1.0
    greedy = _requests(1, accepted=0, trials=0, temperature=0)[0]  # priced by the table alone
    for _ in range(20):
        policy.observe_lookup(2, 2, 0, greedy)
    assert policy.estimates.lookup_factor(greedy) == 1.0


def test_a_decision_is_reused_only_while_its_inputs_round_alike(monkeypatch):
    policy = AdaptiveDraftLength(4, memory_then_compute_bound(), max_branches=3, reuse_steps=1)
    decisions = []
    decide = policy.decide
    monkeypatch.setattr(policy, "decide", lambda *a: decisions.append(1) or decide(*a))
    fresh = AdaptiveDraftLength(4, memory_then_compute_bound(), max_branches=3)

    reqs = _requests(2, accepted=500, trials=1000, temperature=0)
    first = policy.choose(reqs)
    assert policy.choose(reqs) == first == fresh.choose(reqs)
    reqs[0].spec.accepted = 501  # rounds alike: the same decision, not recomputed
    assert policy.choose(reqs) == first and len(decisions) == 1
    for changed in (
        lambda: setattr(reqs[0].spec, "accepted", 100),  # acceptance
        lambda: reqs[1].prompt_token_ids.extend([1] * 64),  # context
        lambda: policy.cost.target_scale.observe(2.0, 1.0),  # the cost model's online scale
    ):
        changed()
        again = policy.choose(reqs)
        assert again == AdaptiveDraftLength(4, policy.cost, max_branches=3).choose(reqs)
    assert len(decisions) == 4
    assert policy.choose(reqs, num_other_tokens=64) is not None and len(decisions) == 5


def test_a_decision_holds_for_reuse_steps_of_the_same_requests(monkeypatch):
    """Within `reuse_steps` steps of the same requests and no prefill, the last decision
    stands even where its inputs moved; another batch or prefill tokens decide afresh."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound(), reuse_steps=3)
    calls = []
    decision = policy.decision_for
    monkeypatch.setattr(policy, "decision_for", lambda *a: calls.append(1) or decision(*a))
    reqs = _requests(2, accepted=900, trials=1000, temperature=0)
    first = policy.choose(reqs)
    for req in reqs:  # a change the next two steps do not see
        req.spec.accepted = 0
    assert policy.choose(reqs) == first and policy.choose(reqs) == first and len(calls) == 1
    third = policy.choose(reqs)  # the decision is reuse_steps old: decided again
    assert len(calls) == 2 and third.ks == [0, 0] != first.ks
    policy.choose(reqs[:1])  # another batch
    policy.choose(reqs[:1], num_other_tokens=16)  # prefill in the step
    assert len(calls) == 4


def test_large_batch_on_compute_bound_target_drafts_less():
    policy = AdaptiveDraftLength(8, memory_then_compute_bound())
    alone = policy.choose(_requests(1, accepted=700, trials=1000, temperature=0)).ks[0]
    batch = policy.choose(_requests(64, accepted=700, trials=1000, temperature=0))
    assert max(batch.ks) < alone
    assert REASON_BATCH in batch.reasons


def test_low_acceptance_switches_speculation_off():
    policy = AdaptiveDraftLength(8, memory_then_compute_bound())
    choice = policy.choose(_requests(4, accepted=2, trials=2000, temperature=0))
    assert choice.ks == [0, 0, 0, 0]
    assert choice.reasons == [REASON_ACCEPTANCE] * 4


def test_probes_back_off_while_they_confirm_k_zero_and_reset_when_drafting_pays():
    """With speculation off, a probe (K = 1 for PROBE_STEPS steps, for the request with the
    least for the draft to catch up when it starts) comes after 32 plain steps, then 64, 128,
    ... up to the cap; once the policy drafts on its own, the interval is 32 again."""
    policy = AdaptiveDraftLength(8, memory_then_compute_bound(), max_probe_interval=128)
    hopeless = _requests(4, accepted=2, trials=2000, temperature=0)
    for req, computed in zip(hopeless, [1, 2, 0, 1], strict=True):
        req.num_draft_computed_tokens = computed  # request 1 is the least behind

    def probes(steps: int) -> list[tuple[int, int]]:
        """(plain steps before, steps) of each probe."""
        runs: list[tuple[int, int]] = []
        plain = probing = 0
        for _ in range(steps):
            ks = policy.choose(hopeless).ks
            if any(ks):
                assert ks == [0, 1, 0, 0]
                probing += 1
                continue
            if probing:
                runs.append((plain, probing))
                plain = probing = 0
            plain += 1
        return runs

    p = PROBE_STEPS
    assert probes(32 + 64 + 128 + 128 + 128 + 5 * p + 1) == [
        (31, p), (63, p), (127, p), (127, p), (127, p)
    ]  # fmt: skip
    assert policy.choose(_requests(1, accepted=99, trials=100, temperature=0)).ks[0] > 0
    assert probes(32 + p + 1) == [(31, p)]
    # A probe whose request leaves ends with it.
    fresh = AdaptiveDraftLength(8, memory_then_compute_bound())
    assert not any(k for _ in range(31) for k in fresh.choose(hopeless).ks)
    assert fresh.choose(hopeless).ks == [0, 1, 0, 0]
    assert fresh.choose(hopeless[2:]).ks == [0, 0]


def test_more_acceptance_never_means_fewer_drafts():
    policy = AdaptiveDraftLength(8, memory_then_compute_bound())
    ks = [
        policy.choose(_requests(1, accepted=a, trials=100, temperature=0)).ks[0]
        for a in (10, 30, 50, 70, 90, 99)
    ]
    assert ks == sorted(ks) and ks[0] < ks[-1]


def test_seeded_sampling_gets_the_k_its_acceptance_earns():
    """A seed's text does not depend on K (tests/test_seeded_sampling.py), so a seeded
    request whose drafts keep failing drops its drafts like any other."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound())
    seeded = policy.choose(_requests(64, accepted=1, trials=100, temperature=1.0, seed=7))
    plain = policy.choose(_requests(64, accepted=1, trials=100, temperature=1.0))
    assert seeded.ks == plain.ks and max(seeded.ks) < 4


def test_acceptance_estimate_learns_from_observations():
    policy = AdaptiveDraftLength(4, memory_then_compute_bound())
    req = _requests(1, accepted=0, trials=0, temperature=0)[0]
    prior = policy.estimates.acceptance(req)
    for _ in range(50):
        req.spec.record(4, 4)
        policy.observe(req, 4, 4)
    assert policy.estimates.acceptance(req) > prior
    assert policy.estimates.global_acceptance > 0.9


def test_a_few_unlucky_chains_do_not_outweigh_the_engine_wide_rate():
    """A request's own chains move its estimate slowly (REQUEST_WEIGHT): a few dozen say little
    about its next ones (bench/acceptance_weight.py), while a long record still rules."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound())  # engine-wide prior: 0.6
    unlucky = _requests(1, accepted=2, trials=10, temperature=0)[0]
    assert policy.estimates.acceptance(unlucky) > 0.45  # weighted 8, 0.38
    hopeless = _requests(1, accepted=20, trials=2000, temperature=0)[0]
    assert policy.estimates.acceptance(hopeless) < 0.05


def test_cost_model_capacity_and_online_refinement():
    cost = memory_then_compute_bound()
    assert cost.capacity() == 16  # within 25% of a one-token pass
    predictions = cost.target_time(np.array(SIZES))
    assert list(predictions) == sorted(predictions)  # a bigger pass never looks cheaper
    # Real passes of every shape take 1.5x the calibration: repeated evidence wins.
    for i in range(200):
        n = SIZES[i % len(SIZES)]
        cost.observe_target(PassShape(n), 1.5 * float(memory_then_compute_bound().target_time(n)))
    assert cost.target_time(24) == pytest.approx(1.5 * 0.014, rel=0.02)
    # One pause on a shared machine (10x) then moves the model a little, not a lot.
    before = float(cost.target_time(24))
    cost.observe_target(PassShape(24), 10 * before)
    assert before < cost.target_time(24) < 1.1 * before


def test_cost_model_charges_for_context_read():
    cost = CostModel(SIZES, [0.010] * len(SIZES), 0.001, 0.0, kv_coef=1e-6, qk_coef=1e-8)
    short = PassShape.of([1] * 16, [10] * 16)
    long = PassShape.of([1] * 16, [1000] * 16)
    assert cost.target_time(long.num_tokens, long.kv_tokens, long.qk_pairs) == pytest.approx(
        0.010 + 16_000 * 1e-6 + 16_000 * 1e-8
    )
    assert cost.target_time(long.num_tokens, long.kv_tokens, long.qk_pairs) > cost.target_time(
        short.num_tokens, short.kv_tokens, short.qk_pairs
    )


def test_nonneg_lstsq_recovers_costs_and_never_goes_negative():
    rng = np.random.default_rng(0)
    a = np.column_stack([np.ones(20), rng.uniform(1, 64, 20), rng.uniform(1e3, 1e5, 20)])
    truth = np.array([0.002, 0.0001, 3e-8])
    assert _nonneg_lstsq(a, a @ truth) == pytest.approx(list(truth), rel=1e-6)
    # Data that says a cost is negative: that column is dropped, the rest refitted.
    b = a @ np.array([0.002, -0.0001, 3e-8])
    assert min(_nonneg_lstsq(a, b)) >= 0.0


def test_calibration_times_each_table_size_with_exactly_that_many_tokens():
    """A table entry for n tokens must time a pass of n tokens (24 was once timed as 2 x 16)."""
    for chunk in (_TABLE_CHUNK, 5):  # 5: a runner on decode graphs of up to 1 + 4 tokens
        for n in range(1, 600):
            chunks = table_chunks(n, chunk)
            assert sum(chunks) == n and max(chunks) <= chunk
            assert max(chunks) - min(chunks) <= 1

    class Recorder:
        device = torch.device("cpu")
        decode_graphs = None

        def __init__(self) -> None:
            self.passes: list[int] = []

        def forward(self, seqs) -> None:
            self.passes.append(sum(len(s.token_ids) for s in seqs))

    runner = Recorder()
    cost = calibrate_runners(runner, None, 16, 64, 100, 8, 256, repeats=1)
    assert cost.sizes.tolist() == _log_sizes(100)
    assert set(_log_sizes(100)) <= set(runner.passes)
    assert 24 in runner.passes


def test_context_bound_batch_drafts_more_than_weight_bound_one():
    """When reading each request's context dominates a pass (long contexts, many requests),
    extra draft tokens are cheap relative to the pass, so speculation pays for longer."""
    compute_bound = memory_then_compute_bound()
    context_bound = memory_then_compute_bound()
    context_bound.kv_coef = 2e-6  # 64 requests x 1000 keys = 128 ms of attention per pass
    reqs = _requests(64, accepted=700, trials=1000, context=1000, temperature=0)
    k_plain = sum(AdaptiveDraftLength(8, compute_bound).choose(reqs).ks)
    k_context = sum(AdaptiveDraftLength(8, context_bound).choose(reqs).ks)
    assert k_context > k_plain


def _count_draft_tokens(engine) -> list[int]:
    """Wrap the draft runner's passes to count how many tokens each is fed."""
    runner = engine.proposer.runner
    original = runner.forward_packed
    fed: list[int] = []

    def counting(batch, *args, **kwargs):
        fed.append(len(batch.token_ids))
        return original(batch, *args, **kwargs)

    runner.forward_packed = counting
    return fed


def test_adaptive_engine_is_lossless_and_stops_drafting_for_a_hopeless_draft(tiny_dirs):
    target = tiny_dirs["llama"]
    prompts = random_prompts([5, 12, 20, 33], vocab=300, seed=31)
    expected = hf_greedy(target, prompts, 40)
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), max_draft_tokens=4)
    engine = make_engine(target, spec=spec)
    assert isinstance(engine.planner.policy, AdaptiveDraftLength)
    # A fixed cost model in which drafting is cheap: what stops the drafts is the acceptance
    # the policy learns, not this machine's calibration (which a loaded machine skews).
    engine.planner.cost_model = None
    engine.planner.policy = AdaptiveDraftLength(4, memory_then_compute_bound())
    fed = _count_draft_tokens(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, greedy(40))
    outputs = drain(engine)
    assert [outputs[f"a{i}"] for i in range(4)] == expected
    stats = engine.stats()
    # The random draft rarely agrees: the policy learns that (its acceptance estimate moves
    # down from the 0.6 prior) and stops speculating, and a K = 0 step costs the draft model
    # nothing.
    assert stats.acceptance_rate < 0.5
    assert engine.planner.policy.estimates.global_acceptance < 0.6
    cuts = stats.draft_length_reasons
    assert cuts.get(REASON_ACCEPTANCE, 0) + cuts.get(REASON_BATCH, 0) > 0
    assert stats.spec_drafted_tokens < 4 * 40 * 4 / 2
    steps_without_draft_work = stats.steps - len(fed)
    assert steps_without_draft_work > 10


def test_adaptive_engine_with_a_perfect_cheap_draft_keeps_drafting(tiny_dirs):
    """Draft = target accepts everything; with a cost model in which drafting is cheap (a big
    target, a small draft) the policy must keep K high. (The measured cost of these tiny
    models says the draft costs as much as the target, and then drafting never pays.)"""
    target = tiny_dirs["llama"]
    prompts = random_prompts([7, 15], vocab=300, seed=32)
    spec = SpecConfig("draft", str(target), max_draft_tokens=4)
    engine = make_engine(target, spec=spec)
    engine.planner.cost_model = None  # no online refinement from the real (equal) costs
    engine.planner.policy = AdaptiveDraftLength(4, memory_then_compute_bound())
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy(30))
    outputs = drain(engine)
    assert [outputs["p0"], outputs["p1"]] == hf_greedy(target, prompts, 30)
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_drafted_tokens > 0
    assert stats.spec_drafted_tokens >= 2 * 30 / 2  # most steps drafted several tokens


def test_similar_requests_share_one_k():
    """Per-request K that differs by noise in the acceptance estimates would cost an attention
    call per distinct K and draft passes set by the deepest: one K for all wins then."""
    reqs = []
    for i, accepted in enumerate((600, 650, 700, 750, 800, 850, 620, 830)):
        reqs += _requests(1, accepted=accepted, trials=1000, temperature=0)
        reqs[-1].request_id = f"r{i}"
    ks = AdaptiveDraftLength(8, memory_then_compute_bound()).choose(reqs).ks
    assert len(set(ks)) == 1 and ks[0] > 0
    # Without the preference the same batch would be split by its estimates.
    split = AdaptiveDraftLength(8, memory_then_compute_bound(), uniform_margin=-1.0)
    assert len(set(split.choose(reqs).ks)) > 1


def test_a_request_whose_drafts_keep_failing_drops_out_of_a_good_batch():
    reqs = _requests(7, accepted=950, trials=1000, temperature=0)
    reqs += _requests(1, accepted=1, trials=2000, temperature=0)
    reqs[-1].request_id = "hopeless"
    choice = AdaptiveDraftLength(8, memory_then_compute_bound()).choose(reqs)
    assert choice.ks[-1] == 0 and choice.reasons[-1] == REASON_ACCEPTANCE
    assert min(choice.ks[:-1]) > 0


def test_no_request_loses_more_than_the_cap_to_speed_up_the_others():
    """`max_request_slowdown`: a request that gains nothing from drafts waits for the others'
    only while their drafts cost the step at most that fraction; a batch that all gains
    drafts as before, and so does a mixed one where drafts are nearly free."""
    reqs = _requests(7, accepted=950, trials=1000, temperature=0)
    reqs += _requests(1, accepted=1, trials=2000, temperature=0)
    reqs[-1].request_id = "hopeless"
    capped = AdaptiveDraftLength(8, memory_then_compute_bound(), max_request_slowdown=0.03)
    assert capped.search.max_slowdown == 0.03
    assert capped.choose(reqs).ks == [0] * 8  # a draft pass alone costs a tenth of the step
    good = _requests(8, accepted=950, trials=1000, temperature=0)
    assert min(capped.choose(good).ks) > 0
    cheap = [0.010 + 0.00001 * n for n in SIZES]  # passes flat, drafts nearly free
    model = CostModel(SIZES, cheap, draft_fixed=0.00001, draft_per_token=0.000001)
    ks = AdaptiveDraftLength(8, model, max_request_slowdown=0.03).choose(reqs).ks
    assert min(ks[:-1]) > 0  # (the hopeless one's drafts cost nothing either)
    spec = SpecConfig(method="ngram")
    assert spec.max_request_slowdown == 0.03  # the default engine's
    with pytest.raises(ValueError, match="max_request_slowdown"):
        SpecConfig(method="ngram", max_request_slowdown=1.0)


def test_k_falls_as_the_batch_grows_and_reaches_zero_when_compute_bound():
    policy = AdaptiveDraftLength(8, memory_then_compute_bound())
    per_request = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        ks = policy.choose(_requests(batch, accepted=700, trials=1000, temperature=0)).ks
        per_request.append(sum(ks) / batch)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] >= 4 and per_request[-1] == 0


def test_calibration_is_cached_per_key_and_redone_on_request(tmp_path, monkeypatch):
    from engine.spec.cost.calibration import cached_calibration, calibration_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def calibrate() -> CostModel:
        calls.append(1)
        return CostModel([1, 8], [0.010, 0.012 + len(calls)], 0.001, 0.0005, kv_coef=1e-6)

    first = cached_calibration("k1", calibrate)
    again = cached_calibration("k1", calibrate)
    assert len(calls) == 1
    assert again.to_dict() == first.to_dict()
    assert cached_calibration("k2", calibrate).target_seconds[-1] != first.target_seconds[-1]
    assert len(calls) == 2
    fresh = cached_calibration("k1", calibrate, fresh=True)  # --recalibrate on
    assert len(calls) == 3
    assert cached_calibration("k1", calibrate).to_dict() == fresh.to_dict()
    (calibration_cache_dir() / "k1.json").write_text("{not json")
    cached_calibration("k1", calibrate)  # an unreadable cache costs a calibration, no error
    assert len(calls) == 4


def test_calibration_key_follows_what_the_cpu_kernels_run_on(monkeypatch, tmp_path):
    """Timings taken with AMX tiles on are not reused with them off (TANDEM_AMX=0): the key
    holds the kernels' instruction set, when a model runs on them; and each model's weight
    rounding (--quantization, --draft-quantization)."""
    from types import SimpleNamespace

    from engine.cpu import kernels as cpu_kernels
    from engine.spec.cost.calibration import calibration_key

    def runner(kernels: str, kv_dtype: str, quantization: str) -> SimpleNamespace:
        return SimpleNamespace(
            hf_config=SimpleNamespace(to_dict=lambda: {"hidden_size": 8}),
            device="cpu", dtype="float32", model_impl="native", attention_backend=None,
            decode_graphs=None, head_tokens=None, kernels=kernels, name=str(tmp_path),
            kv_dtype=kv_dtype, quantization=quantization,
        )  # fmt: skip

    def key(isa: str, kernels: str, kv_dtype: str = "float32", quantization: str = "none") -> str:
        monkeypatch.setattr(cpu_kernels, "isa", lambda: isa)
        return calibration_key([runner(kernels, kv_dtype, quantization)], {"block_size": 16})

    assert key("avx512f", "cpu") != key("avx512f+amx", "cpu")
    assert key("avx512f", "cpu") != key("avx512f", "cpu", "float16")  # --kv-cache-dtype
    # --quantization / --draft-quantization: the rounded weights' passes cost otherwise
    assert key("avx512f", "cpu") != key("avx512f", "cpu", quantization="int8")
    assert key("avx512f", "cpu") == key("avx512f", "cpu")
    assert key("avx512f", "torch") == key("avx512f+amx", "torch")  # not on the kernels
    # The engine's code, the CPU kernels' sources included: a kernel that got faster must not
    # be priced by a cached fit of the old one (only engine/spec/ was once hashed).
    read: list[Path] = []
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or original(self))
    key("avx512f", "cpu")
    hashed = {p.relative_to(Path(cpu_kernels.__file__).parents[2]).as_posix() for p in read}
    assert {"engine/cpu/kernels.py", "engine/cpu/csrc/attention_pairs.c"} <= hashed
    assert "engine/core/engine.py" in hashed and "engine/spec/planner.py" in hashed


def test_auto_branches_draft_trees_only_where_passes_are_flat():
    """A tree multiplies the draft tokens of a pass: worth it where a pass costs the same for
    a few more tokens (one request on a memory-bound target, middling acceptance), not where
    every token costs (a big batch on the same target, or a target charging per token)."""
    flat = memory_then_compute_bound()
    alone = AdaptiveDraftLength(4, flat, max_branches=4).choose(
        _requests(1, accepted=500, trials=1000, temperature=0)
    )
    assert alone.branches > 1 and alone.ks[0] >= 1
    crowded = AdaptiveDraftLength(4, flat, max_branches=4).choose(
        _requests(48, accepted=500, trials=1000, temperature=0)
    )
    assert crowded.branches == 1
    steep = CostModel(SIZES, [0.002 * n for n in SIZES], draft_fixed=0.001, draft_per_token=1e-4)
    per_token = AdaptiveDraftLength(4, steep, max_branches=4).choose(
        _requests(1, accepted=500, trials=1000, temperature=0)
    )
    assert per_token.branches == 1
    assert AdaptiveDraftLength(4, flat).choose(_requests(1, 500, 1000, temperature=0)).branches == 1


def test_trees_measured_slower_than_predicted_are_dropped():
    """Tree steps learn their own cost factor: where walking a tree costs more than the
    passes' prediction says (the host's work per node, one draft pass of N rows per level),
    auto goes back to chains, and the chains' prediction is left alone."""
    cost = memory_then_compute_bound()
    policy = AdaptiveDraftLength(4, cost, max_branches=4, reuse_steps=1)
    requests = _requests(1, accepted=500, trials=1000, temperature=0)
    choice = policy.choose(requests)
    assert choice.branches > 1
    n, k = choice.branches, choice.ks[0]
    chain_before = cost.target_time(1 + k)
    shape = PassShape.of([1 + n * k], [100 + n * k])
    predicted = float(cost.target_time(shape.num_tokens, shape.kv_tokens, shape.qk_pairs, n))
    for _ in range(20):  # every tree step takes four times what was predicted
        cost.observe_target(shape, 4 * predicted, branches=n)
        cost.observe_draft(k, n * k, 0, 4 * float(cost.draft_time(k, n * k, 0, n)), branches=n)
    assert cost.target_time(1 + k) == chain_before
    assert cost.target_time(1 + k, branches=n) > 3 * chain_before
    assert policy.choose(requests).branches != n


def test_auto_branches_are_a_chain_under_a_fixed_k():
    assert SpecConfig("ngram", draft_length="fixed", draft_branches=None).max_branches == 1
    auto = {"draft_branches": None, "draft_length": "adaptive"}
    assert SpecConfig("ngram", **auto).max_branches == 4
    assert SpecConfig("ngram", max_draft_tokens=16, **auto).max_branches == 3
    assert SpecConfig("ngram", draft_length="adaptive").max_branches == 1  # the default: chains
    assert SpecConfig("ngram", draft_branches=2, draft_length="fixed").max_branches == 2


def test_trees_whose_candidates_miss_together_stop_being_drafted():
    """Root candidates drawn from one draft are not independent: when tree steps keep a root
    candidate only as often as a chain keeps its first draft, the measured root acceptance
    replaces the 1 - (1 - a)^N prior and the policy goes back to chains."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound(), max_branches=4)
    reqs = _requests(1, accepted=500, trials=1000, temperature=0)
    assert policy.choose(reqs).branches > 1  # the independence prior: trees pay here
    a = np.array([0.5])
    prior = 1 - (1 - a) ** 3
    for i in range(300):
        choice = policy.choose(reqs)
        hit = i % 2 == 0  # a root kept half the time, like a chain's first draft
        policy.observe(reqs[0], 2, 2 if hit else 0, choice.branches)
        if choice.branches == 1:
            break
    assert policy.choose(reqs).branches == 1
    measured = [n for n in range(2, 5) if policy.estimates.root_trials.get(n)]
    assert measured and all(
        policy.estimates.root_acceptance(a, n)[0] < 1 - 0.5**n for n in measured
    )
    assert policy.estimates.root_acceptance(a, 3)[0] <= prior[0]


def test_observing_a_step_predicts_what_target_time_predicts():
    """observe_target/observe_draft compute their prediction in plain Python (every step
    calls them); it is the vectorised formula's, inside the table, between its sizes and
    past its end."""
    cost = CostModel(SIZES, [0.010 + 0.001 * i for i in range(len(SIZES))], 0.001, 0.00002,
                     kv_coef=1e-6, qk_coef=1e-8, draft_per_pair=1e-9)  # fmt: skip
    for tokens in [1, 3, SIZES[-1], 2 * SIZES[-1] + 5]:
        shape = PassShape(tokens, kv_tokens=300, qk_pairs=tokens * 300)
        fresh = CostModel.from_dict(cost.to_dict())
        fresh.observe_target(shape, 2 * float(cost.target_time(tokens, 300, tokens * 300)))
        assert fresh.target_scale.value == pytest.approx(2.0, rel=1e-12)  # measured / predicted
        fresh.observe_draft(3, 3, 900, 0.5 * float(cost.draft_time(3, 3, 900, fed=7)), fed=7)
        assert fresh.draft.at(3, 3, 900, 7) == pytest.approx(
            float(fresh.draft_time(3, 3, 900, fed=7)), rel=1e-12
        )
        assert fresh.draft.at(3, 3, 900, 7) < 0.6 * float(cost.draft_time(3, 3, 900, fed=7))


def test_small_passes_learn_what_one_more_token_costs():
    """At concurrency 1 a pass holds 1 + K tokens. A start-up table that made a second token
    look almost free (4.0 against 4.3 ms) keeps buying K = 1 under one shared scale; once
    real 1- and 2-token passes are seen (4.4 and 6.0 ms, verification included), each count
    has its own scale and half-kept drafts stop paying."""
    seconds = [0.0040, 0.0043] + [0.0043 + 0.0005 * n for n in SIZES[2:]]

    def decide(cost: CostModel) -> list[int]:
        return AdaptiveDraftLength(1, cost).choose(_requests(1, accepted=50, trials=100)).ks

    cost = CostModel(SIZES, seconds, draft_fixed=0.0009, draft_per_token=0.0)
    assert decide(cost) == [1]
    for _ in range(10):
        cost.observe_target(PassShape(1), 0.0044)
        cost.observe_target(PassShape(2), 0.0060)
    assert cost.target_time(1) == pytest.approx(0.0044)
    assert cost.target_time(2) == pytest.approx(0.0060)
    assert decide(cost) == [0]
    # Bigger passes keep the shared scale: the mean of what every pass measured.
    shared = cost.target_scale.value
    assert cost.target_time(64) == pytest.approx(shared * float(CostModel(SIZES, seconds, 0, 0)
                                                                 .target_time(64)))  # fmt: skip
    assert 4.4 / 4.0 < shared < 6.0 / 4.3


def test_depths_kept_less_often_than_predicted_are_drafted_less():
    """The d-th draft's gain is a^d times what verification measured against a^d: a draft
    whose first token is always kept and whose second never is, stops at K = 1, while the
    engine-wide acceptance stays high."""
    policy = AdaptiveDraftLength(8, memory_then_compute_bound(), reuse_steps=1)
    req = _requests(1, accepted=900, trials=1000, temperature=0)[0]
    assert policy.choose([req]).ks == [8]
    for _ in range(300):
        req.spec.record(8, 1)
        policy.observe(req, 8, 1)
    factors = policy.estimates.depth_factors()
    assert factors[0] > 1.0 and factors[1] < 0.1  # first kept beyond a^1, second never
    assert policy.choose([req]).ks == [1]
    gains = policy.estimates.gains(np.array([0.3, 0.9]))
    assert np.all(np.diff(gains, axis=1) <= 0) and gains.max() <= 0.99


def test_one_requests_draft_length_is_what_the_vectorised_search_gives():
    """A batch of one takes CostModel.chain_rates (plain Python) instead of the numpy
    search: the same K and the same reason, over acceptances, contexts, other tokens in the
    pass, the draft's lag and online cost factors."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        seconds = [0.006 + 0.0004 * n + rng.uniform(0, 0.001) for n in SIZES]
        per_fed = rng.uniform(0.1, 1.0) * 3e-5
        cost = CostModel(SIZES, seconds, 0.0005, 0.00003, kv_coef=2e-7, qk_coef=3e-9,
                         draft_per_pair=1e-9, draft_per_fed=per_fed)  # fmt: skip
        cost.target_scale.value = rng.uniform(0.5, 2.0)
        factors = rng.uniform(0.5, 2.0, size=4).tolist()
        cost.draft.coefs = [c * f for c, f in zip(cost.draft.calibrated, factors, strict=True)]
        for n in rng.choice(np.arange(1, 9), size=int(rng.integers(0, 5)), replace=False):
            small = cost.small_scales[n]  # passes of n tokens measured apart
            small.value, small.count = rng.uniform(0.5, 2.0), 8
        policy = AdaptiveDraftLength(4, cost)
        a = np.array([rng.uniform(0.0, 0.99)])
        context = np.array([float(rng.integers(1, 3000))])
        other = int(rng.choice([0, 0, 5, 200]))
        lag = np.array([float(rng.choice([0, 0, 0.5, 3.0]))])
        decided = policy.decide(a, context, other, lag)
        gains = policy.estimates.gains(a)
        want = int(policy.search.best_prefix(gains, context, other, lag)[0][0])
        solo = int(policy.search.best_alone(gains, context, lag)[0])
        reason = None if want >= 4 else REASON_BATCH if want < solo else REASON_ACCEPTANCE
        assert (decided.ks, decided.reasons, decided.branches) == ([want], [reason], 1), trial


def test_a_steps_cost_outside_the_passes_makes_speculation_pay_sooner():
    """A step pays for more than its passes (sampling, bookkeeping, a server streaming its
    outputs), once however many tokens it makes. At concurrency 1, half-kept drafts that lose
    to plain decodes on the passes alone (1.5 tokens in 6.5 ms against 1 in 4 ms) win once
    steps are measured to cost 2 ms more (1.5 in 8.5 against 1 in 6)."""
    seconds = [0.0040, 0.0056] + [0.0056 + 0.0005 * n for n in SIZES[2:]]
    cost = CostModel(SIZES, seconds, draft_fixed=0.0009, draft_per_token=0.0)
    reqs = _requests(1, accepted=50, trials=100)
    assert AdaptiveDraftLength(1, cost).choose(reqs).ks == [0]
    for _ in range(7):
        cost.observe_step(1, 0.0060, 0.0040)
    assert cost.step_overhead(1) == 0.0  # too few steps seen yet
    assert AdaptiveDraftLength(1, cost).choose(reqs).ks == [0]
    cost.observe_step(1, 0.0060, 0.0040)
    assert cost.step_overhead(1) == pytest.approx(0.002)
    assert cost.step_overhead(2) == 0.0  # measured per batch size
    assert AdaptiveDraftLength(1, cost).choose(reqs).ks == [1]
    policy = AdaptiveDraftLength(1, cost)  # the vectorised search agrees
    a, context, lag = np.array([policy.estimates.acceptance(reqs[0])]), np.array([3.0]), np.zeros(1)
    assert policy.search.best_prefix(policy.estimates.gains(a), context, 0, lag)[0].tolist() == [1]
    cost.observe_step(1, 1.0, 0.0040)  # a pause counts for at most twice the average
    assert cost.step_overhead(1) == pytest.approx(0.002 + 0.002 / 9)  # the 9th: a mean still


def test_the_engine_charges_decode_steps_for_the_time_outside_their_passes(tiny_dirs):
    """Each decode step that leaves work is charged, when the next step starts, for the
    interval less its passes: what the caller does between steps (here a 20 ms sleep, in a
    server the streaming) counts; the idle time after the last step does not."""
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), max_draft_tokens=2)
    engine = make_engine(tiny_dirs["llama"], spec=spec)
    seen: list[tuple[int, float, float]] = []
    engine.cost_model.observe_step = lambda batch, interval, passes, drafting: seen.append(
        (batch, interval, passes)
    )
    prompts = random_prompts([6, 9], vocab=300, seed=33)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, greedy(8))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        time.sleep(0.02)
    time.sleep(0.3)
    engine.add_request("later", prompts[0], greedy(4))
    drain(engine)
    assert 0 < len(seen) < steps + 4
    assert {batch for batch, _, _ in seen} <= {1, 2}
    assert all(0 <= passes < interval for _, interval, passes in seen)
    assert all(interval - passes >= 0.02 for _, interval, passes in seen[: steps - 2])
    assert all(interval < 0.3 for _, interval, _ in seen)


def test_steps_that_draft_are_charged_their_own_overhead():
    """A drafting step also verifies its drafts and rolls back the rejected ones, so its cost
    outside the passes is measured apart from a plain step's (each kind falls back on the
    other's until measured). Half-kept drafts that win when both kinds cost 2 ms more than
    their passes (1.5 tokens in 8.5 ms against 1 in 6) lose when drafting steps cost 3 ms
    (1.5 in 9.5 against 1 in 6)."""
    seconds = [0.0040, 0.0056] + [0.0056 + 0.0005 * n for n in SIZES[2:]]
    cost = CostModel(SIZES, seconds, draft_fixed=0.0009, draft_per_token=0.0)
    reqs = _requests(1, accepted=50, trials=100)
    for _ in range(8):
        cost.observe_step(1, 0.0060, 0.0040, drafting=False)
    assert cost.step_overhead(1, drafting=True) == pytest.approx(0.002)  # the plain steps'
    assert AdaptiveDraftLength(1, cost).choose(reqs).ks == [1]
    for _ in range(8):
        cost.observe_step(1, 0.0095, 0.0065, drafting=True)
    assert cost.step_overhead(1, drafting=True) == pytest.approx(0.003)
    assert cost.step_overhead(1, drafting=False) == pytest.approx(0.002)
    assert AdaptiveDraftLength(1, cost).choose(reqs).ks == [0]
    policy = AdaptiveDraftLength(1, cost)  # the vectorised searches agree
    a, context, lag = np.array([policy.estimates.acceptance(reqs[0])]), np.array([3.0]), np.zeros(1)
    assert policy.search.best_prefix(policy.estimates.gains(a), context, 0, lag)[0].tolist() == [0]
    assert policy.search.best_uniform(policy.estimates.gains(a), context, 0, lag)[0].tolist() == [0]
    assert policy.search.best_alone(policy.estimates.gains(a), context, lag).tolist() == [0]


def test_batches_past_eight_share_their_step_overhead_by_range_of_sizes():
    """At concurrency 16 the batch moves between 9 and 16 as requests finish and start: the
    sizes 9-16 pool their steps' overhead (one step of each is enough), as 17-32 do."""
    cost = memory_then_compute_bound()
    for batch in range(9, 17):
        cost.observe_step(batch, 0.003, 0.001)
    assert cost.step_overhead(12) == pytest.approx(0.002)
    assert cost.step_overhead(16, drafting=True) == pytest.approx(0.002)  # the plain steps'
    assert cost.step_overhead(8) == 0.0 and cost.step_overhead(17) == 0.0


def test_a_decision_of_no_drafts_stands_until_drafts_are_verified():
    """K = 0 for every request serves PLAIN_REUSE_STEPS steps of the same requests (plain steps
    then cost what the off engine's do); a verified draft (a probe's) ends it at once."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound(), probe_interval=10**6)
    reqs = _requests(2, accepted=0, trials=10**4, context=40)
    searches = []
    search = policy.decision_for
    policy.decision_for = lambda *args: searches.append(1) or search(*args)
    for _ in range(PLAIN_REUSE_STEPS):
        assert policy.choose(reqs).ks == [0, 0]
    assert len(searches) == 1
    policy.choose(reqs)
    assert len(searches) == 2
    policy.observe(reqs[0], 1, 0)
    policy.choose(reqs)
    assert len(searches) == 3
    for req in reqs:  # drafting pays now: a decision of K > 0 serves 4 steps
        req.spec.accepted = req.spec.trials = 10**4
    policy.observe(reqs[0], 1, 1)
    assert all(policy.choose(reqs).ks) and len(searches) == 4
    for _ in range(3):
        policy.choose(reqs)
    assert len(searches) == 4
    policy.choose(reqs)
    assert len(searches) == 5


def test_a_lagging_draft_is_charged_over_the_drafting_runs_the_policy_measures():
    """The draft's catch-up is spread over the drafting steps expected to follow: 32 as a
    prior, then the measured mean length of the runs of drafting steps the policy chose. Runs
    of 2 steps make a 12-token lag cost 6 draft tokens a step, not 12 / 32: a draft that pays
    when it is caught up no longer starts 12 tokens behind."""
    cost = CostModel(SIZES, [0.0040, 0.0042] + [0.0042 + 0.001 * n for n in SIZES[2:]],
                     draft_fixed=0.0005, draft_per_token=0.0004)  # fmt: skip
    policy = AdaptiveDraftLength(1, cost, probe_interval=10**6, reuse_steps=1, plain_reuse_steps=1)
    req = _requests(1, accepted=80, trials=100, context=40)[0]
    behind = _requests(1, accepted=80, trials=100, context=40)[0]
    behind.request_id = "behind"
    behind.num_draft_computed_tokens = behind.num_tokens - 13  # 12 tokens to catch up
    assert policy.catch_up.run_steps == CATCH_UP_STEPS
    assert policy.choose([behind]).ks == [1]  # 12 / 32 of a lag a step: cheap enough
    policy.catch_up.count([], [], probe=True)  # no run open
    req.num_draft_computed_tokens = req.num_tokens  # caught up
    for _ in range(100):  # runs of two drafting steps, each ended by a plain one
        req.spec.accepted = 80
        assert [policy.choose([req]).ks for _ in range(2)] == [[1], [1]]
        req.spec.accepted = 0
        assert policy.choose([req]).ks == [0]
    assert policy.catch_up.run_steps == pytest.approx(2.0, abs=0.05)
    req.spec.accepted = 80
    assert policy.choose([req]).ks == [1]
    assert policy.choose([behind]).ks == [0]
    probing = AdaptiveDraftLength(1, cost, probe_interval=1)  # a probe's forced steps: no run
    req.spec.accepted = 0
    assert sum(probing.choose([req]).ks[0] for _ in range(20)) > 0
    assert probing.catch_up.run_steps == CATCH_UP_STEPS


def test_bigger_passes_learn_a_scale_per_range_of_sizes():
    """On a GPU a pass costs about the same up to a few hundred tokens, and the start-up table
    says so. When real passes of 129-256 tokens take twice what it says and those of 65-128
    what it says, one shared scale moves every size alike, and 48 requests keep drafting K = 4
    (240 tokens a pass); a scale per range of sizes makes those passes dear, and the batch
    stays within 128 tokens (K of 1 or 2). A range seen fewer than 8 times takes the shared
    scale."""
    seconds = [0.001] * 9 + [0.002]  # flat up to 256 tokens (SIZES), then rising
    cost = CostModel(SIZES, seconds, draft_fixed=0.0001, draft_per_token=0.0)
    fresh = CostModel(SIZES, seconds, draft_fixed=0.0001, draft_per_token=0.0)
    requests = _requests(48, accepted=80, trials=100)

    def ks() -> list[int]:
        return AdaptiveDraftLength(4, cost, reuse_steps=1).choose(requests).ks

    assert set(ks()) == {4}
    for _ in range(20):
        cost.observe_target(PassShape(96), float(fresh.target_time(96)))
        cost.observe_target(PassShape(240), 2.0 * float(fresh.target_time(240)))
    for _ in range(7):
        cost.observe_target(PassShape(40), 3.0 * float(fresh.target_time(40)))
    shared = cost.target_scale.value
    assert 1.0 < shared < 3.0
    assert cost.target_time(100) == pytest.approx(float(fresh.target_time(100)))
    assert cost.target_time(200) == pytest.approx(2.0 * float(fresh.target_time(200)))
    assert cost.target_time(40) == pytest.approx(shared * float(fresh.target_time(40)))
    assert cost.target_time(300) == pytest.approx(shared * float(fresh.target_time(300)))
    sizes = np.array([1, 8, 9, 40, 64, 65, 100, 128, 129, 200, 256, 257, 4000, 2**45])
    each = [float(cost.target_time(int(n))) for n in sizes]
    np.testing.assert_allclose(cost.target_time(sizes), each, rtol=1e-12)
    chosen = ks()
    assert set(chosen) <= {1, 2} and 48 + sum(chosen) <= 128
    for scale in cost.size_scales:  # one shared scale only, as before
        scale.count = 0
    assert set(ks()) == {4}


def test_depth_factors_follow_the_decayed_counts():
    """observe() keeps per-depth counts in plain floats; they follow the array recurrence
    kept = 0.995 kept + [d < accepted], predicted = 0.995 predicted + a^d for d <= drafted."""
    policy = AdaptiveDraftLength(4, memory_then_compute_bound())
    kept, predicted = np.zeros(4), np.zeros(4)
    rng = np.random.default_rng(0)
    (req,) = _requests(1, accepted=0, trials=0)
    for _ in range(50):
        drafted = int(rng.integers(1, 6))
        accepted = int(rng.integers(0, drafted + 1))
        n = min(drafted, 4)
        a = policy.estimates.acceptance(req)
        kept = 0.995 * kept
        kept[: min(accepted, n)] += 1
        predicted = 0.995 * predicted
        predicted[:n] += a ** np.arange(1, n + 1)
        req.spec.record(drafted, accepted)
        policy.observe(req, drafted, accepted)
    w = policy.estimates.prior_weight
    # a^d may differ in its last bit: numpy's power can take a vectorised path, not libm's.
    np.testing.assert_allclose(
        policy.estimates.depth_factors(), (kept + w) / (predicted + w), rtol=1e-13
    )


def test_host_cost_bench_separates_plain_and_drafting_steps():
    from bench.host_cost import measure

    times = measure([2], steps=6, rounds=1)
    assert times[2, "off"][1] == [] and len(times[2, "off"][0]) == 6  # off never drafts
    assert times[2, "K=2"][0] == [] and len(times[2, "K=2"][1]) == 6  # fixed K always does
    assert all(t > 0 for kinds in times.values() for xs in kinds for t in xs)
