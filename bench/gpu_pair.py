"""The GPU benchmark's model pair: a Llama target (~190M parameters) and a small draft, both on
the default model's tokenizer (models/draft's, SmolLM2's 49,152 tokens).

  python -m bench.gpu_pair --out bench/gpu_models/trained             # train both on the GPU
  python -m bench.gpu_pair --random --out bench/gpu_models/random     # random weights only
  python -m bench.gpu_pair --tiny --device cpu --out /tmp/pair        # smoke-test scale

Big enough to be memory-bound at batch 1 on a GPU, small enough to train in minutes, on this
machine's Python standard library (bench/prompts.py; the benchmark's prompts come from its
held-out files). The target trains on next-token cross-entropy, then the draft on CE mixed with
distillation from the saved target (bf16 autocast, fused AdamW, batches of 64 x 256 tokens),
each until its wall-clock budget or --epochs, the learning rate following that progress.
`--random` saves random weights (for step times only). Both save bfloat16 safetensors and a
pair.json (what was trained, how long, held-out loss, greedy agreement) for bench.gpu_bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from bench.hf_generate import sync
from bench.prompts import stdlib_corpus
from engine.model.runner import resolve_device, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "models" / "draft"
SEQ_LEN = 256


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


TARGET = ModelShape(hidden=1024, layers=12, heads=16, kv_heads=8, intermediate=2816)
DRAFT = ModelShape(hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536)
TINY_TARGET = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
TINY_DRAFT = ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def sha256_12(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def encode_stream(tok, texts: list[str], eot: int) -> torch.Tensor:
    """The documents as one token stream, each followed by <|endoftext|>."""
    out: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        out += [*enc.ids, eot]
    return torch.tensor(out, dtype=torch.int32)


def build_model(shape: ModelShape, vocab: int, eot: int, im_end: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    model = LlamaForCausalLM(config)
    # <|im_end|> ends an assistant turn, so generation stops on it as well as on EOT.
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eot, im_end], pad_token_id=eot
    )
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # the tied embedding counted once


def batches(stream: torch.Tensor, seed: int, batch_size: int) -> Iterator[torch.Tensor]:
    """[batch_size, SEQ_LEN + 1] windows: shuffled non-overlapping chunks, epoch after epoch,
    each epoch from a fresh random offset so chunk boundaries differ."""
    gen = torch.Generator().manual_seed(seed)
    span = SEQ_LEN + 1
    while True:
        offset = int(torch.randint(0, span, (1,), generator=gen))
        n = (len(stream) - offset) // span
        chunks = stream[offset : offset + n * span].view(n, span)
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            yield chunks[order[i : i + batch_size]].long()


def lr_at(step: int, progress: float, peak: float, warmup_steps: int) -> float:
    """Linear warm-up by steps, then cosine decay to 10% of peak by progress."""
    warm = min(1.0, (step + 1) / warmup_steps)
    return peak * warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def ce_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def distill_loss(teacher: torch.nn.Module, kl_weight: float) -> Callable:
    """(1 - kl_weight) x CE + kl_weight x KL(teacher || student)."""

    def loss_fn(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        logp = F.log_softmax(student(input_ids=inputs).logits.float(), dim=-1)
        vocab = logp.size(-1)
        ce = F.nll_loss(logp.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        kl = F.kl_div(
            logp.reshape(-1, vocab), teacher_logp.reshape(-1, vocab), log_target=True,
            reduction="batchmean",
        )  # fmt: skip
        return (1.0 - kl_weight) * ce + kl_weight * kl

    return loss_fn


def save_member(model: torch.nn.Module, tok, out_dir: Path) -> torch.nn.Module:
    """Save in bfloat16 with the tokenizer; return the saved weights reloaded in float32."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def heldout_windows(stream: torch.Tensor, count: int) -> torch.Tensor:
    """About `count` non-overlapping SEQ_LEN + 1 windows, evenly spread over `stream`."""
    span = SEQ_LEN + 1
    n = len(stream) // span
    chunks = stream[: n * span].view(n, span)
    return chunks[torch.linspace(0, n - 1, steps=min(count, n)).round().long().unique()].long()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    total = 0.0
    for i in range(0, len(windows), 16):
        batch = windows[i : i + 16]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return total / (len(windows) * SEQ_LEN)


