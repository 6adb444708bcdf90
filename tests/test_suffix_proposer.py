"""Suffix decoding (engine/spec/proposers/suffix.py): its tries, its drafts, lossless output."""

from __future__ import annotations

import pytest
import yaml

from engine.config import SpecConfig
from engine.spec.proposers.suffix import SuffixProposer
from engine.spec.proposers.suffix_tree import (
    SuffixCache,
    SuffixTrie,
    draft_chain,
    draft_tree,
    with_continuation,
)
from engine.types.batch import ScheduledRequest, SchedulerOutput
from engine.types.request import Request, RequestStatus, SamplingParams
from server.cli import build_parser
from server.settings import load_settings
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts
from tests.test_speculative import (
    PROMPT,
    _chi_square_test,
    _exact_distribution,
    _params,
    _sampling_engine,
)


def _node(trie: SuffixTrie, tokens: list[int]):
    node = trie.root
    for t in tokens:
        node = node.children[t]
    return node


def _nodes(trie: SuffixTrie) -> int:
    stack, n = [trie.root], 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def test_counts_links_and_the_depth_bound():
    trie = SuffixTrie(3)
    trie.insert([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert _node(trie, [1]).count == 3 and _node(trie, [1, 2]).count == 3
    ab = _node(trie, [1, 2])
    assert ab.total == 3 and {t: c.count for t, c in ab.children.items()} == {3: 2, 4: 1}
    assert _node(trie, [1, 2, 3]).link is _node(trie, [2, 3])
    assert _node(trie, [2]).link is trie.root
    assert all(not c.children for c in _node(trie, [1, 2]).children.values())  # depth 3
    assert trie.root.total == 9


def test_the_longest_match_and_the_most_frequent_continuation():
    trie = SuffixTrie(8)
    trie.insert([5, 1, 2, 3, 9, 1, 2, 3, 9, 7, 2, 3, 8])
    node = trie.match([4, 4, 1, 2, 3], 4)
    assert node.depth == 3  # [1, 2, 3]; [4, 1, 2, 3] never occurred
    assert draft_chain(node, 5) == [9, 1, 2, 3, 9]  # the path seen twice
    assert draft_chain(node, 2) == [9, 1]
    assert draft_chain(trie.match([2, 3], 4), 1) == [9]  # 9 twice, 8 once
    assert trie.match([6, 6], 4) is trie.root
    end = trie.match([9, 7, 2, 3, 8], 8)  # the sequence's end: seen, never followed
    assert end.depth == 5 and end.total == 0
    assert with_continuation(end, 8).depth == 0  # [8] never followed either


def test_a_trees_parents_come_first_and_its_shape_is_bounded():
    trie = SuffixTrie(8)
    for tail in ([1, 2], [1, 3], [1, 2], [4, 5], [1, 2], [4, 6]):
        trie.insert([7, *tail])
    node = trie.match([7], 4)
    tokens, parents = draft_tree(node, 2, 2)
    assert tokens == [1, 2, 4, 3] and parents == [0, 1, 0, 1]
    assert all(p <= j for j, p in enumerate(parents))  # parent p is draft p - 1, before j
    tokens, parents = draft_tree(node, 3, 1)  # one candidate for the next token
    assert parents.count(0) == 1 and len(tokens) <= 3
    assert draft_tree(node, 1, 3)[1] == [0, 0]  # depth 1: the root's children (6: 1/6 >= 0.1)
    flat = SuffixTrie(4)
    for t in range(10, 21):  # eleven continuations of 1, each 1/13 < MIN_PROB ...
        flat.insert([1, t])
    flat.insert([1, 2, 1, 2])  # ... and one 2/13
    assert draft_tree(flat.root.children[1], 2, 8) == ([2, 1], [0, 1])


def test_the_global_cache_stays_in_its_budget_and_evicts_the_oldest_first():
    cache = SuffixCache(10, 4)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    assert cache.num_tokens == 8
    cache.add([9, 9, 9])  # 11 > 10: [1, 2, 3, 4] goes
    assert cache.num_tokens == 7 and [e[0] for e in cache.entries] == [5, 9]
    assert 1 not in cache.trie.root.children and cache.trie.root.total == 7
    assert _node(cache.trie, [9, 9]).count == 2
    cache.add(list(range(100, 125)))  # longer than the budget: its last 10 tokens
    assert cache.num_tokens == 10 and list(cache.entries) == [list(range(115, 125))]
    assert set(cache.trie.root.children) == set(range(115, 125))
    fresh = SuffixTrie(4)
    fresh.insert(range(115, 125))
    assert _nodes(cache.trie) == _nodes(fresh)  # nothing of the evicted outputs is left
    assert SuffixCache(0, 4).add([1, 2]) is None


def _request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=64))
    req.output_token_ids = list(output)
    req.status = RequestStatus.RUNNING
    return req


