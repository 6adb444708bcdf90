"""A feature draft (EAGLE, Li et al. 2024): one decoder layer that reads the target's hidden states.

Input at p: the target's embedding of x_p beside its final-norm feature at p - 1 (past the
first draft, the draft's own); the target's LM head makes the logits. Its config.json says
`"tandem_draft": {"kind": "eagle"}`. KV lives in the target's blocks; keys from predicted
features are dropped, so each step feeds the verified tokens again. Chains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)

from engine.attention import paged as attention
from engine.config import SpecConfig
from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from engine.spec.proposers.base import DraftBatch
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.types.request import Request

if TYPE_CHECKING:
    from engine.spec.step import StepResult
    from engine.types.batch import SchedulerOutput

MARKER = "tandem_draft"
FC_WEIGHT = "model.embed_tokens.fc.weight"


def is_feature_draft(path: str) -> bool:
    """Whether `path` is a directory holding a feature draft (its config.json says so)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return json.loads(config.read_text()).get(MARKER, {}).get("kind") == "eagle"


class FeatureEmbedding(nn.Module):
    """fc([target embedding of x_p ; target feature at p - 1]); `features` [tokens, hidden] is
    set per pass by the proposer, zero when absent (probes and timings)."""

    def __init__(self, weight: torch.Tensor, fc: nn.Linear) -> None:
        super().__init__()
        self.weight = weight  # the target's own embedding, shared (not a copy)
        self.fc = fc
        self.features: torch.Tensor | None = None

    def mix(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The draft layer's input from embeddings and features of the same shape."""
        return self.fc(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.weight)
        f = self.features
        if f is None:
            f = x.new_zeros(x.shape)
        elif f.shape[0] != input_ids.numel():
            raise ValueError(f"{f.shape[0]} feature rows for {input_ids.numel()} tokens")
        return self.mix(x, f.view(x.shape))


def feature_draft_config(target: PretrainedConfig, intermediate_size: int) -> LlamaConfig:
    """The config of a feature draft for `target`: its shapes and vocabulary, one Llama layer
    of `intermediate_size`, bfloat16 weights, and the marker is_feature_draft reads."""
    config = target.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        config.pop(key, None)
    config.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=1,
        intermediate_size=intermediate_size,
        dtype="bfloat16",
    )
    config[MARKER] = {"kind": "eagle", "feature_size": target.hidden_size}
    return LlamaConfig.from_dict(config)


def feature_draft_model(
    config: PretrainedConfig, embedding: torch.Tensor, attn_implementation: str = "sdpa"
) -> LlamaForCausalLM:
    """The feature draft: a one-layer LlamaForCausalLM whose embedding is a FeatureEmbedding
    over `embedding` (the target's) with a new input projection. Its own weights are the
    projection (`model.embed_tokens.fc`), `model.layers.0` and `model.norm`; the engine gives it
    the target's LM head, training keeps the head outside. Float32, on the current device."""
    if embedding.shape[-1] != config.hidden_size:
        raise ValueError(
            f"a feature draft of width {config.hidden_size} for an embedding of width "
            f"{embedding.shape[-1]}"
        )
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    model.model.embed_tokens = FeatureEmbedding(embedding, fc)
    return model


def load_feature_draft(path: str, target: ModelRunner, dtype: torch.dtype) -> nn.Module:
    """feature_draft_model over the target's embedding, with the weights in `path` and the
    target's LM head (the runner restricts it to head_tokens)."""
    attention.register()
    config = AutoConfig.from_pretrained(path)
    embedding = target.model.get_input_embeddings().weight
    with torch.device("meta"):
        model = feature_draft_model(config, embedding, attention.ATTN_IMPLEMENTATION)
    weights = {k: v.to(dtype) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    try:
        _, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:  # a weight of another shape
        raise ValueError(f"{path}: not a feature draft for this target: {e}") from None
    if unexpected:
        raise ValueError(f"{path}: not a feature draft for this target ({unexpected})")
    model.get_output_embeddings().weight = target.model.get_output_embeddings().weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"{path}: weights missing from model.safetensors: {', '.join(meta)}")
    return model