def heldout_prompts(stream: torch.Tensor, count: int, length: int, eot: int) -> torch.Tensor:
    """Evenly spaced prompts that stay within one document (no <|endoftext|> inside)."""
    prompts = []
    for start in torch.linspace(0, len(stream) - 2 * length, steps=count * 4).long().tolist():
        window = stream[start : start + length].long()
        if not (window == eot).any():
            prompts.append(window)
        if len(prompts) == count:
            break
    return torch.stack(prompts)


@torch.no_grad()
def acceptance_stats(target, draft, prompts: torch.Tensor, new_tokens: int, k: int) -> dict:
    """How often the draft's argmax is the target's greedy token, and the tokens a greedy
    chain of up to k drafts would make per verifying pass on those answers."""
    seqs = target.generate(
        prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    plen = prompts.size(1)
    match = draft(input_ids=seqs[:, :-1]).logits[:, plen - 1 :].argmax(-1) == seqs[:, plen:]
    lengths = []
    for row in match.tolist():
        pos = 0
        while pos < len(row):  # the run of leading matches, then the target's own token
            n = 0
            while n < k and pos + n < len(row) and row[pos + n]:
                n += 1
            lengths.append(n)
            pos += n + 1
    mean = sum(lengths) / len(lengths)
    return {"match_rate": match.float().mean().item(), "mean_accepted": mean,
            "tokens_per_step": mean + 1.0, "steps": float(len(lengths))}  # fmt: skip


def train(
    name: str,
    model: torch.nn.Module,
    data: Iterator[torch.Tensor],
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    args: argparse.Namespace,
    budget_s: float,
    max_tokens: int,
    peak_lr: float,
) -> dict:
    """Train until `budget_s` seconds or `max_tokens` tokens, whichever comes first."""
    device = args.device
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    # bf16 autocast on the GPU only: CPU runs are smoke tests, where fp32 is simpler.
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    step, tokens, loss = 0, 0, torch.zeros(())
    sync(device)
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        progress = max(elapsed / budget_s, tokens / max_tokens)
        if progress >= 1 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(step, progress, peak_lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(data).to(device, non_blocking=True)
        with autocast:
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        if step % args.log_every == 0:  # .item() waits for the GPU: not every step
            elapsed = time.monotonic() - start
            log(
                f"{name} step {step} loss {loss.item():.4f} lr {lr:.2e} {elapsed:.0f}/"
                f"{budget_s:.0f} s, {tokens / max_tokens:.2f} of the token cap, "
                f"{tokens / elapsed:,.0f} tok/s"
            )
    sync(device)
    seconds = time.monotonic() - start
    model.eval()
    final = loss.item() if step else math.nan
    log(f"{name}: {step} steps, {tokens:,} tokens in {seconds:.1f} s, last loss {final:.4f}")
    return {"steps": step, "tokens": tokens, "seconds": seconds, "final_loss": final}


def load_saved(model_dir: Path, device: torch.device) -> torch.nn.Module:
    """The saved weights in the dtype the benchmark runs them in (bf16 on CUDA, else fp32)."""
    dtype = resolve_dtype("auto", device)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def evaluate(out: Path, heldout_stream: torch.Tensor, eot: int, args: argparse.Namespace) -> dict:
    """Held-out CE of both saved models and the draft's greedy agreement with the target."""
    target = load_saved(out / "target", args.device)
    draft = load_saved(out / "draft", args.device)
    windows = heldout_windows(heldout_stream, args.eval_windows).to(args.device)
    prompts = heldout_prompts(heldout_stream, args.eval_prompts, 64, eot)
    k = 4
    acc = acceptance_stats(target, draft, prompts.to(args.device), 64, k)
    return {
        "target_ce": heldout_loss(target, windows),
        "draft_ce": heldout_loss(draft, windows),
        "eval_windows": len(windows),
        "agreement_prompts": len(prompts),
        "agreement_k": k,
        **acc,
    }


def build_pair(args: argparse.Namespace, tok) -> tuple[torch.nn.Module, torch.nn.Module]:
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    # Initialised on the CPU from the seed, so --random weights are the same on every run.
    torch.manual_seed(args.seed)
    target = build_model(args.target_shape, len(tok), eot, im_end)
    torch.manual_seed(args.seed + 1)
    draft = build_model(args.draft_shape, len(tok), eot, im_end)
    return target, draft


def make_pair(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    out: Path = args.out
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    target, draft = build_pair(args, tok)
    info: dict = {
        "mode": "random" if args.random else "trained",
        "tiny": args.tiny,
        "seed": args.seed,
        "device": str(args.device),
        "saved_dtype": "bfloat16",
        "target_shape": dataclasses.asdict(args.target_shape),
        "draft_shape": dataclasses.asdict(args.draft_shape),
        "target_params": count_params(target),
        "draft_params": count_params(draft),
    }
    log(f"target {info['target_params']:,} parameters, draft {info['draft_params']:,}")
    if args.random:
        save_member(target, tok, out / "target")
        save_member(draft, tok, out / "draft")
    else:
        info |= train_pair(args, tok, target, draft)
    info["target_sha256"] = sha256_12(out / "target" / "model.safetensors")
    info["draft_sha256"] = sha256_12(out / "draft" / "model.safetensors")
    info["pair_id"] = f"{info['target_sha256']}-{info['draft_sha256']}"
    info["seconds"] = time.monotonic() - started
    return info


def train_pair(args: argparse.Namespace, tok, target, draft) -> dict:
    train_texts, heldout_texts = stdlib_corpus(args.max_chars)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    train_stream = encode_stream(tok, train_texts, eot)
    heldout_stream = encode_stream(tok, heldout_texts, eot)
    log(f"stdlib: {len(train_stream):,} train, {len(heldout_stream):,} held-out tokens")
    cap = int(args.epochs * len(train_stream))
    data = batches(train_stream, args.seed, args.batch_size)
    target_lr, draft_lr = args.lrs
    target_stats = train("target", target, data, ce_loss, args, args.target_s, cap, target_lr)
    # Distil from exactly what the benchmark loads: the bf16-rounded saved target.
    teacher = save_member(target, tok, args.out / "target").to(args.device)
    teacher.requires_grad_(False)
    data = batches(train_stream, args.seed + 1, args.batch_size)
    distill = distill_loss(teacher, 0.7)
    draft_stats = train("draft", draft, data, distill, args, args.draft_s, cap, draft_lr)
    save_member(draft, tok, args.out / "draft")
    del teacher
    evaluation = evaluate(args.out, heldout_stream, eot, args)
    log(
        f"held-out CE target {evaluation['target_ce']:.3f}, draft {evaluation['draft_ce']:.3f}; "
        f"greedy match rate {evaluation['match_rate']:.3f}"
    )
    return {
        "corpus": {
            "python": sys.version.split()[0],
            "max_chars": args.max_chars,
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
        },
        "batch": [args.batch_size, SEQ_LEN],
        "epochs_cap": args.epochs,
        "target_training": target_stats | {"budget_s": args.target_s, "peak_lr": target_lr},
        "draft_training": draft_stats
        | {"budget_s": args.draft_s, "peak_lr": draft_lr, "objective": "0.3 CE + 0.7 KL"},
        "eval": evaluation,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="gets target/, draft/, pair.json")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--random", action="store_true", help="save random weights, no training")
    p.add_argument("--tiny", action="store_true", help="tiny models and budgets (CPU smoke test)")
    p.add_argument("--target-s", type=float, help="target budget, seconds (default 150)")
    p.add_argument("--draft-s", type=float, help="draft budget, seconds (default 60)")
    p.add_argument("--epochs", type=float, default=4.0, help="cap: passes over the train split")
    p.add_argument("--max-steps", type=int, default=0, help="cap per model (0 = none)")
    p.add_argument("--batch-size", type=int, help="sequences of 256 tokens (default 64)")
    p.add_argument("--max-chars", type=int, help="corpus cap in characters")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    tiny = args.tiny
    args.target_shape, args.draft_shape = (TINY_TARGET, TINY_DRAFT) if tiny else (TARGET, DRAFT)
    defaults = {"target_s": 60.0 if tiny else 150.0, "draft_s": 60.0,
                "batch_size": 4 if tiny else 64, "max_chars": 1_000_000 if tiny else 64_000_000}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup, args.log_every = (2, 5) if tiny else (30, 50)
    # Tiny models learn little in a few steps at the real rates; greedy checks on them need
    # logits far from uniform.
    args.lrs = (1e-2, 1e-2) if tiny else (6e-4, 2e-3)
    args.eval_windows, args.eval_prompts = (4, 2) if tiny else (128, 32)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.gpu_pair " + " ".join(sys.argv[1:] if argv is None else argv)
    log(f"{command} on {args.device}")
    info = make_pair(args)
    info["command"] = command
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(args.device)
    (args.out / "pair.json").write_text(json.dumps(info, indent=1))
    log(f"wrote {args.out / 'pair.json'} ({info['seconds']:.0f} s in all)")
    return info


if __name__ == "__main__":
    main()
