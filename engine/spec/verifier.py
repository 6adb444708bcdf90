"""The target pass of a step: one packed forward, then rejection sampling per request. A request's
rows: its prompt positions (prompt logprobs), then if it samples its last token and drafts."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.attention.paged import Tree
from engine.model.routes import Packer
from engine.model.runner import ModelRunner
from engine.sample.rejection_sampler import emitted_tokens, greedy_verify, verify_sampled
from engine.sample.sampler import (
    RowSpec,
    apply_penalties_and_masks,
    argmax,
    couple_seeded_rows,
    edits_logits,
    logits_to_probs,
    plain_sampling,
    request_uniforms,
    target_tokens,
    token_logprobs,
)
from engine.sample.tree_verifier import DraftTree, verify_tree, verify_tree_greedy
from engine.spec.proposers.base import DraftBatch
from engine.spec.speed_of_light import SpeedOfLight
from engine.types.batch import SchedulerOutput
from engine.types.outputs import StepTokens, TokenLogprob
from engine.types.request import Request


@dataclass
class VerifyResult:
    tokens: dict[str, StepTokens] = field(default_factory=dict)
    """Verified tokens of every request that sampled this step."""
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    """Per request asking: its chunk's prompt logprobs (a leading None where the chunk starts
    the prompt); the scheduler joins them."""
    forward_seconds: float = 0.0
    """Wall time of the target's forward (the rest of `run` is sampling and verification)."""
    hidden: torch.Tensor | None = None
    """[fed tokens, hidden] the target's last hidden states, in the order the tokens were laid
    out (each request's new tokens, then its drafts), when a feature draft asked for them."""


