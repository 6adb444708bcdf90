"""Speculative decoding end to end: lossless output, KV release on rejection."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import SpecConfig
from engine.model.head import HEAD_TOKENS_FILE, restrict_head
from engine.model.runner import ModelRunner
from engine.spec.policy import DraftLengths
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.types.request import Request, SamplingParams
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

MAX_TOKENS = 24


class PerRequestK:
    """A test policy: request i of the batch always gets K = ks[i] (1..8)."""

    def __init__(self, ks: dict[str, int]) -> None:
        self.ks = ks

    max_draft_tokens = 8

    def choose(self, requests: list[Request], num_other_tokens: int = 0) -> DraftLengths:
        return DraftLengths([self.ks[r.request_id] for r in requests], [None] * len(requests))

    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, branches: int = 1
    ) -> None:
        pass

    def lookup_length(self, request: Request, k: int, match: int, found: int, batch: int) -> int:
        return min(k, found)

    def observe_lookup(self, match: int, num_drafted: int, num_accepted: int, request=None) -> None:
        pass


def _run_with_ks(engine, prompts, max_tokens=MAX_TOKENS, params=None):
    ids = [f"s{i}" for i in range(len(prompts))]
    engine.planner.policy = PerRequestK({rid: 1 + i % 8 for i, rid in enumerate(ids)})
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params or greedy(max_tokens))
    outputs = drain(engine)
    return [outputs[rid] for rid in ids]


def with_head_tokens(model_dir: Path, out: Path, token_ids: list[int]) -> Path:
    """A copy of `model_dir` whose LM head covers `token_ids` only."""
    shutil.copytree(model_dir, out)
    (out / HEAD_TOKENS_FILE).write_text(json.dumps({"token_ids": token_ids}))
    return out


@pytest.fixture(scope="module")
def restricted_draft(tiny_dirs, tmp_path_factory) -> Path:
    """The tiny draft with an LM head over every third token of its vocabulary."""
    source = tiny_dirs["llama_draft"]
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    out = tmp_path_factory.mktemp("restricted") / "draft"
    return with_head_tokens(source, out, list(range(0, vocab, 3)))


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_dirs):
    # Repetitive prompts give the n-gram proposer something to find.
    prompts = random_prompts([5, 9, 14, 3, 22, 30, 7, 17, 11, 40], vocab=300, seed=11)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    return prompts, hf_greedy(tiny_dirs["llama"], prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "drafter", ["different_draft", "restricted_head", "draft_is_target", "ngram"]
)
def test_greedy_speculative_equals_target_only(
    tiny_dirs, prompts_and_reference, restricted_draft, drafter
):
    prompts, expected = prompts_and_reference
    target = tiny_dirs["llama"]
    spec = {
        "different_draft": SpecConfig("draft", str(tiny_dirs["llama_draft"]), 8, "fixed"),
        "restricted_head": SpecConfig("draft", str(restricted_draft), 8, "fixed"),
        "draft_is_target": SpecConfig("draft", str(target), 8, "fixed"),
        "ngram": SpecConfig("ngram", max_draft_tokens=8, draft_length="fixed"),
    }[drafter]
    engine = make_engine(target, spec=spec, block_size=4, max_num_batched_tokens=96)
    drafted: list[int] = []
    if engine.proposer is not None:
        propose = engine.proposer.propose

        def recording_propose(*args):
            batch = propose(*args)
            drafted.extend(t for per_request in batch.token_ids for t in per_request)
            return batch

        engine.proposer.propose = recording_propose
    assert _run_with_ks(engine, prompts) == expected
    stats = engine.stats()
    assert stats.spec_drafted_tokens > 0 and stats.spec_verify_passes > 0
    if drafter == "draft_is_target":
        assert stats.spec_accepted_tokens == stats.spec_drafted_tokens  # every draft accepted
    if drafter == "different_draft":
        assert stats.spec_accepted_tokens < stats.spec_drafted_tokens / 2  # disagrees often
        assert stats.spec_blocks_released > 0
    if drafter == "restricted_head":
        # Every drafted token comes from the head's subset.
        assert drafted and all(t % 3 == 0 for t in drafted)


@pytest.mark.parametrize("drafter", ["draft_is_target", "ngram"])
def test_greedy_with_penalties_and_min_tokens_equals_target_only(tiny_dirs, drafter):
    """Each verified row sees the drafts before it as generated: penalties and the
    min_tokens mask give the target-only greedy text under speculation too."""
    target = tiny_dirs["llama"]
    prompts = [p + p for p in random_prompts([6, 11, 4], vocab=300, seed=5)]  # for n-grams
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        presence_penalty=0.9,
        frequency_penalty=0.7,
        min_tokens=6,
        stop_token_ids=tuple(range(0, 300, 7)),
    )
    plain = _run_with_ks(make_engine(target), prompts, params=params)
    spec = {
        "draft_is_target": SpecConfig("draft", str(target), 8, "fixed"),
        "ngram": SpecConfig("ngram", max_draft_tokens=8, draft_length="fixed"),
    }[drafter]
    engine = make_engine(target, spec=spec)
    assert _run_with_ks(engine, prompts, params=params) == plain
    assert engine.stats().spec_drafted_tokens > 0
    assert min(len(out) for out in plain) >= 6  # the stop ids were masked for six tokens


def test_a_vanishing_temperature_decodes_greedily(tiny_dirs, prompts_and_reference):
    """A temperature the API allows but logits cannot be divided by (5e-324 overflows to
    inf) is greedy decoding, with or without drafts; it once made NaN distributions."""
    prompts, reference = prompts_and_reference
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=5e-324, ignore_eos=True)
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), 4, "fixed")
    for engine in (make_engine(tiny_dirs["llama"]), make_engine(tiny_dirs["llama"], spec=spec)):
        assert _run_with_ks(engine, prompts[:4], params=params) == reference[:4]


def test_rejected_drafts_across_blocks_are_released_right_after_the_step(tiny_dirs):
    target = tiny_dirs["llama"]
    # Fixed K: the adaptive policy would (rightly) stop drafting for this hopeless draft.
    spec = SpecConfig("draft", str(tiny_dirs["llama_draft"]), 8, "fixed")
    engine = make_engine(target, spec=spec, block_size=2)
    prompt = random_prompts([6], vocab=300, seed=12)[0]
    req = engine.add_request("r", prompt, greedy(30))
    engine.step()  # prefill
    steps_that_released = 0
    while engine.has_work():
        released_before = engine.stats().spec_blocks_released
        engine.step()  # allocates blocks for 1 + 8 tokens (blocks of 2), verifies, trims
        engine.check_invariants()
        if req.status.finished:
            break
        # Right after the step the request holds only blocks covering verified tokens, and
        # every other block is back in the free pool.
        table = engine.kv.block_table("r")
        assert len(table) == engine.kv.blocks_needed(req.num_computed_tokens)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks - len(table)
        steps_that_released += engine.stats().spec_blocks_released > released_before
    assert steps_that_released > 0
    drain(engine)


def test_fewer_drafts_than_k_and_mixed_prefill(tiny_dirs):
    """n-gram finds nothing for fresh random text: the engine must cope with 0 < drafts < K
    while other requests are still prefilling in the same step."""
    target = tiny_dirs["llama"]
    engine = make_engine(
        target,
        spec=SpecConfig("ngram", max_draft_tokens=4, draft_length="fixed"),
        max_num_batched_tokens=32,
    )
    prompts = random_prompts([3, 60, 45], vocab=300, seed=13)
    for i, p in enumerate(prompts):
        engine.add_request(f"n{i}", p, greedy(12))
    outputs = drain(engine)
    assert [outputs[f"n{i}"] for i in range(3)] == hf_greedy(target, prompts, 12)


# --- statistical test of the whole pipeline ---------------------------------------------

VOCAB = 4
NEW_TOKENS = 4
PROMPT = [1, 2, 3]


def _processed(logits: torch.Tensor, generated: list[int], params: SamplingParams):
    """Reference processing of one position's float64 logits, written apart from the
    engine's: the logit bias, penalties on the tokens generated so far, stop tokens masked
    before min_tokens, temperature, then top-k, then the smallest most-likely set whose mass
    reaches top_p."""
    logits = logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    for token in set(generated):
        logits[token] -= params.frequency_penalty * generated.count(token)
        logits[token] -= params.presence_penalty
    if len(generated) < params.min_tokens:
        logits[list(params.stop_token_ids)] = float("-inf")
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = params.top_k or len(probs)
    top = sorted_p[:k] / sorted_p[:k].sum()
    before = top.cumsum(0) - top
    keep[order[:k][(before < params.top_p) | (torch.arange(k) == 0)]] = True
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def _exact_distribution(model_dir: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Every continuation of PROMPT up to NEW_TOKENS (shorter when a stop token ends it)
    with its probability under the target and `params`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    stops = set(params.stop_token_ids)
    exact: dict[tuple[int, ...], float] = {}

    def extend(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == NEW_TOKENS or (seq and seq[-1] in stops):
            exact[seq] = exact.get(seq, 0.0) + prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(seq)])).logits[0, -1]
        probs = _processed(logits, list(seq), params)
        for token in range(VOCAB):
            if probs[token] > 0:
                extend((*seq, token), prob * probs[token].item())

    extend((), 1.0)
    return exact


def _chi_square_test(counts: dict, exact: dict, n: int) -> tuple[float, float]:
    """Chi-square statistic with cells of expected count < 5 pooled, and its 99.9% bound."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for seq, prob in exact.items():
        obs, exp = counts.get(seq, 0), prob * n
        if exp == 0:
            assert obs == 0, f"sampled {seq}, which the target never produces"
        elif exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
        else:
            stat += (obs - exp) ** 2 / exp
            cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    dof = cells - 1
    z = 3.09  # 99.9% (Wilson-Hilferty approximation of the chi-square quantile)
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, bound


