"""Draft trees in the engine (--draft-branches N): the output is still exactly the target's."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import SpecConfig
from engine.spec import verifier
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def noisy_draft(tiny_dirs, tmp_path_factory):
    """The target with noise on its weights: its top choice often differs from the target's,
    but the target's is usually among its top few, so other branches than the first win."""
    out = tmp_path_factory.mktemp("noisy") / "draft"
    shutil.copytree(tiny_dirs["llama"], out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std())
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_dirs):
    prompts = random_prompts([5, 9, 14, 3, 22, 30, 7, 17], vocab=300, seed=71)
    return prompts, hf_greedy(tiny_dirs["llama"], prompts, MAX_TOKENS)


def _record_paths(monkeypatch) -> list[list[int]]:
    """The accepted path of every greedy tree the verifier judges, as it judges them."""
    paths: list[list[int]] = []
    plain = verifier.verify_tree_greedy

    def recording(tree, argmax):
        path, token = plain(tree, argmax)
        paths.append(path)
        return path, token

    monkeypatch.setattr(verifier, "verify_tree_greedy", recording)
    return paths


@pytest.mark.parametrize("draft", ["noisy", "target"])
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_greedy_trees_equal_target_only(
    tiny_dirs, noisy_draft, prompts_and_reference, monkeypatch, draft, pool
):
    prompts, reference = prompts_and_reference
    paths = _record_paths(monkeypatch)
    draft_dir = noisy_draft if draft == "noisy" else tiny_dirs["llama"]
    spec = SpecConfig(
        "draft", str(draft_dir), max_draft_tokens=3, draft_length="fixed", draft_branches=3
    )
    engine = make_engine(tiny_dirs["llama"], spec=spec, num_blocks=256 if pool == "roomy" else 40)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    outputs = drain(engine)  # checks the invariants and that the pool drains to empty
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == reference
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_tree_steps > 0
    assert stats.spec_blocks_released > 0  # the slots of rejected branches went back
    # Paths through every branch (nodes 1, 2, 3 are the root's three children), several deep
    assert {p[0] for p in paths if p} == ({1, 2, 3} if draft == "noisy" else {1})
    assert max(len(p) for p in paths) == 3
    if pool == "tight":
        assert stats.preemptions > 0


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_greedy_ngram_trees_equal_target_only(tiny_dirs, monkeypatch, pool):
    """N-gram trees: distinct continuations of the context's suffix, one per branch."""
    prompts = [p * 3 for p in random_prompts([4, 6, 5, 7], vocab=300, seed=72)]  # repetitive
    reference = hf_greedy(tiny_dirs["llama"], prompts, MAX_TOKENS)
    paths = _record_paths(monkeypatch)
    spec = SpecConfig("ngram", max_draft_tokens=3, draft_length="fixed", draft_branches=3)
    engine = make_engine(tiny_dirs["llama"], spec=spec, num_blocks=256 if pool == "roomy" else 24)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    outputs = drain(engine)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.stats().spec_drafted_tokens > 0
    assert len(paths) > 0  # trees were verified
    if pool == "tight":
        assert engine.stats().preemptions > 0


def test_ngram_branches_are_distinct_continuations():
    from engine.spec.proposers.ngram import prompt_lookup, prompt_lookup_branches

    # suffix [1, 2] occurred followed by 3 (latest), 4 and again 3; suffix [2] also by 9
    tokens = [1, 2, 4, 5, 2, 9, 1, 2, 3, 7, 1, 2]
    assert prompt_lookup(tokens, 2, 2, 1) == [3, 7]
    assert prompt_lookup_branches(tokens, 2, 2, 1, 3) == [[3, 7], [4, 5], [9, 1]]
    assert prompt_lookup_branches(tokens, 2, 2, 2, 3) == [[3, 7], [4, 5]]  # no shorter n-grams
