"""A small Hugging Face causal LM drafting on the target's block tables (one allocation and
rollback cover both), its progress `Request.num_draft_computed_tokens`. Pass 1 feeds every token
the draft has not seen, pass i x_{i-1} where K >= i; seeded requests race with the target's noise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SpecConfig
from engine.cpu import sampling as cpu_sampling
from engine.model.inputs import SeqInput
from engine.model.routes import PackedBatch, Packer
from engine.model.runner import ModelRunner
from engine.sample.sampler import (
    RowSpec,
    apply_penalties_and_masks,
    argmax,
    coupled_tokens,
    edits_logits,
    kernel_rows,
    logits_to_probs,
    plain_sampling,
    request_uniforms,
    sample_from,
)
from engine.spec.proposers.base import DraftBatch
from engine.types.request import Request

if TYPE_CHECKING:
    from engine.spec.step import StepResult
    from engine.types.batch import SchedulerOutput


class DraftModelProposer:
    keeps_kv = True
    observes = False

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        tree_drafts: str = "top",
    ) -> None:
        if runner.vocab_size != target_vocab:
            raise ValueError(
                f"--draft-model has a vocabulary of {runner.vocab_size} tokens but the target "
                f"has {target_vocab}; the draft must share the target's tokenizer"
            )
        self.runner = runner
        self.tree_drafts = tree_drafts

    @classmethod
    def from_config(
        cls,
        config: SpecConfig,
        device: torch.device,
        dtype: torch.dtype,
        target: ModelRunner,
        attention_backend: str,
        model_impl: str,
        quantization: str,
    ) -> DraftModelProposer:
        assert config.draft_model is not None  # SpecConfig validation guarantees it
        runner = ModelRunner(
            config.draft_model, device, dtype, attention_backend, model_impl, quantization
        )
        return cls(runner, target.vocab_size, config.tree_drafts)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv(num_blocks, block_size)

    def observe(self, step: StepResult) -> None:
        pass

    def release(self, req: Request) -> None:
        pass

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        first = Packer()  # the first pass: every token each request's draft has not seen
        drafting: list[tuple[int, Request, int]] = []  # (scheduled index, request, K)
        for i, (item, table) in enumerate(zip(sched.scheduled, block_tables, strict=True)):
            req, k = item.request, item.num_proposed_tokens
            if k > 0:
                end = req.num_tokens
            elif req.is_prefill:
                end = req.num_computed_tokens + item.num_new_tokens
            else:
                continue  # a plain decode: the draft catches up when K > 0 again
            start = req.num_draft_computed_tokens
            tokens = req.token_ids(start, end)
            if not tokens:
                continue
            first.add(tokens, start, table, (len(tokens) - 1,) if k > 0 else ())
            req.num_draft_computed_tokens = end
            if k > 0:
                drafting.append((i, req, k))

        drafts: list[list[int]] = [[] for _ in sched.scheduled]
        if not first.tables:
            return DraftBatch(drafts, None)
        # Greedy drafts need no q: one-hot, as a model-free drafter's missing probs mean.
        want_q = not all(req.params.greedy for _, req, _ in drafting)
        if drafting and not want_q and self._argmax_chains(sched, drafting):
            return self._greedy_chains(drafting, first.build(), block_tables, drafts)
        fed = [0, 0]  # tokens, query x key pairs

        def forward(batch: PackedBatch) -> torch.Tensor:
            tokens, pairs = _fed(batch)
            fed[0], fed[1] = fed[0] + tokens, fed[1] + pairs
            return self.runner.forward_packed(batch, widen=False)  # _pick widens where it must

        # A lane is one chain of drafts: one per request, or one per branch of a tree.
        width = {i: sched.scheduled[i].branches for i, _, _ in drafting}
        lanes = {i: [[] for _ in range(width[i])] for i, _, _ in drafting}
        lane_q: dict[int, list[list[torch.Tensor]]] = {
            i: [[] for _ in range(width[i])] for i, _, _ in drafting
        }
        root = {i: req.num_tokens - 1 for i, req, _ in drafting}  # the root's cache slot
        passes = 1 if drafting else 0  # that picked drafts
        logits = forward(first.build())
        picks = self._pick(logits, [(req, [], width[i]) for i, req, _ in drafting], want_q)
        for (i, _, _), (tokens, q) in zip(drafting, picks, strict=True):
            for b, token in enumerate(tokens):
                lanes[i][b].append(token)
                if q is not None:
                    lane_q[i][b].append(q)
        for depth in range(2, max((k for _, _, k in drafting), default=0) + 1):
            active = [(i, req) for i, req, k in drafting if k >= depth]
            if not active:
                break
            entries = [(req, lane, 1) for i, req in active for lane in lanes[i]]
            if len(entries) == len(active):  # chains only: packed directly, one token each
                batch = _chain_pass(active, [lanes[i][0][-1] for i, _ in active], block_tables)
            else:
                seqs = [self._next_pass(r, lanes[i], block_tables[i], root[i]) for i, r in active]
                batch = PackedBatch.pack(seqs)
            logits = forward(batch)
            passes += 1
            picks = self._pick(logits, entries, want_q)
            for (_, lane, _), (tokens, _) in zip(entries, picks, strict=True):
                lane.extend(tokens)
            if want_q:
                qs = [lane_q[i][b] for i, _ in active for b in range(width[i])]
                for q_lane, (_, q) in zip(qs, picks, strict=True):
                    if q is not None:
                        q_lane.append(q)
        parents: list[list[int] | None] = [None] * len(sched.scheduled)
        flat_q: list[torch.Tensor] = []
        for i, req, k in drafting:
            if width[i] == 1:
                drafts[i] = lanes[i][0]
                flat_q.extend(lane_q[i][0])
                continue
            n = width[i]  # a tree, breadth first: node (d, b) is draft (d - 1) * N + b
            drafts[i] = [lanes[i][b][d] for d in range(k) for b in range(n)]
            parents[i] = [0 if d == 0 else (d - 1) * n + b + 1 for d in range(k) for b in range(n)]
            flat_q.extend(lane_q[i][b][d] for d in range(k) for b in range(n) if want_q)
            # Only the root's draft KV is kept: the accepted drafts are fed again next step.
            req.num_draft_computed_tokens = root[i] + 1
        probs = (flat_q[0][None] if len(flat_q) == 1 else torch.stack(flat_q)) if flat_q else None
        has_tree = any(p is not None for p in parents)
        return DraftBatch(drafts, probs, *fed, parents if has_tree else None, passes)

    @staticmethod
    def _argmax_chains(sched: SchedulerOutput, drafting: list[tuple[int, Request, int]]) -> bool:
        """Whether every drafting request's drafts are a chain of argmaxes of unedited rows."""
        items = sched.scheduled
        return all(items[i].branches == 1 and not edits_logits(req) for i, req, _ in drafting)

    def _greedy_chains(
        self,
        drafting: list[tuple[int, Request, int]],  # (scheduled index, request, K)
        first: PackedBatch,  # every token each request's draft has not seen
        tables: list[list[int]],
        drafts: list[list[int]],  # per scheduled request, filled in
    ) -> DraftBatch:
        """`propose` for `_argmax_chains`: each pass's rows argmaxed at once, no q kept."""
        head = self.runner.head_tokens

        def picked(logits: torch.Tensor) -> list[int]:
            ids = argmax(logits)  # a restricted head's columns are in token order
            return (ids if head is None else head[ids]).tolist()

        fed, pairs = _fed(first)
        chains = [[token] for token in picked(self.runner.forward_packed(first, widen=False))]
        ks = [k for _, _, k in drafting]
        active = list(range(len(drafting)))
        for depth in range(2, max(ks) + 1):
            active = [j for j in active if ks[j] >= depth]
            batch = _chain_pass(
                [drafting[j][:2] for j in active], [chains[j][-1] for j in active], tables
            )
            more = _fed(batch)
            fed, pairs = fed + more[0], pairs + more[1]
            logits = self.runner.forward_packed(batch, widen=False)
            for j, token in zip(active, picked(logits), strict=True):
                chains[j].append(token)
        for (i, _, _), chain in zip(drafting, chains, strict=True):
            drafts[i] = chain
        return DraftBatch(drafts, None, fed, pairs, None, max(ks))

    def _next_pass(
        self, req: Request, lanes: list[list[int]], table: list[int], root: int
    ) -> SeqInput:
        """The next level's inputs: a chain feeds its last draft; a tree of N branches feeds
        the N nodes of its deepest level, each seeing the root and its own branch."""
        if len(lanes) == 1:
            pos = req.num_draft_computed_tokens
            req.num_draft_computed_tokens = pos + 1
            return SeqInput([lanes[0][-1]], pos, table, [0])
        n, depth = len(lanes), len(lanes[0])  # feeding the nodes at this depth
        bits = [1 | sum(1 << ((d - 1) * n + b + 1) for d in range(1, depth + 1)) for b in range(n)]
        start = root + (depth - 1) * n + 1
        return SeqInput(
            [lane[-1] for lane in lanes],
            start,
            table,
            list(range(n)),
            tree=bits,
            tree_base=root,
            positions=[root + depth] * n,
        )

    def _pick(
        self,
        logits: torch.Tensor,  # [len(entries), vocab], or the restricted head's columns
        entries: list[tuple[Request, list[int], int]],  # (request, drafts before, how many)
        want_q: bool,
    ) -> list[tuple[list[int], torch.Tensor | None]]:  # per entry: tokens, the q they came from
        """Draft tokens from each row: the argmax (greedy), a sample of q or the coupled race
        (seeded); a tree's root asks for several distinct ones (`_siblings`)."""
        if not entries:  # a pass that only fed prefill chunks
            return []
        head = self.runner.head_tokens
        chains = all(n == 1 for _, _, n in entries)
        if chains and not any(edits_logits(req) for req, _, _ in entries):
            if not want_q:  # a restricted head's columns are in token order: a tie picks alike
                picked = argmax(logits) if head is None else head[argmax(logits)]
                return [([token], None) for token in picked.tolist()]
            if head is not None and (picks := self._sample_head(logits, [e[0] for e in entries])):
                return picks
        rows = [RowSpec(req, prior) for req, prior, _ in entries]  # earlier drafts count
        logits = apply_penalties_and_masks(self.runner.widen(logits), rows)
        if not want_q:  # all greedy
            n_max = max(n for _, _, n in entries)
            picked = argmax(logits)[:, None] if n_max == 1 else logits.topk(n_max, dim=-1).indices
            top = picked.tolist()
            return [(top[j][:n], None) for j, (_, _, n) in enumerate(entries)]
        q = logits_to_probs(logits, rows)
        reqs = [req for req, _, _ in entries]
        tokens = sample_from(q, request_uniforms(reqs, [1] * len(reqs), q.device)).tolist()
        coupled = [j for j, row in enumerate(rows) if row.request.params.coupled]
        if coupled:  # the target's own noise for these positions: the Gumbel coupling
            raced = coupled_tokens(logits[coupled], [rows[j] for j in coupled])
            for j, token in zip(coupled, raced, strict=True):
                tokens[j] = token
        out: list[tuple[list[int], torch.Tensor | None]] = []
        for j, (req, _, n) in enumerate(entries):
            picked = [tokens[j]]
            if n > 1:
                picked = self._siblings(logits[j], q[j], req, tokens[j], n, self.tree_drafts)
            out.append((picked, q[j]))
        return out

    def _sample_head(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> list[tuple[list[int], torch.Tensor]] | None:
        """Plain sampled chains on the CPU in one `sample_head` kernel call; None elsewhere."""
        head = self.runner.head_tokens
        params = [req.params for req in reqs]
        if not (kernel_rows(logits) and all(plain_sampling(p) for p in params)):
            return None
        uniform = request_uniforms(reqs, [1] * len(reqs), head.device)
        tokens, q = cpu_sampling.sample_head(
            logits, [1.0 / p.temperature for p in params], head, uniform, self.runner.vocab_size
        )
        return [([token], q[j]) for j, token in enumerate(tokens)]

    @staticmethod
    def _siblings(
        logits: torch.Tensor, q: torch.Tensor, req: Request, first: int, n: int, how: str
    ) -> list[int]:
        """n distinct candidates for a tree's root: `first` (the row's own pick) first, or
        with "top" drafts for a sampling request the top n - 1 and one draw from the rest."""
        if req.params.greedy or req.params.coupled:
            ranked = logits.topk(n + 1).indices.tolist()
            return [first] + [t for t in ranked if t != first][: n - 1]
        if how == "top":
            top = q.topk(n - 1).indices.tolist()
            rest = q.clone()
            rest[top] = 0.0
            if float(rest.sum()) <= 0:  # no mass left: repeat (never kept, q' = 0 there)
                return top + [top[-1]]
            return top + torch.multinomial(rest, 1, generator=req.generator).tolist()
        rest = q.clone()
        rest[first] = 0.0
        count = min(n - 1, int((rest > 0).sum()))
        more = []
        if count:  # the next draws, without replacement (q renormalised over the rest)
            more = torch.multinomial(rest, count, generator=req.generator).tolist()
        # Too few tokens with mass: a repeat has q = 0 after its first, never kept.
        return ([first] + more + [first] * n)[:n]


def _chain_pass(
    active: list[tuple[int, Request]], tokens: list[int], tables: list[list[int]]
) -> PackedBatch:
    """A pass of chains as `_next_pass`'s inputs would pack: each feeds its last draft."""
    positions = []
    for _, req in active:
        positions.append(req.num_draft_computed_tokens)
        req.num_draft_computed_tokens += 1
    n = len(active)
    context = [p + 1 for p in positions]
    return PackedBatch(
        tokens, positions, [1] * n, context, [tables[i] for i, _ in active], list(range(n)), None
    )


def _fed(batch: PackedBatch) -> tuple[int, int]:
    pairs = sum(q * c for q, c in zip(batch.query_lens, batch.context_lens, strict=True))
    return len(batch.token_ids), pairs