def _sampling_engine(target: Path, spec: SpecConfig):
    """An engine with room for thousands of short sampled continuations at once."""
    return make_engine(
        target,
        spec=spec,
        num_blocks=4096,
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        prefix_caching=False,
        max_waiting=4000,
    )


def _sample_continuations(
    target: Path,
    draft: Path,
    params: SamplingParams,
    n: int = 4000,
    verification: str = "block",
    seeded: bool = False,
    branches: int = 1,
    tree_drafts: str = "sampled",
    ngram_assist: int = 0,
):
    """n sampled continuations of PROMPT, drafts from `draft`: (counts, stats, n). With
    `seeded`, request i brings seed i (the coupled sampler: a different path to the target)."""
    spec = SpecConfig(
        "draft",
        str(draft),
        max_draft_tokens=3,
        draft_length="fixed",
        verification=verification,
        draft_branches=branches,
        tree_drafts=tree_drafts,
        ngram_assist=ngram_assist,
    )
    engine = _sampling_engine(target, spec)
    for i in range(n):
        engine.add_request(f"t{i}", PROMPT, replace(params, seed=i) if seeded else params)
    outputs = drain(engine)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts, engine.stats(), n


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


@pytest.mark.parametrize(
    "params",
    [
        _params(temperature=1.0),
        _params(temperature=1.0, top_p=0.8),
        _params(temperature=0.8, top_k=2),
        _params(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6),
        _params(temperature=1.2, top_k=3, top_p=0.7, frequency_penalty=1.0),
        _params(temperature=1.0, min_tokens=2, stop_token_ids=(3,)),
        _params(temperature=1.0, top_p=0.9, logit_bias=((1, 1.5), (3, -2.0)), presence_penalty=0.5),
    ],
    ids=["plain", "top_p", "top_k", "penalties", "all_cuts", "min_tokens", "logit_bias"],
)
def test_sampled_continuations_follow_the_target_distribution(tiny_vocab_pair, params):
    """Speculative sampling with K = 3 drafts per step (block verification, the default)
    against the exact distribution of 4-token continuations under the target and the
    request's processing."""
    target, draft = tiny_vocab_pair
    exact = _exact_distribution(target, params)
    counts, stats, n = _sample_continuations(target, draft, params)
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens  # both paths exercised
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"


