"""The GPU benchmark's model pair: a ~146M-parameter Llama target and a ~9M draft.

  python -m bench.gpu_pair --out bench/gpu_models/trained             # train both on the GPU
  python -m bench.gpu_pair --random --out bench/gpu_models/random     # random weights only
  python -m bench.gpu_pair --tiny --device cpu --out /tmp/pair        # smoke-test scale

Big enough that a GPU reading the target's weights is memory-bound at batch 1, small
enough to train in minutes. Same corpus and tokenizer as the default pair: the corpus is
built by scripts/train_toy_pair.py's own functions (this machine's Python standard
library, split train / held-out by a hash of each file's path, so bench/prompts.py draws
its prompts from the held-out files here too), and the tokenizer is the one shipped in
bench/toy_pair/target. The target trains on next-token cross-entropy, then the draft on CE mixed
with distillation from the saved target, both under bf16 autocast with fused AdamW on
batches of 64 x 256 tokens. Each stops at its wall-clock budget or after --epochs passes
over the training tokens, whichever comes first; the learning rate follows that progress.
`--random` saves random weights of the same architectures, for step-time figures only
(a random draft is never accepted). Both save bfloat16 safetensors and a pair.json (what
was trained, how long, held-out loss, greedy agreement) that bench.gpu_bench records.
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
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.prompts import training_module
from engine.model.runner import resolve_device, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
T = training_module()  # scripts/train_toy_pair.py
TARGET = T.ModelShape(hidden=1024, layers=12, heads=16, kv_heads=8, intermediate=2816)
DRAFT = T.ModelShape(hidden=576, layers=2, heads=9, kv_heads=3, intermediate=1536)
# Llama-3.2-1B's body (hidden 2048, 16 layers, 32 / 8 heads, MLP 8192) with the toy vocabulary:
# ~1B parameters, 2 GB in bf16, so that a batch-1 pass on a datacentre GPU is bound by
# reading the weights rather than by launching kernels. --random only: it is for step times.
TARGET_1B = T.ModelShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192)
TINY_TARGET = T.ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
TINY_DRAFT = T.ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sha256_12(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


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
        lr = T.lr_at(step, progress, peak_lr, args.warmup)
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
    windows = T.heldout_windows(heldout_stream, args.eval_windows).to(args.device)
    prompts = T.heldout_prompts(heldout_stream, args.eval_prompts, 64, eot)
    k = 4
    acc = T.acceptance_stats(target, draft, prompts.to(args.device), 64, k)
    return {
        "target_ce": T.heldout_loss(target, windows),
        "draft_ce": T.heldout_loss(draft, windows),
        "eval_windows": len(windows),
        "agreement_prompts": len(prompts),
        "agreement_k": k,
        **acc,
    }


def build_pair(args: argparse.Namespace, tok) -> tuple[torch.nn.Module, torch.nn.Module]:
    eot, im_end = tok.convert_tokens_to_ids(T.EOT), tok.convert_tokens_to_ids(T.IM_END)
    # Initialised on the CPU from the seed, so --random weights are the same on every run.
    torch.manual_seed(args.seed)
    target = T.build_model(args.target_shape, eot, im_end)
    torch.manual_seed(args.seed + 1)
    draft = T.build_model(args.draft_shape, eot, im_end)
    return target, draft


def make_pair(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    out: Path = args.out
    tok = AutoTokenizer.from_pretrained(ROOT / "bench" / "toy_pair" / "target")
    target, draft = build_pair(args, tok)
    info: dict = {
        "mode": "random" if args.random else "trained",
        "tiny": args.tiny,
        "seed": args.seed,
        "device": str(args.device),
        "saved_dtype": "bfloat16",
        "target_shape": dataclasses.asdict(args.target_shape),
        "draft_shape": dataclasses.asdict(args.draft_shape),
        "target_params": T.count_params(target),
        "draft_params": T.count_params(draft),
    }
    log(f"target {info['target_params']:,} parameters, draft {info['draft_params']:,}")
    if args.random:
        T.save_pair_member(target, tok, out / "target")
        T.save_pair_member(draft, tok, out / "draft")
    else:
        info |= train_pair(args, tok, target, draft)
    info["target_sha256"] = sha256_12(out / "target" / "model.safetensors")
    info["draft_sha256"] = sha256_12(out / "draft" / "model.safetensors")
    info["pair_id"] = f"{info['target_sha256']}-{info['draft_sha256']}"
    info["seconds"] = time.monotonic() - started
    return info


def train_pair(args: argparse.Namespace, tok, target, draft) -> dict:
    corpus = T.collect_corpus(args.max_chars)
    train_stream = T.encode_stream(tok, corpus.train_texts)
    heldout_stream = T.encode_stream(tok, corpus.heldout_texts)
    log(f"{corpus.root}: {len(train_stream):,} train, {len(heldout_stream):,} held-out tokens")
    cap = int(args.epochs * len(train_stream))
    data = T.batches(train_stream, args.seed, args.batch_size)
    target_lr, draft_lr = args.lrs
    target_stats = train("target", target, data, T.ce_loss, args, args.target_s, cap, target_lr)
    # Distil from exactly what the benchmark loads: the bf16-rounded saved target.
    teacher = T.save_pair_member(target, tok, args.out / "target").to(args.device)
    teacher.requires_grad_(False)
    data = T.batches(train_stream, args.seed + 1, args.batch_size)
    distill = T.make_distill_loss(teacher, 0.7)
    draft_stats = train("draft", draft, data, distill, args, args.draft_s, cap, draft_lr)
    T.save_pair_member(draft, tok, args.out / "draft")
    del teacher
    evaluation = evaluate(args.out, heldout_stream, tok.eos_token_id, args)
    log(
        f"held-out CE target {evaluation['target_ce']:.3f}, draft {evaluation['draft_ce']:.3f}; "
        f"greedy match rate {evaluation['match_rate']:.3f}"
    )
    return {
        "corpus": {
            "python": sys.version.split()[0],
            "root": str(corpus.root),
            "max_chars": args.max_chars,
            "train_files": len(corpus.train_files),
            "heldout_files": len(corpus.heldout_files),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
        },
        "batch": [args.batch_size, T.SEQ_LEN],
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
    p.add_argument(
        "--target-shape",
        choices=["bench", "1b"],
        default="bench",
        help="bench = the 146M target; 1b = Llama-3.2-1B's body (with --random only)",
    )
    args = p.parse_args(argv)
    if args.target_shape == "1b" and not args.random:
        p.error("--target-shape 1b is for step times: use it with --random")
    args.device = resolve_device(args.device)
    tiny = args.tiny
    big = TARGET_1B if args.target_shape == "1b" else TARGET
    args.target_shape, args.draft_shape = (TINY_TARGET, TINY_DRAFT) if tiny else (big, DRAFT)
    defaults = {
        "target_s": 10.0 if tiny else 150.0,
        "draft_s": 5.0 if tiny else 60.0,
        "batch_size": 4 if tiny else 64,
        "max_chars": 1_000_000 if tiny else 64_000_000,
    }
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
