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
Requests still in prefill feed the same chunk as the target in pass 1, so the draft's cache
stays complete for prompts (and for prefix-cache hits).

Greedy requests draft the argmax, sampling requests a sample of q; a seeded request drafts
with the noise its target samples with (engine/sample/sampler.py), so its drafts are accepted
exactly when both races pick the same token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SpecConfig
from engine.core.request import Request
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from engine.sample.sampler import (
    RowSpec,
    apply_penalties_and_masks,
    coupled_tokens,
    logits_to_probs,
    request_uniforms,
    sample_from,
)
from engine.spec.proposers.base import DraftBatch

if TYPE_CHECKING:
    from engine.core.scheduler import SchedulerOutput


class DraftModelProposer:
    keeps_kv = True

    def __init__(self, runner: ModelRunner, target_vocab: int) -> None:
        if runner.vocab_size != target_vocab:
            raise ValueError(
                f"--draft-model has a vocabulary of {runner.vocab_size} tokens but the target "
                f"has {target_vocab}; the draft must share the target's tokenizer"
            )
        self.runner = runner

    @classmethod
    def from_config(
        cls,
        config: SpecConfig,
        device: torch.device,
        dtype: torch.dtype,
        target_vocab: int,
        attention_backend: str,
        model_impl: str,
        quantization: str,
    ) -> DraftModelProposer:
        assert config.draft_model is not None  # SpecConfig validation guarantees it
        runner = ModelRunner(
            config.draft_model, device, dtype, attention_backend, model_impl, quantization
        )
        return cls(runner, target_vocab)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv(num_blocks, block_size)

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        seqs: list[SeqInput] = []
        drafting: list[tuple[int, Request, int]] = []  # (scheduled index, request, K)
        for i, (item, table) in enumerate(zip(sched.scheduled, block_tables, strict=True)):
            req, k = item.request, item.num_draft_tokens
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
        probs: list[list[torch.Tensor]] | None = [[] for _ in sched.scheduled]
        if not seqs:
            return DraftBatch(drafts, None)
        if all(req.params.greedy for _, req, _ in drafting):
            # Greedy drafts are the argmax, q one-hot on them: what a model-free drafter's
            # missing probs mean to the rejection sampler, so none are built.
            probs = None
        fed = [0, 0]  # tokens, query x key pairs

        def forward(seqs: list[SeqInput]) -> torch.Tensor:
            for seq in seqs:
                fed[0] += len(seq.token_ids)
                fed[1] += len(seq.token_ids) * seq.context_len
            return self.runner.forward(seqs)

        logits = forward(seqs)
        step = 0
        while drafting:
            self._sample(logits, drafting, step, drafts, probs)
            step += 1
            drafting = [d for d in drafting if d[2] > step]
            if not drafting:
                break
            seqs = []
            for i, req, _ in drafting:
                pos = req.num_draft_computed_tokens
                seqs.append(SeqInput([drafts[i][-1]], pos, block_tables[i], [0]))
                req.num_draft_computed_tokens = pos + 1
            logits = forward(seqs)
        flat = [p for per_req in probs for p in per_req] if probs is not None else []
        return DraftBatch(drafts, torch.stack(flat) if flat else None, *fed)

    def _sample(
        self,
        logits: torch.Tensor,  # [len(drafting), vocab]
        drafting: list[tuple[int, Request, int]],
        step: int,
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]] | None,
    ) -> None:
        reqs = [req for _, req, _ in drafting]
        rows = [RowSpec(req, drafts[i]) for i, req, _ in drafting]  # earlier drafts count
        logits = apply_penalties_and_masks(logits, rows)
        if probs is None:  # all greedy
            for (i, _, _), token in zip(drafting, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
            return
        q = logits_to_probs(logits, rows)
        tokens = sample_from(q, request_uniforms(reqs, [1] * len(reqs), q.device)).tolist()
        coupled = [j for j, row in enumerate(rows) if row.request.params.coupled]
        if coupled:  # the target's own noise for these positions: the Gumbel coupling
            raced = coupled_tokens(q[coupled], [rows[j] for j in coupled])
            for j, token in zip(coupled, raced, strict=True):
                tokens[j] = token
        for (i, _, _), token, q_row in zip(drafting, tokens, q, strict=True):
            drafts[i].append(token)
            probs[i].append(q_row)