@pytest.mark.parametrize(
    "params",
    [_params(temperature=1.0), _params(temperature=1.0, top_p=0.8)],
    ids=["plain", "top_p"],
)
@pytest.mark.parametrize("mode", ["token", "seeded", "tree", "tree_top"])
def test_token_verification_and_seeded_sampling_follow_the_target(tiny_vocab_pair, params, mode):
    """The same test for token-by-token verification, for seeded requests (seed i for
    request i), whose tokens come from noise keyed by (seed, position) instead, and for draft
    trees (two candidates for the next token, each continued to depth 3; drawn without
    replacement, or the draft's top one plus a draw from the rest)."""
    target, draft = tiny_vocab_pair
    exact = _exact_distribution(target, params)
    if mode == "token":
        counts, stats, n = _sample_continuations(target, draft, params, verification="token")
    elif mode == "seeded":
        counts, stats, n = _sample_continuations(target, draft, params, seeded=True)
    elif mode == "tree":
        counts, stats, n = _sample_continuations(target, draft, params, branches=2)
    else:
        counts, stats, n = _sample_continuations(
            target, draft, params, branches=2, tree_drafts="top"
        )
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens  # both paths exercised
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"


def test_sampled_continuations_with_a_restricted_draft_head(tiny_vocab_pair, tmp_path):
    """A draft whose head covers tokens {0, 2} only (q is 0 elsewhere) stays lossless."""
    target, draft = tiny_vocab_pair
    restricted = with_head_tokens(draft, tmp_path / "draft", [0, 2])
    exact = _exact_distribution(target, _params(temperature=1.0))
    counts, stats, n = _sample_continuations(target, restricted, _params(temperature=1.0))
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"