def _propose(proposer, reqs, k=4, branches=1):
    sched = SchedulerOutput([ScheduledRequest(r, 1, k, branches) for r in reqs])
    return proposer.propose(sched, [[] for _ in reqs])


def test_drafts_follow_the_own_context_and_the_cache_and_free_the_request():
    proposer = SuffixProposer(max_depth=12, max_draft_tokens=4, cache_tokens=100)
    text = [10, 11, 12, 13, 14, 15, 16, 17]
    req = _request("a", text + [30], [10, 11, 12])
    assert _propose(proposer, [req]).token_ids == [[13, 14, 15]]  # 3-token match: 3 drafts
    req.output_token_ids += [13, 14, 15, 16]  # verified since: indexed at the next step
    assert _propose(proposer, [req]).token_ids == [[17, 30, 10, 11]]  # K = 4 caps it
    assert _propose(proposer, [req], k=2).token_ids == [[17, 30]]
    assert _propose(proposer, [req], k=0).token_ids == [[]]
    assert list(proposer.requests) == [req]
    req.status = RequestStatus.FINISHED_STOPPED
    proposer.release(req)
    assert not proposer.requests  # freed; its output joins the cache
    assert proposer.cache.num_tokens == 7
    other = _request("b", [99, 98, 12, 13])  # no match in its own tokens: the cache's
    assert _propose(proposer, [other]).token_ids == [[14, 15]]  # 2-token match: at most 2
    assert _propose(proposer, [_request("c", [50, 51])]).token_ids == [[]]  # no match
    failed = _request("d", [1], [5, 5, 5])
    failed.status = RequestStatus.FINISHED_ERROR
    proposer.release(failed)
    assert proposer.cache.num_tokens == 7  # a failed request's output is not cached


def test_tree_drafts_and_grammar_chains():
    proposer = SuffixProposer(max_depth=12, max_draft_tokens=3, cache_tokens=0)
    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
    req = _request("a", prompt)
    # The match [1, 2] (2 tokens: depth 2): 3 (2/3) or 5; after 3, 4 or 7; after 5, 6.
    batch = _propose(proposer, [req], k=3, branches=2)
    assert batch.token_ids == [[3, 5, 4, 7]] and batch.parents == [[0, 0, 1, 1]]  # 2 x 2
    assert _propose(proposer, [req], k=3).token_ids == [[3, 4]]

    class Grammar:
        def valid_prefix(self, tokens):
            return 1

    req.grammar = Grammar()
    batch = _propose(proposer, [req], k=3, branches=2)  # a grammar's drafts are a chain
    assert batch.token_ids == [[3]] and batch.parents is None


SPECS = {
    "chain_fixed": SpecConfig("suffix", max_draft_tokens=6, draft_length="fixed"),
    "tree_fixed": SpecConfig("suffix", max_draft_tokens=4, draft_length="fixed", draft_branches=2),
    "chain_adaptive": SpecConfig("suffix", max_draft_tokens=6, draft_length="adaptive"),
    "tree_adaptive": SpecConfig("suffix", max_draft_tokens=4, draft_branches=2),
}