class Verifier:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        speed_of_light: SpeedOfLight | None = None,
        method: str = "block",
        tree_drafts: str = "top",
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.method = method
        """token or block (engine/sample/rejection_sampler.py)."""
        self.speed_of_light = speed_of_light
        self.tree_drafts = tree_drafts
        """How tree candidates were drafted (engine/sample/tree_verifier.py)."""

    def run(
        self,
        runner: ModelRunner,
        sched: SchedulerOutput,
        block_tables: list[list[int]],
        drafts: DraftBatch | None,
    ) -> VerifyResult:
        packer = Packer()
        attention_trees: dict[int, Tree] = {}  # by scheduled index
        prompt_rows: list[tuple[Request, int]] = []  # (request, number of prompt rows)
        samplers: list[tuple[Request, list[int]]] = []  # (request, its drafts)
        trees: dict[str, tuple[DraftTree, list[int], int]] = {}  # id: (tree, table, root slot)
        token_ids = drafts.token_ids if drafts is not None else [[] for _ in sched.scheduled]
        all_parents = drafts.parents if drafts is not None else None
        for i, (item, table) in enumerate(zip(sched.scheduled, block_tables, strict=True)):
            req, drafted, start = item.request, token_ids[i], item.request.num_computed_tokens
            tokens = req.token_ids(start, start + item.num_new_tokens) + drafted
            parents = all_parents[i] if all_parents else None
            bits = positions = None
            if parents is not None and drafted:  # a draft tree under the request's last token
                fixed = parents.count(0) - 1 if self.tree_drafts == "top" else 0
                tree = DraftTree(tokens, [-1, *parents], fixed_root_children=fixed)
                trees[req.request_id] = (tree, table, start)
                bits = [sum(1 << a for a in tree.ancestors(v)) for v in range(len(tokens))]
                positions = [start + tree.depth(v) for v in range(len(tokens))]
            offsets: list[int] = []
            if req.params.prompt_logprobs is not None and not req.output_token_ids:
                # Row j predicts the prompt token at position start + j + 1.
                n = max(0, min(item.num_new_tokens, req.num_prompt_tokens - start - 1))
                offsets += range(n)
                prompt_rows.append((req, n))
            if item.samples:
                offsets += range(item.num_new_tokens - 1, len(tokens))
                samplers.append((req, drafted))
            packer.add(tokens, start, table, offsets, positions)
            if bits is not None:
                attention_trees[i] = Tree(start, bits)

        batch = packer.build(
            [attention_trees.get(i) for i in range(len(sched.scheduled))] if trees else None
        )
        start = time.perf_counter()
        logits = runner.forward_packed(batch)[:, : self.vocab_size]  # [num_rows, vocab]
        result = VerifyResult(forward_seconds=time.perf_counter() - start)
        if runner.hidden_rows:
            result.hidden = runner.last_hidden
        if not prompt_rows:  # only sampling rows: each request's in turn
            if samplers:
                self._verify(samplers, logits, drafts, trees, runner, result)
            return result
        # Split rows back per request, in the order they were laid out.
        cursor = 0
        prompt_logits: dict[str, torch.Tensor] = {}
        sample_parts: list[tuple[int, int]] = []  # (first row, rows) of each sampling request
        prompt_iter = iter(prompt_rows)
        next_prompt = next(prompt_iter, None)
        sampled = iter(samplers)
        for item in sched.scheduled:
            req = item.request
            if next_prompt is not None and next_prompt[0] is req:
                n = next_prompt[1]
                prompt_logits[req.request_id] = logits[cursor : cursor + n]
                cursor += n
                next_prompt = next(prompt_iter, None)
            if item.samples:
                n = 1 + len(next(sampled)[1])
                sample_parts.append((cursor, n))
                cursor += n

        for req, _ in prompt_rows:
            result.prompt_logprobs[req.request_id] = _prompt_logprobs(
                req, prompt_logits[req.request_id]
            )
        if samplers:  # the sampling rows: one view where nothing lies between them
            first, last = sample_parts[0][0], sum(sample_parts[-1])
            if last - first == sum(n for _, n in sample_parts):
                rows = logits[first:last]
            else:
                rows = torch.cat([logits[a : a + n] for a, n in sample_parts])
            self._verify(samplers, rows, drafts, trees, runner, result)
        return result

    def _verify(
        self,
        samplers: list[tuple[Request, list[int]]],
        rows: torch.Tensor,  # [sum(1 + drafts_i), vocab]: each sampling request's rows
        drafts: DraftBatch | None,
        trees: dict[str, tuple[DraftTree, list[int], int]],
        runner: ModelRunner,
        result: VerifyResult,
    ) -> None:
        if trees:
            self._verify_trees(samplers, rows, drafts, trees, runner, result)
        else:
            self._verify_chains(samplers, rows, drafts, result)

    def _verify_chains(
        self,
        samplers: list[tuple[Request, list[int]]],  # (request, its drafts)
        logits: torch.Tensor,  # [sum(1 + k_i), vocab]
        drafts: DraftBatch | None,
        result: VerifyResult,
    ) -> None:
        reqs = [r for r, _ in samplers]
        drafted = [d for _, d in samplers]
        num_drafts = [len(d) for d in drafted]
        sol = self.speed_of_light
        if sol is not None and any(num_drafts) and sol.due():
            first_rows = torch.tensor(
                [0] + list(itertools.accumulate(k + 1 for k in num_drafts))[:-1]
            )
            self.speed_of_light.observe_distributions(logits[first_rows.to(logits.device)])
        wants_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw = logits.clone() if wants_logprobs else logits
        rows = None  # where a row's logits change or its distribution needs them
        if any(edits_logits(r) for r in reqs):
            rows = _chain_rows(samplers)
            logits = apply_penalties_and_masks(logits, rows)
        if all(r.params.greedy for r in reqs):  # one-hot rows: the argmax decides
            emitted = greedy_verify(argmax(logits).tolist(), drafted)
        elif all(r.params.greedy or r.params.coupled for r in reqs):  # or the seeded race
            emitted = greedy_verify(target_tokens(logits, rows or _chain_rows(samplers)), drafted)
        else:
            uniform = request_uniforms(reqs, [k + 1 for k in num_drafts], self.device)
            draft_probs = drafts.probs if drafts is not None else None
            ids = [t for d in drafted for t in d]
            if all(plain_sampling(r.params) for r in reqs):  # softmax(logits / T) rows
                temperatures = [r.params.temperature for r in reqs]
                emitted = verify_sampled(
                    logits, temperatures, ids, draft_probs, num_drafts, uniform, self.method
                )
            else:  # top-k/top-p rows, or seeded (coupled) or greedy rows among them
                rows = rows or _chain_rows(samplers)
                probs = couple_seeded_rows(logits_to_probs(logits, rows), rows, logits)
                draft_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                emitted = emitted_tokens(
                    probs, draft_ids, draft_probs, num_drafts, uniform, self.method
                )
        self._emit(reqs, num_drafts, emitted, raw, result)

    def _verify_trees(
        self,
        samplers: list[tuple[Request, list[int]]],  # (request, its drafts)
        logits: torch.Tensor,  # [sum(1 + nodes_i), vocab]
        drafts: DraftBatch | None,
        trees: dict[str, tuple[DraftTree, list[int], int]],
        runner: ModelRunner,
        result: VerifyResult,
    ) -> None:
        """A step with draft trees (engine/sample/tree_verifier.py): each request keeps the
        longest accepted path, whose keys and values then move behind the root."""
        reqs = [r for r, _ in samplers]
        # A request without a tree verifies its chain as a one-branch tree (token by token).
        shapes = [
            trees[r.request_id][0]
            if r.request_id in trees
            else DraftTree([0, *d], list(range(-1, len(d))))
            for r, d in samplers
        ]
        rows = [
            RowSpec(r, [t.tokens[a] for a in t.ancestors(v)[1:]])
            for r, t in zip(reqs, shapes, strict=True)
            for v in range(len(t.tokens))
        ]
        raw = logits.clone() if any(r.params.logprobs is not None for r in reqs) else logits
        logits = apply_penalties_and_masks(logits, rows)
        greedy = all(r.params.greedy for r in reqs)
        if greedy:
            best = argmax(logits).tolist()
        else:
            probs = couple_seeded_rows(logits_to_probs(logits, rows), rows, logits)
            counts = [len(t.tokens) + 1 for t in shapes]
            uniform = request_uniforms(reqs, counts, self.device)
        draft_q = drafts.probs if drafts is not None else None
        row = q_row = u_row = 0
        for (req, drafted), tree in zip(samplers, shapes, strict=True):
            n = len(tree.tokens)
            if greedy:
                path, token = verify_tree_greedy(tree, best[row : row + n])
            else:
                q_nodes = None
                if draft_q is not None and drafted:  # q_v: what v's children were drawn from
                    q_nodes = torch.zeros_like(probs[row : row + n])
                    for j in range(len(drafted)):
                        q_nodes[tree.parents[j + 1]] = draft_q[q_row + j]
                node_probs = probs[row : row + n]
                path, token = verify_tree(tree, node_probs, q_nodes, uniform[u_row : u_row + n + 1])
            tokens = [tree.tokens[v] for v in path] + [token]
            if req.request_id in trees:
                _, table, root = trees[req.request_id]
                moves = [(root + v, root + 1 + j) for j, v in enumerate(path) if v != j + 1]
                runner.move_kv(table, [a for a, _ in moves], [b for _, b in moves])
            logprobs = None
            if req.params.logprobs is not None:
                picked = raw[[row] + [row + v for v in path]]
                logprobs = token_logprobs(picked, tokens, req.params.logprobs)
            depth = max(tree.depth(v) for v in range(n))
            result.tokens[req.request_id] = StepTokens(tokens, logprobs, depth, len(path))
            if depth and self.speed_of_light is not None:
                self.speed_of_light.observe_pass(len(tokens))
            row, q_row, u_row = row + n, q_row + len(drafted), u_row + n + 1

    def _emit(
        self,
        reqs: list[Request],
        num_drafts: list[int],
        emitted: list[list[int]],  # per request: accepted drafts + the recovered/bonus token
        raw: torch.Tensor,  # [rows, vocab] the target's logits, for logprobs
        result: VerifyResult,
    ) -> None:
        row = 0
        for req, k, tokens in zip(reqs, num_drafts, emitted, strict=True):
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = token_logprobs(raw[row : row + len(tokens)], tokens, req.params.logprobs)
            result.tokens[req.request_id] = StepTokens(tokens, logprobs, k, len(tokens) - 1)
            if k and self.speed_of_light is not None:
                self.speed_of_light.observe_pass(len(tokens))
            row += k + 1


def _chain_rows(samplers: list[tuple[Request, list[int]]]) -> list[RowSpec]:
    """Each request's rows: its last token's, then one after each of its drafts."""
    return [RowSpec(r, d[:j]) for r, d in samplers for j in range(len(d) + 1)]


def _prompt_logprobs(req: Request, logits: torch.Tensor) -> list[TokenLogprob | None]:
    """`VerifyResult.prompt_logprobs` of `req`: row j predicts num_computed_tokens + j + 1."""
    start = req.num_computed_tokens
    chunk: list[TokenLogprob | None] = [None] if start == 0 else []
    if logits.shape[0]:
        targets = req.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        chunk.extend(token_logprobs(logits, targets, req.params.prompt_logprobs or 0))
    return chunk
