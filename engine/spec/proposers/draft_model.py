"""A small Hugging Face causal LM that drafts on the target's block tables.

The draft model has its own KV tensors but indexes them with the target's block ids, so one
allocation, one ref count and one rollback cover both. Its progress is
`Request.num_draft_computed_tokens`; after verification the scheduler clamps it to the
verified length, which is the whole rollback.

One step, for every request with K > 0 (others cost nothing here):
  pass 1: feed the tokens the draft has not seen yet (the last sampled token, plus the last
          draft of the previous step when all were accepted, plus anything missed while K was
          0) -> logits -> x_1;
  pass i: feed x_{i-1} -> x_i, for requests with K >= i (the others drop out).
With --draft-min-prob P > 0 a chain also stops where the draft is unsure: the first draft
whose row gives the draft's most likely token less than P (softmax of its logits at
temperature 1, before masks and sampling settings) is dropped, with every deeper one. The
test depends only on the draft's logits, never on the token drawn from them, so each draft
kept is still a draw from the q it is verified with, and the output stays the target's
(docs/VERIFICATION.md). Trees are never cut.
Requests still in prefill feed the same chunk as the target in pass 1, so the draft's cache
stays complete for prompts (and for prefix-cache hits).

Greedy requests draft the argmax, sampling requests a sample of q; a seeded request drafts
with the noise its target samples with (engine/sample/sampler.py), so its drafts are accepted
exactly when both races pick the same token.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.config import SpecConfig
from engine.cpu import sampling as cpu_sampling
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from engine.sample.sampler import (
    RowSpec,
    apply_penalties_and_masks,
    argmax,
    changes_logits,
    coupled_tokens,
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

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        tree_drafts: str = "top",
        min_prob: float = 0.0,
    ) -> None:
        if runner.vocab_size != target_vocab:
            raise ValueError(
                f"--draft-model has a vocabulary of {runner.vocab_size} tokens but the target "
                f"has {target_vocab}; the draft must share the target's tokenizer"
            )
        self.runner = runner
        self.tree_drafts = tree_drafts
        self.min_prob = min_prob

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
        return cls(runner, target.vocab_size, config.tree_drafts, config.draft_min_prob)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv(num_blocks, block_size)

    def observe(self, step: StepResult) -> None:
        pass

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        seqs: list[SeqInput] = []
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
            tokens = req.all_token_ids[start:end]
            if not tokens:
                continue
            seqs.append(SeqInput(tokens, start, table, [len(tokens) - 1] if k > 0 else []))
            req.num_draft_computed_tokens = end
            if k > 0:
                drafting.append((i, req, k))

        drafts: list[list[int]] = [[] for _ in sched.scheduled]
        if not seqs:
            return DraftBatch(drafts, None)
        # Greedy drafts are the argmax, q one-hot on them: what a model-free drafter's missing
        # probs mean to the verifier, so none are built.
        want_q = not all(req.params.greedy for _, req, _ in drafting)
        fed = [0, 0]  # tokens, query x key pairs

        def forward(seqs: list[SeqInput]) -> torch.Tensor:
            for seq in seqs:
                fed[0] += len(seq.token_ids)
                fed[1] += len(seq.token_ids) * seq.context_len
            return self.runner.forward(seqs, widen=False)  # _pick widens where it must

        # A lane is one chain of drafts: one per request, or one per branch of a tree.
        width = {i: sched.scheduled[i].branches for i, _, _ in drafting}
        lanes = {i: [[] for _ in range(width[i])] for i, _, _ in drafting}
        lane_q: dict[int, list[list[torch.Tensor]]] = {
            i: [[] for _ in range(width[i])] for i, _, _ in drafting
        }
        root = {i: req.num_tokens - 1 for i, req, _ in drafting}  # the root's cache slot
        stopped: set[int] = set()  # chains cut by --draft-min-prob
        passes = 1 if drafting else 0  # that picked drafts
        logits = forward(seqs)
        picks = self._pick(logits, [(req, [], width[i]) for i, req, _ in drafting], want_q)
        unsure = self._unsure(logits)
        for j, ((i, _, _), (tokens, q)) in enumerate(zip(drafting, picks, strict=True)):
            if width[i] == 1 and unsure[j]:
                stopped.add(i)
                continue
            for b, token in enumerate(tokens):
                lanes[i][b].append(token)
                if q is not None:
                    lane_q[i][b].append(q)
        for depth in range(2, max((k for _, _, k in drafting), default=0) + 1):
            active = [(i, req) for i, req, k in drafting if k >= depth and i not in stopped]
            if not active:
                break
            seqs = [self._next_pass(req, lanes[i], block_tables[i], root[i]) for i, req in active]
            entries = [(req, lane, 1) for i, req in active for lane in lanes[i]]
            logits = forward(seqs)
            passes += 1
            picks = self._pick(logits, entries, want_q)
            unsure = self._unsure(logits)
            flat_lanes = [(i, b) for i, _ in active for b in range(width[i])]
            for j, ((i, b), (tokens, q)) in enumerate(zip(flat_lanes, picks, strict=True)):
                if width[i] == 1 and unsure[j]:
                    stopped.add(i)
                    continue
                lanes[i][b].extend(tokens)
                if q is not None:
                    lane_q[i][b].append(q)
        parents: list[list[int] | None] = [None] * len(sched.scheduled)
        flat_q: list[torch.Tensor] = []
        for i, req, k in drafting:
            if width[i] == 1:
                drafts[i] = lanes[i][0]
                flat_q.extend(lane_q[i][0])
                continue
            # A tree, breadth first: node (depth d, branch b) is draft (d - 1) * N + b.
            n = width[i]
            drafts[i] = [lanes[i][b][d] for d in range(k) for b in range(n)]
            parents[i] = [0 if d == 0 else (d - 1) * n + b + 1 for d in range(k) for b in range(n)]
            flat_q.extend(lane_q[i][b][d] for d in range(k) for b in range(n) if want_q)
            # Only the root's draft KV is kept: the accepted drafts are fed again next step.
            req.num_draft_computed_tokens = root[i] + 1
        # (One row, as at concurrency 1 with K = 1: a view of it, not a copy.)
        probs = (flat_q[0][None] if len(flat_q) == 1 else torch.stack(flat_q)) if flat_q else None
        has_tree = any(p is not None for p in parents)
        return DraftBatch(drafts, probs, *fed, parents if has_tree else None, passes, len(stopped))

    def _unsure(self, logits: torch.Tensor) -> list[bool]:
        """Per row of a draft pass: whether the draft's most likely token has a probability
        below --draft-min-prob (all False when it is 0: nothing computed)."""
        if self.min_prob <= 0 or logits.shape[0] == 0:
            return [False] * logits.shape[0]
        x = logits.float()  # the top probability is exp(max - logsumexp)
        return (torch.logsumexp(x, -1) - x.amax(-1) > -math.log(self.min_prob)).tolist()

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
        """Draft tokens from each row: the argmax (greedy), a sample of q, the coupled race
        (seeded); a tree's root asks for several distinct ones: the top ones for greedy and
        seeded requests (the race's winner first), a draw without replacement otherwise."""
        if not entries:  # a pass that only fed prefill chunks
            return []
        rows = [RowSpec(req, prior) for req, prior, _ in entries]  # earlier drafts count
        head = self.runner.head_tokens
        chains = all(n == 1 for _, _, n in entries)
        if head is not None and chains and not want_q and not changes_logits(rows):
            # Greedy chains with nothing to mask: the argmax of the head's own columns (in
            # increasing token order, so a tie picks the token the vocabulary's row would).
            # Not widening them to the vocabulary: 39 against 136 us a pick of the default
            # draft's 8,191 columns (2-core AMD EPYC Zen 3, 2026-11-28, alternated 4,000 times).
            return [([token], None) for token in head[argmax(logits)].tolist()]
        if head is not None and chains and not changes_logits(rows):
            if (picks := self._sample_head(logits, rows)) is not None:
                return picks
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
            raced = coupled_tokens(q[coupled], [rows[j] for j in coupled])
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
        self, logits: torch.Tensor, rows: list[RowSpec]
    ) -> list[tuple[list[int], torch.Tensor]] | None:
        """Sampled chains with nothing to mask, cut or couple, on the CPU: q over the restricted
        head's own columns, widened with zeros, and a token drawn from it, in one kernel call
        (engine/cpu/sampling.py `sample_head`); None where it does not apply."""
        head = self.runner.head_tokens
        params = [row.request.params for row in rows]
        if not (kernel_rows(logits) and all(plain_sampling(p) for p in params)):
            return None
        uniform = request_uniforms([row.request for row in rows], [1] * len(rows), head.device)
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
        # Too few tokens with mass: repeat one; a repeat has q = 0 after its first, so the
        # verifier never keeps it.
        return ([first] + more + [first] * n)[:n]
