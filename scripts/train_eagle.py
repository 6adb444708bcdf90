"""Train the default feature draft (EAGLE-style) for SmolLM2-135M-Instruct on the CPU.

  python scripts/train_eagle.py [--out models/eagle] [--work DIR] [--train-minutes 30]

The draft (engine/spec/proposers/eagle.py) is one Llama decoder layer. At position p it reads
the token x_p (through the target's own embedding) beside the target's last hidden state at
p - 1 (after the target's final norm: the vector its LM head turns into the logits for x_p),
and predicts the target's hidden state at p, which the target's embedding rows for the head
tokens turn into draft logits for x_(p+1). Knowing where the target already is, it only has
to predict one step of it (Li et al., "EAGLE", 2024). Past the first draft its input is its
own prediction, so training unrolls the same way ("training-time test", as in EAGLE-3): depth
d at position p reads depth d - 1's prediction at p - 1 and attends to the real-feature keys
before p - d + 2 and to the keys depths 2..d wrote along its own path.

Stages, each kept in --work so a re-run continues where it stopped:
1. answers: scripts/train_draft.py's (the target's answers to the training instructions of
   scripts/chat_prompts.py, greedily and at temperature 0.8), plus windows of the standard
   library's docstrings.
2. features: the target's final hidden states at every position of those sequences (a
   bfloat16 pass of the dequantized GGUF model through transformers).
3. train: soft targets at every position are the target's own distribution over the head
   tokens (its features times its embedding rows); loss = cross-entropy against it at every
   depth + 0.1 x smooth-L1 between predicted and real features. The embedding and the head
   rows are the target's, frozen; the file holds only the layer, the input projection and
   the norm.
4. save: bfloat16 safetensors, config.json (a one-layer Llama config marked
   `tandem_draft: eagle`) and head_tokens.json into --out.

The held-out instructions (scripts/chat_prompts.py `split`) are never trained on; the
benchmarks use them. --out/training.json records the run; models/README.md the measured acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaConfig,
    LlamaDecoderLayer,
    repeat_kv,
    rotate_half,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model.files import prepare  # noqa: E402
from engine.model.head import HEAD_TOKENS_FILE  # noqa: E402
from engine.spec.proposers.eagle import feature_draft_config, feature_draft_model  # noqa: E402
from scripts.train_draft import (  # noqa: E402
    DEFAULT_TARGET,
    docstring_text,
    generate_answers,
    length_batches,
    log,
    warmup_cosine,
    write_provenance,
)


def sequences(answers: Path, tok, doc_tokens: int, seq_len: int) -> list[list[int]]:
    """Prompt + answer token ids of every answer, then docstring windows."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    with open(answers) as f:
        for line in f:
            row = json.loads(line)
            answer = row["answer"]
            if not answer:
                continue
            if row["finish"] == "stop" and answer[-1] != end:
                answer = answer + [end]
            out.append((row["prompt"] + answer)[:seq_len])
    text_ids = tok(docstring_text(doc_tokens * 4))["input_ids"][:doc_tokens]
    out.extend(text_ids[s : s + seq_len] for s in range(0, len(text_ids) - 32, seq_len))
    return out


