"""Suffix decoding (SuffixDecoding, as in Arctic Inference): drafts from suffix tries over the
request's own verified tokens and the latest finished outputs (`SuffixCache`, at most
`suffix_cache_tokens`). In each trie, the longest suffix of the context of at most D - K_max
tokens (D = `suffix_max_depth`) followed before by a token; the longer wins, the request's on a
tie. A match of m tokens drafts at most min(K, ceil(ALPHA x m)): most frequent children as a
chain (cut where a grammar refuses), or a tree best-first by path probability, down to
MIN_PROB. A request's trie lives until `release`, when its output joins the cache (unless it
failed)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.spec.proposers.base import DraftBatch, ModelFreeProposer
from engine.spec.proposers.suffix_tree import (
    Node,
    SuffixCache,
    SuffixTrie,
    draft_chain,
    draft_tree,
    is_alive,
    with_continuation,
)
from engine.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.types.batch import SchedulerOutput

ALPHA = 1.0
"""The adaptive length (SuffixDecoding's max_spec_factor): a match of m tokens drafts at most
ceil(ALPHA x m); a short match is weak evidence for a long continuation."""


class RequestIndex:
    """One request's trie over its tokens, and where its context stands in both tries."""

    __slots__ = ("glob", "indexed", "tail", "trie")

    def __init__(self, depth: int, glob: Node) -> None:
        self.trie = SuffixTrie(depth)
        self.tail = self.trie.root  # the node of the context's longest suffix in `trie`
        self.glob = glob  # the node of its longest suffix (<= the match limit) in the cache's
        self.indexed = 0  # tokens of all_token_ids in `trie`


class SuffixProposer(ModelFreeProposer):
    """`observe` learns nothing: the step's tokens are indexed when the request next drafts
    (`_index`)."""

    def __init__(self, max_depth: int, max_draft_tokens: int, cache_tokens: int) -> None:
        self.depth = max_depth
        self.match_limit = max(max_depth - max_draft_tokens, 1)
        self.cache = SuffixCache(cache_tokens, max_depth) if cache_tokens else None
        self.requests: dict[Request, RequestIndex] = {}

    def release(self, req: Request) -> None:
        """The request is gone (finished, aborted, failed): free its trie, cache its output."""
        self.requests.pop(req, None)
        if self.cache is not None and req.status is not RequestStatus.FINISHED_ERROR:
            self.cache.add(req.output_token_ids)

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        drafts: list[list[int]] = []
        parents: list[list[int] | None] = []
        for item in sched.scheduled:
            k, req = item.num_proposed_tokens, item.request
            node = self._match(self._index(req)) if k > 0 else None
            tokens, tree = [], None
            if node is not None:
                n = min(k, math.ceil(ALPHA * node.depth))
                if item.branches == 1 or req.grammar is not None:
                    tokens = draft_chain(node, n)
                    if req.grammar is not None and tokens:  # cut where the grammar refuses
                        tokens = tokens[: req.grammar.valid_prefix(tokens)]
                else:
                    tokens, tree = draft_tree(node, n, item.branches)
                    if tree == list(range(len(tokens))):
                        tree = None  # a single path: a chain
            drafts.append(tokens)
            parents.append(tree)
        has_tree = any(p is not None for p in parents)
        return DraftBatch(drafts, parents=parents if has_tree else None)

    def _index(self, req: Request) -> RequestIndex:
        """The request's index, with the tokens verified since its last drafting step in."""
        index = self.requests.get(req)
        cache = self.cache
        if index is None:
            glob = cache.trie.root if cache is not None else None
            index = self.requests[req] = RequestIndex(self.depth, glob)
        start, num_prompt = index.indexed, req.num_prompt_tokens
        new = req.output_token_ids[max(start - num_prompt, 0) :]
        if start < num_prompt:
            new = req.prompt_token_ids[start:] + new
        trie, tail = index.trie, index.tail
        for token in new:
            tail = trie.append(tail, token)
        index.tail = tail
        index.indexed += len(new)
        if cache is not None:
            glob, limit = index.glob, self.match_limit
            if len(new) >= limit:  # the match depends on the last `limit` tokens only
                glob = cache.trie.match(new, limit)
            elif not is_alive(glob):  # its strings left the cache: match the context afresh
                glob = cache.trie.match(req.all_token_ids, limit)
            else:
                for token in new:
                    glob = cache.trie.advance(glob, token, limit)
            index.glob = glob
        return index

    def _match(self, index: RequestIndex) -> Node | None:
        """The matched node to draft from: the longer match, the request's own on a tie."""
        own = with_continuation(index.tail, self.match_limit)
        if index.glob is not None:
            glob = with_continuation(index.glob, self.match_limit)
            if glob.depth > own.depth:
                return glob
        return own if own.depth > 0 else None
