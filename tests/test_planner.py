"""The planner, speculation's one seam (engine/spec/planner.py), on its own: what it plans for
each decoding request and what it learns from a verified step. No model: a policy that
records what it is told, and requests whose counters say they decode."""

from __future__ import annotations

import random

from engine.config import SpecConfig
from engine.spec.planner import FORCED_MAX, SpecPlanner
from engine.spec.policy import DraftLengths
from engine.spec.step import StepResult
from engine.spec.verifier import VerifyResult
from engine.types.batch import ScheduledRequest, SchedulerOutput
from engine.types.outputs import StepTokens
from engine.types.request import Request, RequestStatus, SamplingParams, SpecStats


class RecordingPolicy:
    """K per request id, and every observation it is fed."""

    def __init__(self, ks: dict[str, int], max_draft_tokens: int = 3, branches: int = 1) -> None:
        self.ks, self.max_draft_tokens, self.branches = ks, max_draft_tokens, branches
        self.observed: list[tuple[str, int, int, int]] = []
        self.lookups: list[tuple[int, int, int]] = []

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        ks = [self.ks[r.request_id] for r in requests]
        reasons = ["low_acceptance" if k < self.max_draft_tokens else None for k in ks]
        return DraftLengths(ks, reasons, self.branches)

    def observe(self, request: Request, num_drafted: int, num_accepted: int, branches=1) -> None:
        self.observed.append((request.request_id, num_drafted, num_accepted, branches))

    def lookup_length(self, request: Request, k: int, match: int, found: int, batch: int) -> int:
        return min(k, found)

    def observe_lookup(self, match: int, num_drafted: int, num_accepted: int, request=None) -> None:
        self.lookups.append((match, num_drafted, num_accepted))


class ForcingGrammar:
    """A grammar that forces `tokens` next (only `forced` is read when planning)."""

    failure = None
    stopped = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def forced(self) -> list[int]:
        return list(self.tokens)


def _decoding(request_id: str, prompt: list[int]) -> Request:
    req = Request(request_id, prompt, SamplingParams(max_tokens=32))
    req.num_computed_tokens = len(prompt) - 1  # only its last token is missing: it decodes
    req.status = RequestStatus.RUNNING
    return req


def test_a_grammar_forces_its_tokens_and_a_lookup_gives_its_continuation():
    forced = _decoding("g", [1, 2, 3])
    forced.grammar = ForcingGrammar(list(range(10, 10 + FORCED_MAX + 2)))
    repeats = _decoding("l", [5, 6, 7, 8, 5, 6, 7])  # its suffix 5 6 7 occurred: 8 follows
    plain = _decoding("p", [9, 9, 4])
    policy = RecordingPolicy({"g": 0, "l": 2, "p": 1}, branches=2)
    spec = SpecConfig("draft", "unused", max_draft_tokens=3, ngram_assist=2)
    planner = SpecPlanner(spec, policy, proposer=None)
    assert planner.lookup is None  # a lookup assists a draft model only
    # As the n-gram lookup finds them: only `repeats` has an earlier occurrence of its suffix.
    planner.keeps_draft_kv = True  # as beside a draft model
    planner.lookup = lambda tokens, k: (
        (3, [8, 5, 6][:k]) if tokens == repeats.token_bytes() else (0, [])
    )
    plans = planner.plan([forced, repeats, plain], num_other_tokens=0)

    g = plans[forced]  # the grammar's tokens whatever K the policy chose, as a chain
    assert (g.k, g.given, g.width, g.looked_up, g.reason) == (
        FORCED_MAX,
        list(range(10, 14)),
        1,
        False,
        None,
    )
    lookup = plans[repeats]  # the lookup's drafts in place of the proposer's, as a chain
    assert (lookup.k, lookup.given, lookup.width, lookup.lookup_match) == (2, [8, 5], 1, 3)
    assert lookup.reason == "low_acceptance"  # the policy's reason stands
    p = plans[plain]  # the proposer drafts, in the policy's tree width
    assert (p.k, p.given, p.width) == (1, None, 2)


