"""Fixed-shape decode steps: padded to a batch bucket, run from static buffers.

On the CPU the padded path runs eagerly (the Triton kernel in the interpreter, see
conftest.py); on CUDA the same path is captured and replayed as CUDA graphs (gpu tests).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention.backends import triton_available
from engine.config import SpecConfig
from engine.model.decode_graphs import DecodeGraphs
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from server.settings import load_settings
from tests.engine_utils import drain, greedy, hf_greedy, make_engine, random_prompts

pytestmark = pytest.mark.skipif(
    not triton_available(),
    reason="triton is not installed (on Linux x86_64: pip install -e '.[dev]')",
)

BLOCK = 4
PROMPTS = [6, 13, 3, 21, 9]


@pytest.fixture
def interpreted():
    from engine.attention import triton_kernel as triton_attention

    if not triton_attention.INTERPRETED:
        pytest.skip("the kernel is compiled for the GPU here; the gpu tests cover this path")


def _runner(model_dir, device="cpu", dtype=torch.float32, impl="auto") -> ModelRunner:
    runner = ModelRunner(str(model_dir), torch.device(device), dtype, "triton", impl)
    runner.allocate_kv(64, BLOCK)
    return runner


def _prefill(runner: ModelRunner) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of different lengths (an eager step); returns their tokens and block tables
    (each with room for 8 more tokens)."""
    prompts = random_prompts(PROMPTS, vocab=300, seed=21)
    tables, next_block = [], 0
    for n in PROMPTS:
        blocks = -(-(n + 8) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    runner.forward([SeqInput(p, 0, t, [len(p) - 1]) for p, t in zip(prompts, tables, strict=True)])
    return prompts, tables


def _changed_slots(before, runner: ModelRunner) -> set[int]:
    changed = set()
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        for old, new in ((k0, k1), (v0, v1)):
            diff = (old != new).flatten(2).any(-1).flatten()  # [num_slots]
            changed |= set(diff.nonzero().flatten().tolist())
    return changed


# Query lengths per request, and the shape they pad to: decodes (4 requests x 1), a
# verification of 1 + K = 5 for five requests (8 x 5), one request of 2 (1 x 2), requests
# whose K differ (4 x 3), and a draft tree (root, two children, a grandchild) beside a chain.
CASES = [([1, 1, 1], (4, 1)), ([5] * 5, (8, 5)), ([2], (1, 2)), ([3, 1, 2], (4, 3))]
TREE = ([4, 2], (2, 4))
TREE_BITS = [0b1, 0b11, 0b101, 0b1011]  # r, a1 (child of r), b1 (child of r), a2 (of a1)
TREE_DEPTH = [0, 1, 1, 2]


def _check_padded_path(
    runner: ModelRunner, query_lens: list[int], tol: float, tree: bool = False, last=False
) -> DecodeGraphs:
    """Run one batch on the padded path, then again eagerly from the same cache; `last`: the
    logits of each request's last token only (rows that are not every token, in order)."""
    assert runner.enable_decode_graphs(max_batch=8, max_query_len=5, max_model_len=128)
    graphs = runner.decode_graphs
    assert graphs is not None
    prompts, tables = _prefill(runner)
    assert graphs.steps == 0  # mixed query lengths past max_query_len ran eagerly
    seqs = [
        SeqInput(
            list(range(7, 7 + q)), len(prompts[i]), tables[i], [q - 1] if last else [*range(q)]
        )
        for i, q in enumerate(query_lens)
    ]
    if tree:
        n = len(prompts[0])
        seqs[0] = replace(seqs[0], tree=TREE_BITS, positions=[n + d for d in TREE_DEPTH])
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    padded = runner.forward(seqs)
    assert graphs.steps == 1 and runner.last_route == "decode-graphs"
    assert padded.shape == (len(query_lens) if last else sum(query_lens), runner.vocab_size)
    new_slots = sorted(
        s.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
        for s in seqs
        for pos in range(s.start_pos, s.context_len)
    )
    scratch = set(range(runner.scratch_block * BLOCK, (runner.scratch_block + 1) * BLOCK))
    changed = _changed_slots(before, runner)
    assert set(new_slots) <= changed <= set(new_slots) | scratch  # padding: scratch block only

    written = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    runner.decode_graphs = None
    unpadded = runner.forward(seqs)
    assert runner.last_route == ("native" if runner.native is not None else "transformers")
    torch.testing.assert_close(padded, unpadded, rtol=tol, atol=tol)
    for (k, v), (k1, v1) in zip(runner.kv_caches, written, strict=True):
        for eager, fixed in ((k, k1), (v, v1)):
            torch.testing.assert_close(
                eager.flatten(0, 1)[new_slots], fixed.flatten(0, 1)[new_slots], rtol=tol, atol=tol
            )
    return graphs


@pytest.mark.parametrize(("query_lens", "shape"), [*CASES, TREE])
def test_padded_path_gives_the_unpadded_logits(interpreted, tiny_dirs, query_lens, shape):
    tree = (query_lens, shape) == TREE
    runner = _runner(tiny_dirs["qwen2"])  # GQA: 4 heads on 2
    graphs = _check_padded_path(runner, query_lens, 1e-4, tree)
    assert list(graphs.batches) == [(*shape, tree)]


def test_padded_path_gives_the_logit_rows_asked_for(interpreted, tiny_dirs):
    runner = _runner(tiny_dirs["qwen2"])
    _check_padded_path(runner, [3, 1, 2], 1e-4, last=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("query_lens", "shape"), [*CASES, TREE])
def test_cuda_graph_replay_gives_the_eager_logits(tiny_dirs, query_lens, shape):
    tree = (query_lens, shape) == TREE
    runner = _runner(tiny_dirs["qwen2"], "cuda", torch.bfloat16)
    graphs = _check_padded_path(runner, query_lens, 5e-2, tree)
    # The 1 x 1 graph is captured at start-up; every shape used has its graph.
    assert {key: b.graph is not None for key, b in graphs.batches.items()} == {
        (1, 1, False): True,
        (*shape, tree): True,
    }


def test_batches_that_do_not_fit_run_eagerly(interpreted, tiny_dirs):
    runner = _runner(tiny_dirs["llama"])
    assert runner.enable_decode_graphs(max_batch=2, max_query_len=3, max_model_len=24)
    graphs = runner.decode_graphs
    prompts, tables = _prefill(runner)

    def step(num_seqs: int, q: int, start: int = 0) -> None:
        runner.forward(
            [
                SeqInput([5] * q, len(prompts[i]) + start, tables[i], [q - 1])
                for i in range(num_seqs)
            ]
        )

    step(3, 1)  # more requests than the largest bucket
    step(2, 4)  # a longer query than max_query_len
    runner.forward([SeqInput([5], len(prompts[3]) + 4, tables[3], [0])])  # past max_model_len
    assert graphs.steps == 0
    step(2, 3)
    step(1, 1)
    runner.forward([SeqInput([5, 6], len(prompts[0]) + 4, tables[0], [1]),
                    SeqInput([5], len(prompts[1]) + 4, tables[1], [0])])  # fmt: skip
    assert graphs.steps == 3
    assert sorted(graphs.batches) == [(1, 1, False), (2, 2, False), (2, 3, False)]


def test_only_a_plain_lm_head_gets_decode_graphs(interpreted, tiny_dirs, monkeypatch):
    assert not ModelRunner(
        str(tiny_dirs["llama"]), torch.device("cpu"), torch.float32, "reference"
    ).enable_decode_graphs(4, 1, 64)
    runner = _runner(tiny_dirs["llama"], impl="transformers")  # the native head is plain
    forward = runner.model.forward

    def soft_capped(*args, **kwargs):  # what Gemma 2 does after its LM head
        out = forward(*args, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0)
        return out

    monkeypatch.setattr(runner.model, "forward", soft_capped)
    assert not runner.enable_decode_graphs(4, 1, 64)
    assert runner.decode_graphs is None


def test_engine_greedy_tokens_are_the_same_with_and_without(interpreted, tiny_dirs):
    prompts = random_prompts([4, 11, 26], vocab=300, seed=22)
    spec = SpecConfig(
        method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"
    )
    tree = replace(spec, draft_branches=2, max_draft_tokens=2)  # tree passes take graphs too
    ngram = SpecConfig(method="ngram", draft_length="fixed")  # K differs between requests
    for spec_config in (None, tree, ngram):  # a tree's passes: the draft's and the target's
        outputs = {}
        for graphs in (True, False):
            engine = make_engine(
                tiny_dirs["llama"], spec=spec_config, attention_backend="triton", cuda_graphs=graphs
            )
            assert engine.decode_graphs is graphs
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, greedy(6))
            outputs[graphs] = drain(engine)
            if graphs:
                assert all(r.decode_graphs.steps > 0 for r in engine.runners)
                shapes = engine.runner.decode_graphs.batches
                assert any(tree_shape for *_, tree_shape in shapes) == (spec_config is tree)
            else:
                assert all(r.decode_graphs is None for r in engine.runners)
        assert outputs[True] == outputs[False]


