"""Lossless verification of a draft tree: the longest accepted path, then one more token
(docs/VERIFICATION.md, "Draft trees"). Node 0, the root, is the last committed token."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from engine.sample.sampler import sample_from


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree, nodes in the order they fill cache slots (parents first)."""

    tokens: list[int]
    parents: list[int]
    """parents[0] = -1; a node's children, in index order, are in the order they were drafted."""
    fixed_root_children: int = 0
    """"top" trees: the root's first children are q's top tokens; only its last was drawn."""

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1 or len(self.parents) != len(self.tokens):
            raise ValueError("a draft tree needs a root (parent -1) and one parent per node")
        if any(not 0 <= p < v for v, p in enumerate(self.parents) if v):
            raise ValueError("a draft tree lists every node after its parent")

    @cached_property
    def _paths(self) -> list[list[int]]:
        paths = [[0]]
        for v in range(1, len(self.parents)):
            paths.append([*paths[self.parents[v]], v])
        return paths

    @cached_property
    def _children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            children[self.parents[v]].append(v)
        return children

    def children(self, node: int) -> list[int]:
        return self._children[node]

    def ancestors(self, node: int) -> list[int]:
        """The path from the root to `node`, both included."""
        return self._paths[node]

    def depth(self, node: int) -> int:
        return len(self._paths[node]) - 1


def verify_tree_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """One-hot rows (target_argmax[v]: the target's token after node v): the nodes of the
    longest path that matches the target (root excluded) and the token after it."""
    path, node = [], 0
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == target_argmax[node]), None)
        if nxt is None:
            return path, target_argmax[node]
        path.append(nxt)
        node = nxt


def verify_tree(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [nodes, vocab] p_v: the target's next-token distribution
    draft_probs: torch.Tensor | None,  # [nodes, vocab] q_v; None: one-hot children
    uniform: torch.Tensor,  # [nodes + 1] U[0, 1): uniform[c] tests child c, the last draws
) -> tuple[list[int], int]:  # the accepted nodes (root excluded), then the emitted token
    path, node = [], 0
    if tree.fixed_root_children and draft_probs is not None:
        first = _verify_top_drafts(tree, target_probs[0], draft_probs[0], uniform)
        if first < 0:  # nothing kept: -1 - the emitted token
            return path, -1 - first
        path.append(first)
        node = first
    while True:
        residual = target_probs[node].double()
        children = tree.children(node)
        q = None if draft_probs is None else draft_probs[node].double().clone()
        accepted = None
        for child in children:
            x = tree.tokens[child]
            if q is None:  # one-hot on x
                ratio = float(residual[x])
            else:
                qx = float(q[x])
                ratio = float(residual[x]) / qx if qx > 0 else 0.0
            if float(uniform[child]) < min(1.0, ratio):
                accepted = child
                break
            if q is None:
                residual = residual.clone()
                residual[x] = 0.0
            else:
                residual = (residual - q).clamp(min=0)
                q[x] = 0.0  # the next child was drawn without this one
                q = q / q.sum() if float(q.sum()) > 0 else q
            total = float(residual.sum())
            # An empty residual has probability 0 in exact arithmetic; fall back to p.
            residual = residual / total if total > 0 else target_probs[node].double()
        if accepted is None:
            token = int(sample_from(residual[None], uniform[-1:])[0])
            return path, token
        path.append(accepted)
        node = accepted


def _verify_top_drafts(
    tree: DraftTree, p: torch.Tensor, q: torch.Tensor, uniform: torch.Tensor
) -> int:
    """A "top" root's optimal verifier (docs/VERIFICATION.md): kept child, or -1 - emitted token."""
    children = tree.children(0)
    fixed, last = children[: tree.fixed_root_children], children[-1]
    top = [tree.tokens[c] for c in fixed]
    p, rest = p.double(), q.double().clone()
    rest[top] = 0.0
    rest = rest / rest.sum() if float(rest.sum()) > 0 else rest
    x = tree.tokens[last]
    qx = float(rest[x])
    if qx > 0 and float(uniform[last]) < min(1.0, float(p[x]) / qx):
        return last
    residual = (p - rest).clamp(min=0)  # p itself on the top tokens (q' is 0 there)
    if float(residual.sum()) <= 0:  # probability 0 in exact arithmetic
        residual = p
    draw = uniform[fixed[0] : fixed[0] + 1] if fixed else uniform[-1:]
    y = int(sample_from(residual[None], draw)[0])
    for c, token in zip(fixed, top, strict=True):
        if token == y:
            return c
    return -1 - y