@pytest.fixture(scope="module")
def repetitive(tiny_dirs):
    prompts = random_prompts([6, 10, 14, 5, 20, 9, 12, 16], vocab=300, seed=3)
    prompts = [p * 3 for p in prompts]  # spans to copy
    return prompts, hf_greedy(tiny_dirs["llama"], prompts, 24)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_suffix_decoding_equals_target_only(tiny_dirs, repetitive, name):
    prompts, expected = repetitive
    engine = make_engine(
        tiny_dirs["llama"], spec=SPECS[name], block_size=4, num_blocks=48, max_num_batched_tokens=96
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(24))
    outputs = drain(engine)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    stats = engine.stats()
    assert stats.spec_drafted_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.preemptions > 0  # the tight pool recomputed some
    if name.startswith("tree_fixed"):
        assert stats.spec_tree_steps > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.proposer.requests  # every request's trie freed
    assert 0 < engine.proposer.cache.num_tokens <= SPECS[name].suffix_cache_tokens


def test_an_aborted_request_is_freed(tiny_dirs):
    spec = SpecConfig("suffix", max_draft_tokens=4, draft_length="fixed")
    engine = make_engine(tiny_dirs["llama"], spec=spec)
    engine.add_request("a", [5, 6, 7, 8] * 4, greedy(40))
    for _ in range(4):
        engine.step()
    assert len(engine.proposer.requests) == 1
    engine.abort("a")
    assert not engine.proposer.requests and not engine.has_work()


def test_sampling_with_suffix_drafts_follows_the_target(tiny_vocab_pair):
    """4-token continuations at temperature 1 and top_p 0.8 with draft trees from the tries
    (the request's own and earlier outputs'), against the exact distribution (chi-square).
    One-hot model-free chains go through the verifier as ngram's do (tests/test_speculative.py);
    here the drafts also depend on other requests' sampled outputs."""
    branches = 2
    target, _ = tiny_vocab_pair
    params = _params(temperature=1.0, top_p=0.8)
    exact = _exact_distribution(target, params)
    spec = SpecConfig("suffix", max_draft_tokens=3, draft_length="fixed", draft_branches=branches)
    engine = _sampling_engine(target, spec)
    n = 3000
    for i in range(n):
        engine.add_request(f"t{i}", PROMPT, params)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in drain(engine).values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    assert (stats.spec_tree_steps > 0) == (branches > 1)
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"


def test_the_options_validate():
    assert SpecConfig(method="suffix").suffix_max_depth == 24
    assert SpecConfig(method="suffix", suffix_cache_tokens=0).suffix_cache_tokens == 0
    with pytest.raises(ValueError, match="suffix_max_depth must be between 2 and 64"):
        SpecConfig(method="suffix", suffix_max_depth=1)
    with pytest.raises(ValueError, match="suffix_max_depth must exceed --max-draft-tokens"):
        SpecConfig(method="suffix", suffix_max_depth=8, max_draft_tokens=8)
    with pytest.raises(ValueError, match="suffix_cache_tokens must be between"):
        SpecConfig(method="suffix", suffix_cache_tokens=-1)


def test_the_flag_and_the_yaml_keys_select_it(tiny_dirs, tmp_path):
    config = tmp_path / "c.yaml"
    yaml_spec = {"suffix_max_depth": 16, "suffix_cache_tokens": 0}
    config.write_text(
        yaml.safe_dump({"model": {"path": str(tiny_dirs["llama"])}, "speculative": yaml_spec})
    )
    args = vars(build_parser().parse_args(["serve", "--speculative-method", "suffix"]))
    overrides = {k: v for k, v in args.items() if "." in k}
    spec = load_settings(str(config), overrides, environ={}).engine.spec
    assert (spec.method, spec.suffix_max_depth, spec.suffix_cache_tokens) == ("suffix", 16, 0)
    config.write_text(
        yaml.safe_dump(
            {"model": {"path": str(tiny_dirs["llama"])}, "speculative": {"suffix_max_depth": 99}}
        )
    )
    with pytest.raises(ValueError, match="suffix_max_depth"):
        load_settings(str(config), overrides, environ={})
