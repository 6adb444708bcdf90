"""Prompt lookup: propose what followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import SpecConfig
from engine.spec.proposers.base import DraftBatch, ModelFreeProposer, Proposer

if TYPE_CHECKING:
    from engine.types.batch import SchedulerOutput


def prompt_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    return longest_match(tokens, k, n_max, n_min)[1]


def longest_match(
    tokens: list[int] | bytes | bytearray, k: int, n_max: int, n_min: int
) -> tuple[int, list[int]]:
    """(n, up to k tokens): the longest suffix n-gram of `tokens` (n_min <= n <= n_max) that
    occurred earlier, and what followed its latest earlier occurrence; (0, []) if none.
    `tokens`: a list or `Request.token_bytes`; a match of n tokens has one of n - 1 (bisected)."""
    buf = tokens if isinstance(tokens, bytes | bytearray) else array("i", tokens).tobytes()
    length = len(buf) // 4
    if length < 2 or n_min < 1:
        return 0, []
    lo, hi, at = 0, min(n_max, length - 1), -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (found := _latest(buf, length, mid)) >= 0:
            lo, at = mid, found
        else:
            hi = mid - 1
    if lo < n_min:
        return 0, []
    return lo, array("i", buf[4 * (at + lo) : 4 * (at + lo + k)]).tolist()


def _latest(buf: bytes | bytearray, length: int, n: int) -> int:
    """The start of the last n tokens' latest occurrence ending before the last token, or -1."""
    needle, end = buf[4 * (length - n) :], 4 * (length - 1)
    while (at := buf.rfind(needle, 0, end)) % 4:  # a match across tokens: look further back
        if at < 0:
            return -1
        end = at + len(needle) - 1
    return at // 4


def prompt_lookup_branches(
    tokens: list[int], k: int, n_max: int, n_min: int, branches: int
) -> list[list[int]]:
    """Up to `branches` continuations of up to k tokens with distinct first tokens: the latest
    earlier matches of the longest suffix n-gram first, then shorter ones for the rest."""
    length, found, firsts = len(tokens), [], set()
    longest = longest_match(tokens, 1, n_max, n_min)[0]
    for n in range(longest, n_min - 1, -1):
        suffix = tokens[length - n :]
        # Earlier starts j < length - n whose n-gram equals the suffix, the latest first.
        for j in range(length - n - 1, -1, -1):
            if tokens[j] == suffix[0] and tokens[j : j + n] == suffix:
                follow = tokens[j + n : j + n + k]
                if follow and follow[0] not in firsts:
                    found.append(follow)
                    firsts.add(follow[0])
                    if len(found) == branches:
                        return found
    return found


def assist_lookup(
    spec: SpecConfig, proposer: Proposer | None
) -> Callable[[list[int], int], tuple[int, list[int]]] | None:
    """The planner's `longest_match` or None: ngram_min..ngram_max tokens for adaptive `ngram`;
    beside a draft model (`ngram_assist`), ngram_assist..max(ngram_assist, ngram_max)."""
    if spec.method == "ngram" and spec.draft_length == "adaptive":
        return lambda tokens, k: longest_match(tokens, k, spec.ngram_max, spec.ngram_min)
    if not spec.ngram_assist or proposer is None or not proposer.keeps_kv:
        return None
    n_min, n_max = spec.ngram_assist, max(spec.ngram_assist, spec.ngram_max)
    return lambda tokens, k: longest_match(tokens, k, n_max, n_min)


class NgramProposer(ModelFreeProposer):
    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max = n_max
        self.n_min = n_min

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        drafts: list[list[int]] = []
        parents: list[list[int] | None] = []
        for item in sched.scheduled:
            k, n = item.num_proposed_tokens, item.branches
            if k == 0:
                drafts.append([])
                parents.append(None)
            elif n == 1:
                chain = prompt_lookup(item.request.all_token_ids, k, self.n_max, self.n_min)
                grammar = item.request.grammar
                if grammar is not None and chain:  # drafts the grammar refuses are cut off
                    chain = chain[: grammar.valid_prefix(chain)]
                drafts.append(chain)
                parents.append(None)
            else:  # a tree: each continuation a branch under the root, branch after branch
                found = prompt_lookup_branches(
                    item.request.all_token_ids, k, self.n_max, self.n_min, n
                )
                tokens, tree = [], []
                for chain in found:
                    for d, token in enumerate(chain):
                        tree.append(0 if d == 0 else len(tokens))  # draft j is node j + 1
                        tokens.append(token)
                drafts.append(tokens)
                parents.append(tree if len(found) > 1 else None)
        has_tree = any(p is not None for p in parents)
        return DraftBatch(drafts, parents=parents if has_tree else None)