def test_a_restricted_draft_heads_greedy_pick_is_the_vocabularys_argmax():
    """The draft's greedy chains pick from its head's own columns, not widened to the
    vocabulary: the same token, ties included (the head's tokens in increasing order), and
    a request whose logits are masked (here min_tokens over a stop) still gets the widened,
    masked pick."""

    class Runner:  # what DraftModelProposer reads of a runner with a restricted head
        vocab_size = 12
        head_tokens = torch.tensor([1, 4, 5, 9])
        widen = ModelRunner.widen

    proposer = DraftModelProposer(Runner(), 12)
    logits = torch.tensor(
        [[0.5, 2.0, -1.0, 0.0], [3.0, 1.0, 3.0, 2.0], [-2.0, -3.0, -1.0, -4.0]]
    )  # row 1: a tie of tokens 1 and 5
    plain = [Request(f"r{i}", [3], SamplingParams(max_tokens=4)) for i in range(3)]
    entries = [(req, [], 1) for req in plain]
    wide = Runner().widen(logits)
    expected = wide.argmax(dim=-1).tolist()
    assert expected == [4, 1, 5]
    assert proposer._pick(logits, entries, False) == [([t], None) for t in expected]
    # min_tokens masks the stop token 5 for this request: the widened path, masked
    masked = Request("m", [3], SamplingParams(max_tokens=4, min_tokens=2), eos_token_ids=(5,))
    assert 5 in masked.stop_token_ids
    picked = proposer._pick(logits[2:], [(masked, [], 1)], False)
    assert picked == [([1], None)]  # 5 (-1.0) masked: 1 (-2.0) is next


def test_a_restricted_head_keeps_its_tokens_in_increasing_order(tiny_dirs, tmp_path):
    """head_tokens.json in any order: the head's columns follow increasing token ids (the
    greedy pick above relies on it), each the vocabulary row of its token."""
    model_dir = with_head_tokens(tiny_dirs["llama_draft"], tmp_path / "draft", [7, 2, 30, 11])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    full = model.get_output_embeddings().weight.detach().clone()
    index = restrict_head(model, str(model_dir))
    assert index.tolist() == [2, 7, 11, 30]
    assert torch.equal(model.get_output_embeddings().weight, full[index])