@torch.inference_mode()
def extract_features(target_dir: str, seqs: list[list[int]], work: Path) -> list[torch.Tensor]:
    """The target's final (normed) hidden state at every position, bfloat16, per sequence."""
    path = work / "features.pt"
    if path.exists():
        return torch.load(path)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    started = time.perf_counter()
    for b in range(0, len(order), 16):
        idx = order[b : b + 16]
        longest = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), longest), 2, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        # Right padding under a causal mask: the real positions never see it.
        hidden = target.model(input_ids=ids).last_hidden_state
        for r, i in enumerate(idx):
            feats[i] = hidden[r, : len(seqs[i])].clone()
        if b % 800 == 0:
            log(f"features: {b}/{len(order)} in {time.perf_counter() - started:.0f}s")
    torch.save(feats, path)
    return feats  # type: ignore[return-value]


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple:
    """cos, sin [L, head_dim] of the default (rotate-half) rotary embedding."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class FeatureDraft(nn.Module):
    """The draft as trained: engine/spec/proposers/eagle.py's feature_draft_model under the
    names the engine loads, without the target's embedding and head, which training keeps
    frozen outside. Only the attention of depths past the first is its own (`unrolled`): the
    served draft attends through the paged cache instead."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # The target's embedding is not part of the draft: an empty tensor stands in for it.
        self.model = feature_draft_model(config, torch.empty(0, config.hidden_size)).model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.d = config.hidden_size // self.heads

    @property
    def fc(self) -> nn.Linear:
        return self.model.embed_tokens.fc

    @property
    def layer(self) -> LlamaDecoderLayer:
        return self.model.layers[0]

    def state(self) -> dict[str, torch.Tensor]:
        """The weights, bfloat16, under the names engine/spec/proposers/eagle.py loads."""
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}

    @classmethod
    def load(cls, path: str | Path) -> FeatureDraft:
        """A directory write_draft wrote (e.g. models/eagle), as trained (float32)."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        model = cls(AutoConfig.from_pretrained(path))
        weights = load_file(str(Path(path) / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        return model.eval()

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        b, n, _ = h.shape
        attn = self.layer.self_attn
        x = self.layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        q = q * cos + rotate_half(q) * sin
        return q, k * cos + rotate_half(k) * sin, v  # [B, heads, L, d]

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, MLP, final norm: the predicted feature."""
        b, n, _ = h.shape
        h = h + self.layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        h = h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def unrolled(self, emb: torch.Tensor, feats: torch.Tensor, depth: int, theta: float) -> list:
        """Predicted features [B, L, H] per depth 1..depth; depth d's row p predicts the
        target's feature at p from its own path (rows p < d - 1 are meaningless)."""
        b, n, hidden = emb.shape
        cos, sin = rotary(torch.arange(n), self.d, theta)
        prev = torch.cat([feats.new_zeros(b, 1, hidden), feats[:, :-1]], dim=1)
        h = self.model.embed_tokens.mix(emb, prev)
        q, k, v = self.qkv(h, cos, sin)
        keys = [(k, v)]
        outs = [self.finish(h, F.scaled_dot_product_attention(q, k, v, is_causal=True))]
        scale = 1.0 / math.sqrt(self.d)
        for d in range(2, depth + 1):
            prev = torch.cat([feats.new_zeros(b, 1, hidden), outs[-1][:, :-1]], dim=1)
            h = self.model.embed_tokens.mix(emb, prev)
            q, k, v = self.qkv(h, cos, sin)
            keys.append((k, v))
            # Real-feature keys at positions <= p - d + 1; depth j's key at p - (d - j).
            s1 = (q @ keys[0][0].transpose(-1, -2)) * scale
            s1 = s1.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-(d - 1)), -1e4)
            diag, vals = [], []
            for j in range(2, d + 1):
                kj, vj = keys[j - 1]
                shift = d - j
                kj = F.pad(kj, (0, 0, shift, 0))[:, :, :n]
                vj = F.pad(vj, (0, 0, shift, 0))[:, :, :n]
                diag.append((q * kj).sum(-1, keepdim=True) * scale)
                vals.append(vj)
            probs = torch.softmax(torch.cat([s1, *diag], -1).float(), -1).to(q.dtype)
            attn = probs[..., :n] @ keys[0][1]
            for j, vj in enumerate(vals):
                attn = attn + probs[..., n + j : n + j + 1] * vj
            outs.append(self.finish(h, attn))
        return outs


