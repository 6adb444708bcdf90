"""Draft-tree steps through the runner: each node attends only to the cached prefix and its
own ancestors, at the position of its depth.

One pass over a tree (a root and two branches) must give each node the logits that running
its root-to-node path as an ordinary chain gives, for every attention backend and both model
implementations, next to an ordinary request in the same batch.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.backends import triton_available
from engine.cpu import kernels as cpu_kernels
from engine.model.inputs import SeqInput
from engine.model.on_cpu import use_cpu_kernels
from engine.model.runner import ModelRunner
from tests.engine_utils import random_prompts

BLOCK = 4
# root r, branch a (a1, a2) and branch b (b1, b2, b3), in the cache slots' order
TREE_TOKENS = ["r", "a1", "a2", "b1", "b2", "b3"]
PARENT = {"r": None, "a1": "r", "a2": "a1", "b1": "r", "b2": "b1", "b3": "b2"}


def _path(node: str) -> list[str]:
    path = []
    while node is not None:
        path.append(node)
        node = PARENT[node]
    return path[::-1]


def _runner(tiny_dirs, backend: str, impl: str) -> ModelRunner:
    # Triton runs compiled on a GPU where there is one, else in its interpreter on the CPU.
    gpu = backend == "triton" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    runner = ModelRunner(str(tiny_dirs["llama"]), device, torch.float32, backend, impl)
    if backend == "cpu":
        use_cpu_kernels(runner)
    runner.allocate_kv(64, BLOCK)
    return runner


CASES = [("reference", "native"), ("reference", "transformers"), ("cpu", "native")]
CASES += [("cpu", "transformers"), ("triton", "native")]


@pytest.mark.parametrize("backend,impl", CASES)
def test_a_tree_pass_gives_each_node_its_paths_logits(tiny_dirs, backend, impl):
    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    runner = _runner(tiny_dirs, backend, impl)
    prompt, other = random_prompts([7, 5], vocab=runner.vocab_size, seed=61)
    ids = dict(zip(TREE_TOKENS, random_prompts([6], runner.vocab_size, seed=62)[0], strict=True))
    tables = {name: list(range(4 * i, 4 * i + 4)) for i, name in enumerate("TABC")}

    # The prefix in every table, plus an ordinary request in the tree's batch.
    for name in "TAB":
        runner.forward([SeqInput(prompt, 0, tables[name], [])])
    runner.forward([SeqInput(other, 0, tables["C"], [])])
    index = {node: i for i, node in enumerate(TREE_TOKENS)}
    bits = [sum(1 << index[a] for a in _path(node)) for node in TREE_TOKENS]
    depth = [len(_path(node)) - 1 for node in TREE_TOKENS]
    tree = SeqInput(
        [ids[n] for n in TREE_TOKENS],
        len(prompt),
        tables["T"],
        list(range(len(TREE_TOKENS))),
        tree=bits,
        positions=[len(prompt) + d for d in depth],
    )
    chain = SeqInput([3, 1, 4], len(other), tables["C"], [0, 1, 2])
    got = runner.forward([chain, tree])[3:]

    for leaf, table in (("a2", "A"), ("b3", "B")):
        path = _path(leaf)
        want = runner.forward([SeqInput([ids[n] for n in path], len(prompt), tables[table],
                                        list(range(len(path))))])  # fmt: skip
        for row, node in enumerate(path):
            torch.testing.assert_close(got[index[node]], want[row], rtol=1e-4, atol=1e-4)


def test_a_tree_bitmask_per_token_and_at_most_63_slots(tiny_dirs):
    runner = _runner(tiny_dirs, "reference", "native")
    with pytest.raises(ValueError, match="one bitmask per new token"):
        runner.forward([SeqInput([5, 6], 0, [0, 1], [0], tree=[1])])
    with pytest.raises(ValueError, match="at most 63 slots"):
        runner.forward([SeqInput([5] * 64, 0, list(range(16)), [0], tree=[1] * 64)])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_a_tree_fed_over_two_passes(tiny_dirs, backend):
    """A draft model grows its tree a level per pass: the second pass's nodes see the tree's
    earlier nodes through `tree_base` (their ancestors only, though all are cached)."""
    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    runner = _runner(tiny_dirs, backend, "native")
    prompt = random_prompts([9], vocab=runner.vocab_size, seed=63)[0]
    r, a1, b1, a2, b2 = random_prompts([5], runner.vocab_size, seed=64)[0]
    tables = {name: list(range(4 * i, 4 * i + 4)) for i, name in enumerate("TAB")}
    for name in "TAB":
        runner.forward([SeqInput(prompt, 0, tables[name], [])])
    n = len(prompt)
    # level 1: the root and both children (slots n, n+1, n+2)
    first = runner.forward(
        [
            SeqInput(
                [r, a1, b1], n, tables["T"], [0, 1, 2], [0b1, 0b11, 0b101], None, [n, n + 1, n + 1]
            )
        ]  # fmt: skip
    )
    # level 2 (slots n+3, n+4), bits over the slots from the root on
    second = runner.forward(
        [
            SeqInput([a2, b2], n + 3, tables["T"], [0, 1], [0b1011, 0b10101], n, [n + 2, n + 2])
        ]  # fmt: skip
    )
    for path, got, table in (
        ([r, a1, a2], [first[0], first[1], second[0]], "A"),
        ([r, b1, b2], [first[0], first[2], second[1]], "B"),
    ):
        want = runner.forward([SeqInput(path, n, tables[table], [0, 1, 2])])
        for row in range(3):
            torch.testing.assert_close(got[row], want[row], rtol=1e-4, atol=1e-4)
