"""Depth-bounded suffix tries for suffix decoding (engine/spec/proposers/suffix.py).

A trie of depth D over token sequences holds every substring of up to D tokens as a path from
the root. A node's `count` is how often its string occurs, `total` how often followed by a
token, so a child's probability is child.count / parent.total. Each node links to its string
less the first token (`link`, as Aho-Corasick's failure links): appending a token extends the
at most D suffixes ending there, and matching a context advances in amortized O(1) a token.
Plain Python on the engine's thread. A trie over N tokens holds at most N x D nodes (a Python
object each); suffix.py bounds N for the global cache and D (suffix_max_depth).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence

MIN_PROB = 0.1
"""A draft path whose probability (the product of its tokens' child.count / parent.total)
falls below this is not drafted: a guess that rarely pays for its verification slot."""


class Node:
    __slots__ = ("best", "children", "count", "depth", "link", "token", "total")

    def __init__(self, depth: int, token: int = -1) -> None:
        self.token = token  # the string's last token
        self.children: dict[int, Node] = {}
        self.count = 0  # occurrences of this node's string
        self.total = 0  # of those, the ones followed by a token
        self.depth = depth  # the string's length
        self.link: Node | None = None  # the string less its first token (None: the root)
        self.best: Node | None = None  # the most frequent child, or None: not known

    def best_child(self) -> Node | None:
        """The most frequent child (kept as counts grow, found again after an eviction)."""
        if self.best is None and self.children:
            self.best = max(self.children.values(), key=_count)
        return self.best


def _count(node: Node) -> int:
    return node.count


class SuffixTrie:
    """Every substring of up to `depth` tokens of the sequences inserted, with counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node(0)

    def append(self, tail: Node, token: int) -> Node:
        """Extend a sequence whose longest suffix in the trie is `tail` (the root for an empty
        one) by `token`: count the token after each of its suffixes. Returns the new tail."""
        node = tail if tail.depth < self.depth else tail.link
        new_tail: Node | None = None
        prev: Node | None = None
        while node is not None:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(node.depth + 1, token)
            child.count += 1
            node.total += 1
            best = node.best
            if best is not None and best is not child and child.count > best.count:
                node.best = child
            if prev is None:
                new_tail = child
            elif prev.link is None:
                prev.link = child
            prev = child
            node = node.link
        assert prev is not None and new_tail is not None
        if prev.link is None:
            prev.link = self.root
        return new_tail

    def insert(self, tokens: Iterable[int]) -> None:
        tail = self.root
        for token in tokens:
            tail = self.append(tail, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `insert(tokens)`: the same walk, counting down; nodes that reach 0 go (they
        keep their links until the walk is done, which still passes through them)."""
        tail = self.root
        for token in tokens:
            node = tail if tail.depth < self.depth else tail.link
            new_tail = None
            while node is not None:
                child = node.children[token]
                child.count -= 1
                node.total -= 1
                if node.best is child:
                    node.best = None
                if child.count == 0:
                    del node.children[token]
                if new_tail is None:
                    new_tail = child
                node = node.link
            assert new_tail is not None
            tail = new_tail

    def advance(self, node: Node, token: int, limit: int) -> Node:
        """Matching a context against the trie: from `node`, its longest suffix of at most
        `limit` tokens present here, to that of the context followed by `token`."""
        while True:
            if node.depth < limit:
                child = node.children.get(token)
                if child is not None:
                    return child
            if node.link is None:
                return node  # the root: nothing matches
            node = node.link

    def match(self, tokens: Sequence[int], limit: int) -> Node:
        """The node of the longest suffix of `tokens` of at most `limit` tokens found here."""
        node = self.root
        for token in tokens[-limit:] if limit else ():
            node = self.advance(node, token, limit)
        return node


def with_continuation(node: Node, limit: int) -> Node:
    """The longest suffix of `node`'s string, at most `limit` tokens, seen followed by a
    token (the root when there is none)."""
    while node.link is not None and (node.depth > limit or node.total == 0):
        node = node.link
    return node


def is_alive(node: Node) -> bool:
    """False for a node an eviction removed (a context matched there must match again)."""
    return node.link is None or node.count > 0


def draft_chain(node: Node, n: int) -> list[int]:
    """Up to n tokens: the most frequent child, again and again, while the path stays at
    least MIN_PROB likely."""
    tokens: list[int] = []
    prob = 1.0
    while len(tokens) < n and node.total > 0:
        child = node.best_child()
        assert child is not None
        prob *= child.count / node.total
        if prob < MIN_PROB:
            break
        tokens.append(child.token)
        node = child
    return tokens


def draft_tree(node: Node, depth: int, width: int) -> tuple[list[int], list[int]]:
    """A tree of at most depth x width drafts, at most `width` under the root and none
    deeper than `depth`, best-first by path probability (each at least MIN_PROB): its tokens
    and parents (0 = the root, d + 1 = draft d; every parent before its children)."""
    tokens: list[int] = []
    parents: list[int] = []
    tie = 0  # heap order among equal probabilities: first pushed, first drafted
    heap: list[tuple[float, int, int, int, int, Node]] = []

    def push(parent: Node, parent_index: int, prob: float, level: int) -> None:
        nonlocal tie
        if parent.total == 0 or level > depth:
            return
        for token, child in parent.children.items():
            p = prob * child.count / parent.total
            if p >= MIN_PROB:
                heapq.heappush(heap, (-p, tie, token, parent_index, level, child))
                tie += 1

    push(node, 0, 1.0, 1)
    roots = 0
    while heap and len(tokens) < depth * width:
        neg_p, _, token, parent_index, level, child = heapq.heappop(heap)
        if parent_index == 0:
            if roots == width:
                continue
            roots += 1
        tokens.append(token)
        parents.append(parent_index)
        push(child, len(tokens), -neg_p, level + 1)
    return tokens, parents


class SuffixCache:
    """The global trie: the outputs of the latest finished requests, at most `max_tokens`
    tokens in all; adding one past the bound evicts the oldest first (their counts taken
    back out of the trie), and an output longer than the bound keeps its last max_tokens."""

    def __init__(self, max_tokens: int, depth: int) -> None:
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(depth)
        self.entries: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_tokens == 0 or not tokens:
            return
        kept = list(tokens[-self.max_tokens :])
        while self.entries and self.num_tokens + len(kept) > self.max_tokens:
            oldest = self.entries.popleft()
            self.trie.remove(oldest)
            self.num_tokens -= len(oldest)
        self.trie.insert(kept)
        self.entries.append(kept)
        self.num_tokens += len(kept)