def train(target_dir: str, seqs: list, feats: list, work: Path, head: list[int], args) -> Path:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    weights = load_file(str(Path(target_dir) / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"].float()
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    head_w = lm_head[torch.tensor(head)].to(torch.bfloat16).float()  # the draft's head rows
    theta = config.rope_parameters["rope_theta"]
    torch.manual_seed(args.seed)
    model = FeatureDraft(feature_draft_config(config, args.intermediate))
    ckpt = work / "eagle.pt"
    if args.resume and ckpt.exists():
        model.load_state_dict(torch.load(ckpt))
    with torch.no_grad():  # start near "the feature moves little": fc ~ [0 | I]
        if not args.resume:
            model.fc.weight[:, config.hidden_size :] += torch.eye(config.hidden_size) * 0.5
    n_params = sum(p.numel() for p in model.parameters())
    held = set(range(0, len(seqs), 50))  # 2% held out for the agreement report
    train_ids = [i for i in range(len(seqs)) if i not in held]
    size = f"{n_params / 1e6:.2f}M parameters"
    log(f"train: {len(train_ids)} sequences ({len(held)} held out), {size}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    started = time.perf_counter()
    budget = args.train_minutes * 60
    step = seen = 0
    weights_d = [args.depth_decay**d for d in range(args.depth)]

    def batch(idx: list[int]) -> tuple:
        longest = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), longest), 2, dtype=torch.long)
        f = torch.zeros(len(idx), longest, config.hidden_size, dtype=torch.bfloat16)
        mask = torch.zeros(len(idx), longest, dtype=torch.bool)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            f[r, : len(seqs[i])] = feats[i]
            mask[r, : len(seqs[i])] = True
        return ids, f, mask

    def losses(idx: list[int]) -> tuple[torch.Tensor, list[float]]:
        ids, f, mask = batch(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = model.unrolled(emb[ids], f, args.depth, theta)
            with torch.no_grad():
                target_logp = torch.log_softmax((f[mask].float() @ head_w.T), -1)
                target_p, target_top = target_logp.exp(), target_logp.argmax(-1)
            total, agree = 0.0, []
            for d, g in enumerate(outs):
                valid = mask.clone()
                valid[:, :d] = False  # depth d + 1 starts at position d
                sel = valid[mask]
                logp = torch.log_softmax((g[valid].float() @ head_w.T), -1)
                ce = -(target_p[sel] * logp).sum(-1).mean()
                reg = F.smooth_l1_loss(g[valid].float(), f[valid].float())
                total = total + weights_d[d] * (ce + 0.1 * reg)
                agree.append(float((logp.argmax(-1) == target_top[sel]).float().mean()))
        return total, agree

    agree_sum = [0.0] * args.depth
    count = 0
    while time.perf_counter() - started < budget:
        for idx in length_batches(train_ids, lambda i: len(seqs[i]), args.batch, rng):
            elapsed = time.perf_counter() - started
            if elapsed >= budget:
                break
            lr = warmup_cosine(args.lr, step, elapsed / budget, floor=0.05)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, agree = losses(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            seen += sum(len(seqs[i]) for i in idx)
            agree_sum = [a + b for a, b in zip(agree_sum, agree, strict=True)]
            count += 1
            if step % 25 == 0:
                rate = seen / (time.perf_counter() - started)
                shown = " / ".join(f"{a / count:.3f}" for a in agree_sum)
                log(f"train: step {step}, loss {loss.item():.3f}, agreement by depth {shown}, "
                        f"lr {lr:.2e}, {seen} positions, {rate:.0f}/s")  # fmt: skip
                agree_sum, count = [0.0] * args.depth, 0
            if step % 200 == 0:
                torch.save(model.state_dict(), ckpt)
    torch.save(model.state_dict(), ckpt)
    model.eval()
    with torch.no_grad():
        held_ids = sorted(held)
        sums = [0.0] * args.depth
        for b in range(0, len(held_ids), 16):
            _, agree = losses(held_ids[b : b + 16])
            sums = [s + a for s, a in zip(sums, agree, strict=True)]
        n_b = -(-len(held_ids) // 16)
        held_agree = [round(s / n_b, 4) for s in sums]
    log(f"train: {step} steps, {seen} positions in {time.perf_counter() - started:.0f}s; "
        f"held-out argmax agreement by depth {held_agree}")  # fmt: skip
    this = {"minutes": args.train_minutes, "lr": args.lr, "depth": args.depth, "steps": step,
            "positions": seen, "held_out_agreement_by_depth": held_agree,
            "final_loss": float(loss.item())}  # fmt: skip
    path = work / "eagle_stats.json"
    runs = json.loads(path.read_text())["runs"] if args.resume and path.exists() else []
    stats = {"sequences": len(train_ids), "parameters": n_params, "runs": [*runs, this],
             "positions": sum(r["positions"] for r in [*runs, this])}  # fmt: skip
    path.write_text(json.dumps(stats))
    return ckpt


def write_draft(model: FeatureDraft, out: Path, head: list[int] | None) -> None:
    """The directory engine/spec/proposers/eagle.py loads: bfloat16 weights, the draft's
    config.json (feature_draft_config), head_tokens.json (None: the full head)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state(), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if head is not None:
        (out / HEAD_TOKENS_FILE).write_text(json.dumps({"token_ids": head}))


def save(model_sd: Path, target_dir: str, out: Path, head: list[int], args) -> None:
    from transformers import AutoConfig

    config = feature_draft_config(AutoConfig.from_pretrained(target_dir), args.intermediate)
    model = FeatureDraft(config)
    model.load_state_dict(torch.load(model_sd))
    write_draft(model, out, head)
    write_provenance(out, "train_eagle.py", args, Path(args.work) / "eagle_stats.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", default=str(ROOT / "models" / "eagle"))
    p.add_argument("--work", default="/tmp/tandem-draft-work")
    p.add_argument("--head-from", default=str(ROOT / "models" / "draft" / HEAD_TOKENS_FILE),
                   help="head_tokens.json to reuse (the tokens the target says most)")  # fmt: skip
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--depth", type=int, default=3, help="draft depths unrolled in training")
    p.add_argument("--depth-decay", type=float, default=0.8)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--doc-tokens", type=int, default=150_000)
    p.add_argument("--train-minutes", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="go on from the checkpoint in --work")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    target_dir = str(prepare(args.target))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    answers = generate_answers(target_dir, work, 160, 128, 1, 8)
    tok = AutoTokenizer.from_pretrained(target_dir)
    seqs = sequences(answers, tok, args.doc_tokens, args.seq_len)
    feats = extract_features(target_dir, seqs, work)
    head = json.loads(Path(args.head_from).read_text())["token_ids"]
    ckpt = train(target_dir, seqs, feats, work, head, args)
    save(ckpt, target_dir, Path(args.out), head, args)


if __name__ == "__main__":
    main()