class _Features:
    """The target's features at positions base.., kept until the draft has fed them."""

    def __init__(self) -> None:
        self.base = 0
        self.rows: torch.Tensor | None = None

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start..; they replace what was kept from start on."""
        if self.rows is None or not self.base <= start <= self.base + len(self.rows):
            self.base, self.rows = start, rows.clone()
            return
        self.rows = torch.cat([self.rows[: start - self.base], rows])

    def read(self, start: int, end: int, width: int) -> torch.Tensor:
        """Rows for start..end - 1 (zero where none is kept); drops the rows before `start`."""
        device = None if self.rows is None else self.rows.device
        out = torch.zeros(end - start, width, device=device)
        if self.rows is not None:
            lo, hi = max(start, self.base), min(end, self.base + len(self.rows))
            if lo < hi:
                out[lo - start : hi - start] = self.rows[lo - self.base : hi - self.base]
            if start > self.base:
                self.rows, self.base = self.rows[start - self.base :], start
        return out


class EagleProposer(DraftModelProposer):
    keeps_kv = True
    observes = True

    def __init__(self, runner: ModelRunner, target: ModelRunner) -> None:
        super().__init__(runner, target.vocab_size)
        if target.native is None or runner.native is None:
            raise ValueError(
                "a feature draft (EAGLE) needs Tandem's native forward for the target and the "
                "draft (their hidden states); --model-impl transformers cannot run it"
            )
        target.hidden_rows = True
        self.target = target
        self.inputs: FeatureEmbedding = runner.model.get_input_embeddings()
        self.width = self.inputs.weight.shape[1]

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
    ) -> EagleProposer:
        assert config.draft_model is not None
        if config.max_branches != 1:
            raise ValueError("a feature draft (EAGLE) drafts chains: --draft-branches must be 1")
        if config.draft_quantization not in ("auto", "none"):  # auto: it keeps its weights
            raise ValueError(
                f"--draft-quantization {config.draft_quantization}: a feature draft (EAGLE) "
                "keeps its trained weights; use auto or none"
            )
        model = load_feature_draft(config.draft_model, target, dtype)
        runner = ModelRunner(
            config.draft_model, device, dtype, attention_backend, model_impl, "none", model=model
        )
        if runner.head_tokens is not None:  # its own copy of the rows: bfloat16, as trained
            with torch.no_grad():  # (a full head is the target's own tensor, left as it is)
                head = runner.model.get_output_embeddings().weight
                head.copy_(head.to(torch.bfloat16).to(head.dtype))
        return cls(runner, target)

    def _norm(self, hidden: torch.Tensor, model: ModelRunner) -> torch.Tensor:
        """Body output -> the feature the LM head reads (float32, on the model's device)."""
        norm = model.native.norm
        return F.rms_norm(
            hidden.float(), (hidden.shape[-1],), norm.weight.float(), norm.variance_epsilon
        )

    def observe(self, step: StepResult) -> None:
        """After the target's pass: keep each request's features, as the verifier laid them out."""
        assert step.verified.hidden is not None, "the target keeps its hidden rows for us"
        feats = self._norm(step.verified.hidden, self.target)
        cursor = 0
        for item, k in zip(step.sched.scheduled, step.num_drafts, strict=True):
            req = item.request
            n = item.num_new_tokens + k
            if req.draft_features is None:
                req.draft_features = _Features()
            req.draft_features.write(req.num_computed_tokens, feats[cursor : cursor + n])
            cursor += n

    def propose(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> DraftBatch:
        drafts: list[list[int]] = [[] for _ in sched.scheduled]
        seqs: list[SeqInput] = []
        feats: list[torch.Tensor] = []
        drafting: list[tuple[int, Request, int]] = []  # (scheduled index, request, K)
        for i, (item, table) in enumerate(zip(sched.scheduled, block_tables, strict=True)):
            req, k = item.request, item.num_proposed_tokens
            if k == 0:
                continue  # prefills and plain decodes: fed when the request drafts
            start, end = req.num_draft_computed_tokens, req.num_tokens
            store = req.draft_features or _Features()
            feats.append(store.read(start - 1, end - 1, self.width))
            seqs.append(SeqInput(req.token_ids(start, end), start, table, [end - start - 1]))
            drafting.append((i, req, k))
        if not seqs:
            return DraftBatch(drafts, None)
        want_q = not all(req.params.greedy for _, req, _ in drafting)
        fed = [0, 0]
        lanes: dict[int, list[int]] = {i: [] for i, _, _ in drafting}
        lane_q: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in drafting}
        active, out = drafting, torch.empty(0)  # out: the last pass's features, per active row
        passes = 0
        for depth in range(1, max(k for _, _, k in drafting) + 1):
            if depth > 1:
                keep = [j for j, (i, _, k) in enumerate(active) if k >= depth]
                if not keep:
                    break
                out = out[keep]
                active = [active[j] for j in keep]
                seqs = [
                    SeqInput([lanes[i][-1]], req.num_tokens + depth - 2, block_tables[i], [0])
                    for i, req, _ in active
                ]
                feats = [out]
            for seq in seqs:
                fed[0] += len(seq.token_ids)
                fed[1] += len(seq.token_ids) * seq.context_len
            device = self.inputs.weight.device
            self.inputs.features = torch.cat([f.to(device) for f in feats])
            try:
                logits = self.runner.forward(seqs, widen=False)  # _pick widens where it must
            finally:
                self.inputs.features = None
            hidden = self.runner.last_hidden  # every fed row, or only the logit rows (graphs)
            rows = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
            if hidden.shape[0] != int(rows[-1]) + 1:
                rows = torch.arange(len(seqs))
            out = self._norm(hidden[rows.to(hidden.device)], self.runner)
            passes += 1
            picks = self._pick(logits, [(req, lanes[i], 1) for i, req, _ in active], want_q)
            for (i, _, _), (tokens, q) in zip(active, picks, strict=True):
                lanes[i].extend(tokens)
                if q is not None:
                    lane_q[i].append(q)
        flat_q: list[torch.Tensor] = []
        for i, req, _ in drafting:
            drafts[i] = lanes[i]
            flat_q.extend(lane_q[i])
            # Keys from predicted features are not kept: the verified tokens are fed again.
            req.num_draft_computed_tokens = req.num_tokens
        probs = torch.stack(flat_q) if flat_q else None
        return DraftBatch(drafts, probs, *fed, None, passes)