def test_the_setting(tiny_dirs):
    env = {"TANDEM_MODEL": str(tiny_dirs["llama"])}
    assert load_settings(environ=env).engine.model.cuda_graphs is True
    off = load_settings(environ={**env, "TANDEM_CUDA_GRAPHS": "off"})
    assert off.engine.model.cuda_graphs is False
    engine = make_engine(tiny_dirs["llama"])  # reference attention on the CPU: nothing to do
    assert engine.decode_graphs is False and engine.runner.decode_graphs is None


@pytest.mark.gpu
def test_cuda_graph_replays_give_transformers_greedy_tokens(tiny_dirs):
    model = tiny_dirs["qwen2"]
    prompts = random_prompts([1, 9, 33, 64], vocab=300, seed=23)
    spec = SpecConfig(
        method="draft", draft_model=str(tiny_dirs["llama_draft"]), draft_length="fixed"
    )
    expected = hf_greedy(model, prompts, 12)
    for spec_config in (None, spec):
        engine = make_engine(
            model, spec=spec_config, device="cuda", dtype="float32", attention_backend="triton"
        )
        assert engine.decode_graphs
        for i, prompt in enumerate(prompts):
            engine.add_request(f"g{i}", prompt, greedy(12))
        outputs = drain(engine)
        assert [outputs[f"g{i}"] for i in range(len(prompts))] == expected
        for runner in engine.runners:
            batches = runner.decode_graphs.batches.values()
            assert runner.decode_graphs.steps > 0
            assert batches and all(b.graph is not None for b in batches)
