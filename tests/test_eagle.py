"""The feature draft (EAGLE): what the engine serves is what scripts/train_eagle.py trains,
and with it the output stays the target's (greedy token for token, sampling in distribution)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from engine.config import SpecConfig
from engine.model.inputs import SeqInput
from engine.spec.proposers.eagle import EagleProposer, is_feature_draft
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts
from tests.test_speculative import (
    _chi_square_test,
    _exact_distribution,
    _params,
    _sample_continuations,
)
from tests.tiny_models import build_feature_draft

HEAD = list(range(0, 320, 2))  # a restricted head: every other token


@pytest.fixture(scope="module")
def feature_draft(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle") / "draft"
    return build_feature_draft(out, tiny_dirs["llama"], seed=3, head_tokens=HEAD)


def _engine(target, draft_dir, k=4, length="fixed", **kw):
    return make_engine(target, spec=SpecConfig("draft", str(draft_dir), k, length), **kw)


def test_the_directory_is_recognised_and_loaded_as_a_feature_draft(tiny_dirs, feature_draft):
    draft_dir, _ = feature_draft
    assert is_feature_draft(str(draft_dir)) and not is_feature_draft(str(tiny_dirs["llama"]))
    engine = _engine(tiny_dirs["llama"], draft_dir)
    assert isinstance(engine.proposer, EagleProposer)
    # The draft reads the target's embedding, not a copy of it.
    target_embedding = engine.runner.model.get_input_embeddings().weight
    assert engine.proposer.inputs.weight is target_embedding


def test_trees_are_refused_at_start(tiny_dirs, feature_draft):
    spec = SpecConfig("draft", str(feature_draft[0]), 3, "fixed", draft_branches=2)
    with pytest.raises(ValueError, match="--draft-branches must be 1"):
        make_engine(tiny_dirs["llama"], spec=spec)


def test_an_explicit_draft_quantization_is_refused_at_start(tiny_dirs, feature_draft):
    """A feature draft keeps its weights: auto leaves them, an explicit rounding is an error
    rather than a setting silently ignored."""
    spec = SpecConfig("draft", str(feature_draft[0]), 3, "fixed", draft_quantization="int8")
    with pytest.raises(ValueError, match="a feature draft .EAGLE. keeps its trained weights"):
        make_engine(tiny_dirs["llama"], spec=spec)


def test_served_passes_compute_what_training_trains(tiny_dirs, feature_draft):
    """Depth 1 over a prompt with given features, then depth 2 from the draft's own
    feature, through the engine's runner; against FeatureDraft.unrolled."""
    target_dir = tiny_dirs["llama"]
    draft_dir, model = feature_draft
    engine = _engine(target_dir, draft_dir)
    proposer, runner = engine.proposer, engine.proposer.runner
    config = AutoConfig.from_pretrained(target_dir)
    theta = config.rope_parameters["rope_theta"]
    emb = engine.runner.model.get_input_embeddings().weight.detach().float()
    head = engine.runner.model.get_output_embeddings().weight.detach().float()[HEAD]
    head = head.to(torch.bfloat16).float()
    ids = random_prompts([13], vocab=300, seed=4)[0]
    feats = torch.randn(len(ids), config.hidden_size) * 2
    with torch.no_grad():
        depth1, depth2 = model.unrolled(emb[ids][None], feats[None], 2, theta)
    expected1 = depth1[0] @ head.T  # row p: logits for token p + 1
    table = list(range(engine.kv.blocks_needed(len(ids) + 1)))
    n = len(ids) - 1  # feed the first n tokens, then token n from the draft's own feature
    prev = torch.cat([torch.zeros(1, config.hidden_size), feats[: n - 1]])
    proposer.inputs.features = prev
    logits = runner.forward([SeqInput(ids[:n], 0, table, list(range(n)))])
    torch.testing.assert_close(logits[:, HEAD], expected1[:n], rtol=1e-4, atol=1e-4)
    own = proposer._norm(runner.last_hidden[n - 1 : n], runner)
    torch.testing.assert_close(own[0], depth1[0, n - 1], rtol=1e-4, atol=1e-4)
    proposer.inputs.features = own
    logits = runner.forward([SeqInput([ids[n]], n, table, [0])])
    proposer.inputs.features = None
    torch.testing.assert_close(logits[0, HEAD], depth2[0, n] @ head.T, rtol=1e-4, atol=1e-4)
    # Tokens outside the head are never proposed.
    assert (logits[0, [t for t in range(320) if t not in HEAD]] < -1e29).all()


@pytest.mark.parametrize("length", ["fixed", "adaptive"])
def test_greedy_with_a_feature_draft_equals_target_only(tiny_dirs, feature_draft, length):
    """Many requests at once, K up to 8, blocks of 4 in a pool tight enough to preempt:
    the output is the target's own, and the pool drains to empty."""
    target = tiny_dirs["llama"]
    prompts = random_prompts([5, 9, 14, 3, 22, 30, 7, 17, 11, 40], vocab=300, seed=11)
    expected = hf_greedy(target, prompts, 24)
    engine = _engine(target, feature_draft[0], 8, length, num_blocks=40)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(24))
    outputs = drain(engine)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    stats = engine.stats()
    assert stats.spec_drafted_tokens > 0
    if length == "fixed":  # (adaptive K soon stops drafting for this random draft)
        assert stats.spec_accepted_tokens > 0
        assert stats.preemptions > 0  # the tight pool preempted, and the output held
    engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_full_head_draft_leaves_the_targets_head_as_it_is(tiny_dirs, tmp_path):
    """Without head_tokens.json the draft's head is the target's own tensor: the rounding
    a restricted head's copy gets must not reach it."""
    draft, _ = build_feature_draft(tmp_path / "full", tiny_dirs["llama"])
    plain = make_engine(tiny_dirs["llama"]).runner.model.get_output_embeddings().weight
    engine = _engine(tiny_dirs["llama"], draft)
    head = engine.runner.model.get_output_embeddings().weight
    assert torch.equal(head, plain)
    assert engine.proposer.runner.model.get_output_embeddings().weight is head


def test_a_saved_draft_loads_back_as_trained(feature_draft):
    """FeatureDraft.load reads every weight write_draft wrote, under its own name, into the
    module it was trained as."""
    from scripts.train_eagle import FeatureDraft

    draft_dir, trained = feature_draft
    loaded = FeatureDraft.load(draft_dir)
    want = dict(trained.named_parameters())
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_trained_draft_directory_names_its_kind(tmp_path, tiny_dirs):
    """scripts/train_eagle.py's config: one layer, the marker, the target's shapes."""
    out, _ = build_feature_draft(tmp_path / "d", tiny_dirs["llama"])
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tandem_draft"]["kind"] == "eagle"
    assert not (out / "head_tokens.json").exists()  # no head given: the full vocabulary


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_sampling_with_a_feature_draft_follows_the_target(tiny_vocab_pair, tmp_path, seeded):
    """4-token continuations at temperature 1 and top_p 0.8, drafts from a feature draft,
    against the target's exact distribution (chi-square)."""
    target, _ = tiny_vocab_pair
    draft, _ = build_feature_draft(tmp_path / "eagle", target, seed=5)
    params = _params(temperature=1.0, top_p=0.8)
    exact = _exact_distribution(target, params)
    counts, stats, n = _sample_continuations(target, draft, params, n=3000, seeded=seeded)
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    stat, bound = _chi_square_test(counts, exact, n)
    assert stat < bound, f"chi-square {stat:.1f} >= {bound:.1f}"