def test_in_a_batch_a_lookup_drafts_what_pays_at_its_match_length_within_the_batch_k():
    """Prompt lookup alone (`ngram`): in a batch, each request's lookup gets the batch's K as
    its cap and the policy's length for its match (a short, rarely kept match: none); a
    request whose lookup drafts nothing verifies no proposer drafts either."""
    copying = _decoding("copy", [5, 6, 7, 8, 5, 6, 7])
    chatting = _decoding("chat", [1, 2, 3, 4, 9, 3])
    told: list[tuple[str, int, int, int, int]] = []

    class ByMatch(RecordingPolicy):
        def lookup_length(self, request, k, match, found, batch):
            told.append((request.request_id, k, match, found, batch))
            return min(k, found) if match >= 3 else 0  # a 1-token match does not pay

    planner = SpecPlanner(SpecConfig("ngram", None, 4), ByMatch({"copy": 2, "chat": 3}, 4), None)
    planner.lookup = lambda tokens, k: (
        (3, [8, 5, 6, 7]) if tokens == copying.token_bytes() else (1, [4, 9, 3])
    )
    plans = planner.plan([copying, chatting], num_other_tokens=0)
    assert told == [("copy", 2, 3, 4, 2), ("chat", 3, 1, 3, 2)]
    assert (plans[copying].k, plans[copying].given) == (2, [8, 5])
    assert (plans[chatting].k, plans[chatting].given) == (0, None)


def test_observe_feeds_each_kind_of_draft_to_its_own_count_and_skips_aborted_requests():
    reqs = [_decoding(rid, [1, 2, 3]) for rid in ("proposed", "looked", "forced", "aborted")]
    sched = SchedulerOutput(
        [
            ScheduledRequest(reqs[0], 1, 3, reason=None),
            ScheduledRequest(reqs[1], 1, 2, forced=[4, 5], lookup_match=3, reason="batch_cost"),
            ScheduledRequest(reqs[2], 1, 2, forced=[6, 7]),
            ScheduledRequest(reqs[3], 1, 3, reason="kv_memory"),
        ]
    )
    reqs[3].status = RequestStatus.FINISHED_ABORTED  # aborted while the step ran
    tokens = {
        "proposed": StepTokens([1, 2, 3], num_drafted=3, num_accepted=2),
        "looked": StepTokens([4], num_drafted=2, num_accepted=0),
        "forced": StepTokens([6, 7, 8], num_drafted=2, num_accepted=2),
        "aborted": StepTokens([1], num_drafted=3, num_accepted=0),
    }
    policy = RecordingPolicy({})
    planner = SpecPlanner(SpecConfig("draft", "unused"), policy, proposer=None)
    planner.keeps_draft_kv = True  # as beside a draft model: lookups counted apart
    planner.observe(StepResult(sched, None, VerifyResult(tokens), 0.0, 0.0))

    assert policy.observed == [("proposed", 3, 2, 1)]  # only the proposer's drafts teach it
    assert policy.lookups == [(3, 2, 0)]
    counters = planner.counters
    assert (counters.totals.drafted, counters.totals.accepted) == (3, 2)
    assert (reqs[0].spec.drafted, reqs[0].spec.accepted) == (3, 2)
    assert (counters.lookup_drafted, counters.lookup_accepted) == (2, 0)
    assert (counters.forced_drafted, counters.forced_accepted) == (2, 2)
    assert reqs[3].spec.drafted == 0  # the aborted request's step teaches nothing
    assert counters.reasons == {"batch_cost": 1, "kv_memory": 1}  # every scheduled cut counts


def test_the_engines_counts_of_a_steps_chains_equal_recording_each_chain_alone():
    rng = random.Random(3)
    one_by_one, at_once = SpecStats(), SpecStats()
    chains: list[tuple[int, int]] = []
    for _ in range(40):
        drafted = [rng.randint(1, 6) for _ in range(rng.randint(1, 9))]
        accepted = [rng.randint(0, d) for d in drafted]
        for d, a in zip(drafted, accepted, strict=True):
            one_by_one.record(d, a)
        at_once.record_many(drafted, accepted)
        chains += zip(drafted, accepted, strict=True)
    assert at_once == one_by_one
    # Position p counts the chains that drafted (accepted) more than p tokens.
    assert at_once.drafted_by_position == [sum(d > p for d, _ in chains) for p in range(6)]
    assert at_once.accepted_by_position == [sum(a > p for _, a in chains) for p in range(6)]
    assert at_once.trials == sum(a + (a < d) for d, a in chains)
    assert at_once.drafted_by_position[0] == at_once.verify_passes > 40
