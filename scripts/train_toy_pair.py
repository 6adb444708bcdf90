#!/usr/bin/env python
"""Train Tandem's embedded default model pair (target + draft) from scratch on CPU.

The pair is deliberately small so that it ships inside the repository and runs anywhere, yet the
target is ~16x larger than the draft so speculative decoding has something to gain on CPU.

Pipeline:
  1. Corpus: the local Python standard library's ``.py`` sources, split train/held-out by a hash of
     each file's relative path (stable across machines with the same Python version).
  2. Tokenizer: byte-level BPE (4096 tokens) with ChatML special tokens and chat template.
  3. Target: LlamaForCausalLM (~26M params) trained on next-token cross-entropy.
  4. Draft: LlamaForCausalLM (~1.6M params) trained on CE mixed with distillation (KL to the
     frozen target), which raises how often its argmax agrees with the target's.
  5. Both are saved as bfloat16 safetensors, reloaded in float32 and evaluated (held-out loss,
     greedy draft/target agreement, speculative acceptance length); results go to README.md.

Training is bounded by wall-clock budgets rather than step counts so the script finishes in a
predictable time on a shared 2-core machine; the LR schedule follows wall-clock progress so it
has fully decayed when the budget runs out regardless of how fast the machine happened to be.

Usage:
  python scripts/train_toy_pair.py --out bench/toy_pair      # full run (~1 hour on 2 cores)
  python scripts/train_toy_pair.py --quick                 # ~1-2 minute smoke test to a tmp dir
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2.
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
VOCAB_SIZE = 4096
SEQ_LEN = 256
MAX_POSITIONS = 1024
BATCH_SIZE = 8  # 8 x 256 tokens per step: many small steps beat few big ones on a short budget.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Directories of the stdlib that are not representative library code (or are huge test suites).
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
HELDOUT_PERCENT = 5
SAMPLE_PROMPT = "def fibonacci(n):\n"
SAMPLE_NEW_TOKENS = 96


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


TARGET_SHAPE = ModelShape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408)
DRAFT_SHAPE = ModelShape(hidden=192, layers=2, heads=6, kv_heads=2, intermediate=512)


@dataclasses.dataclass
class Corpus:
    root: Path
    train_files: list[str]
    heldout_files: list[str]
    train_texts: list[str]
    heldout_texts: list[str]

    @property
    def train_chars(self) -> int:
        return sum(len(t) for t in self.train_texts)

    @property
    def heldout_chars(self) -> int:
        return sum(len(t) for t in self.heldout_texts)


@dataclasses.dataclass
class TrainStats:
    steps: int
    tokens: int
    seconds: float
    final_loss: float


def log(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


def adapt_threads(max_threads: int) -> int:
    """Use one intra-op thread while other processes keep the CPUs busy, else `max_threads`.

    torch's OpenMP threads synchronise at every op. On a shared machine (and at nice 15) one of
    them is often descheduled and the other then waits, which measured up to ~2x slower than a
    single thread; when the machine is idle, two threads are ~2x faster. The 1-minute load
    average minus our own threads estimates the competing load.
    """
    current = torch.get_num_threads()
    others = os.getloadavg()[0] - current
    wanted = 1 if others > 0.5 else max_threads
    if wanted != current:
        torch.set_num_threads(wanted)
        log(f"load average {others + current:.1f}: using {wanted} thread(s)")
    return wanted


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------


def is_heldout(rel_path: str) -> bool:
    # Hash of the path, not a random draw: the split must not depend on seed or file order.
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < HELDOUT_PERCENT


def collect_corpus(max_chars: int) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    corpus = Corpus(root=root, train_files=[], heldout_files=[], train_texts=[], heldout_texts=[])
    total = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are deliberately not UTF-8
        if not text.strip():
            continue
        if total + len(text) > max_chars:
            break  # deterministic cap: sorted order, first files that fit
        total += len(text)
        rel = path.relative_to(root).as_posix()
        if is_heldout(rel):
            corpus.heldout_files.append(rel)
            corpus.heldout_texts.append(text)
        else:
            corpus.train_files.append(rel)
            corpus.train_texts.append(text)
    return corpus


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    # add_prefix_space=False and no normalizer keep decode(encode(x)) == x byte-for-byte.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok: PreTrainedTokenizerFast, model_dir: Path) -> None:
    tok.save_pretrained(model_dir)
    # transformers 5 records its internal class name ("TokenizersBackend"); the public alias
    # loads identically there and is also understood by older transformers releases.
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def check_tokenizer(model_dir: Path, heldout_sample: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == EOT and tok.pad_token == EOT, (tok.eos_token, tok.pad_token)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    samples = [
        "héllo ✓ 日本",
        "def f(x):\n\treturn  x  \n\n  # trailing   \r\n",
        f"{IM_START}user\nhi{IM_END}\n",
        heldout_sample[:2000],
    ]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, f"round trip failed for {text[:40]!r}"
    # No BOS or other prefix is added by encode().
    assert tok.encode("x") == tok.encode("x", add_special_tokens=False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered == expected, repr(rendered)
    # Each ChatML marker must be a single token, otherwise stop detection on <|im_end|> fails.
    assert tok.encode(IM_END, add_special_tokens=False) == [2]


def encode_stream(tok: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenate documents into one token stream, each followed by <|endoftext|>."""
    eot = tok.eos_token_id
    out: list[int] = []
    # The raw `tokenizers` backend: whole files exceed model_max_length, which is fine here
    # (we cut the stream into SEQ_LEN windows) but makes the transformers wrapper warn.
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return torch.tensor(out, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# Models and training
# --------------------------------------------------------------------------------------------


def build_model(shape: ModelShape, eot_id: int, im_end_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    model = LlamaForCausalLM(config)
    # <|im_end|> ends an assistant turn, so generation must stop on it as well as on EOT.
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eot_id, im_end_id], pad_token_id=eot_id
    )
    return model


def count_params(model: torch.nn.Module) -> int:
    # parameters() de-duplicates the tied embedding / lm_head weight.
    return sum(p.numel() for p in model.parameters())


def batches(
    stream: torch.Tensor, seed: int, batch_size: int = BATCH_SIZE
) -> Iterator[torch.Tensor]:
    """Yield [batch_size, SEQ_LEN + 1] windows, shuffled non-overlapping chunks, epoch after epoch.

    Each epoch uses a fresh random offset so chunk boundaries differ between epochs.
    """
    gen = torch.Generator().manual_seed(seed)
    span = SEQ_LEN + 1
    while True:
        offset = int(torch.randint(0, span, (1,), generator=gen))
        n_chunks = (len(stream) - offset) // span
        chunks = stream[offset : offset + n_chunks * span].view(n_chunks, span)
        order = torch.randperm(n_chunks, generator=gen)
        for i in range(0, n_chunks - batch_size + 1, batch_size):
            yield chunks[order[i : i + batch_size]].long()


def lr_at(step: int, progress: float, peak: float, warmup_steps: int) -> float:
    """Linear warmup by steps, then cosine decay to 10% of peak by wall-clock progress."""
    warm = min(1.0, (step + 1) / warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * warm * (0.1 + 0.9 * cosine)


LossFn = Callable[[LlamaForCausalLM, torch.Tensor], torch.Tensor]


def ce_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def make_distill_loss(teacher: LlamaForCausalLM, kl_weight: float) -> LossFn:
    def loss_fn(student: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            # bf16 teacher inference is ~3x faster on CPUs with AMX/AVX512-BF16, and the
            # shipped target weights are bf16 anyway, so the soft labels match what we ship.
            teacher_logits = teacher(input_ids=inputs).logits
        teacher_logp = F.log_softmax(teacher_logits.float(), dim=-1).reshape(-1, VOCAB_SIZE)
        logits = student(input_ids=inputs).logits.reshape(-1, VOCAB_SIZE)
        student_logp = F.log_softmax(logits, dim=-1)
        ce = F.nll_loss(student_logp, batch[:, 1:].reshape(-1))
        kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")
        return (1.0 - kl_weight) * ce + kl_weight * kl

    return loss_fn


def train_time_bounded(
    name: str,
    model: LlamaForCausalLM,
    data: Iterator[torch.Tensor],
    loss_fn: LossFn,
    budget_s: float,
    peak_lr: float,
    warmup_steps: int,
    log_every: int,
    max_threads: int,
) -> TrainStats:
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains: no weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    start = time.monotonic()
    step = 0
    last_step_s = 0.0
    ema_loss = float("nan")
    while True:
        elapsed = time.monotonic() - start
        # Stop if the next step would overrun the budget (estimated from the previous step).
        if elapsed + last_step_s > budget_s:
            break
        lr = lr_at(step, elapsed / budget_s, peak_lr, warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        if step % 10 == 0:
            adapt_threads(max_threads)
        t0 = time.monotonic()
        loss = loss_fn(model, next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_step_s = time.monotonic() - t0
        value = loss.item()
        ema_loss = value if math.isnan(ema_loss) else 0.95 * ema_loss + 0.05 * value
        step += 1
        if step % log_every == 0 or step == 1:
            elapsed = time.monotonic() - start
            tok_s = step * BATCH_SIZE * SEQ_LEN / elapsed
            log(
                f"{name} step {step:5d} loss {value:.4f} (ema {ema_loss:.4f}) lr {lr:.2e} "
                f"{elapsed / 60:5.1f}/{budget_s / 60:.1f} min {tok_s:,.0f} tok/s "
                f"{torch.get_num_threads()} thread(s)"
            )
    seconds = time.monotonic() - start
    log(f"{name}: budget reached after {step} steps ({seconds / 60:.1f} min), ema {ema_loss:.4f}")
    model.eval()
    return TrainStats(step, step * BATCH_SIZE * SEQ_LEN, seconds, ema_loss)


def save_pair_member(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out_dir: Path
) -> LlamaForCausalLM:
    """Save in bfloat16 (halves the repo footprint) and reload in float32 as users will.

    `model` is left in bfloat16; callers continue with the returned float32 copy.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    save_tokenizer(tok, out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    reloaded.eval()
    return reloaded


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def heldout_windows(stream: torch.Tensor, count: int) -> torch.Tensor:
    """A fixed subset of non-overlapping SEQ_LEN+1 windows, evenly spread over the held-out set."""
    span = SEQ_LEN + 1
    n_chunks = len(stream) // span
    chunks = stream[: n_chunks * span].view(n_chunks, span)
    idx = torch.linspace(0, n_chunks - 1, steps=min(count, n_chunks)).round().long().unique()
    return chunks[idx].long()


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    total, count = 0.0, 0
    for i in range(0, len(windows), 16):
        batch = windows[i : i + 16]
        logits = model(input_ids=batch[:, :-1]).logits
        targets = batch[:, 1:]
        total += F.cross_entropy(
            logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    return total / count


def heldout_prompts(stream: torch.Tensor, count: int, length: int, eot_id: int) -> torch.Tensor:
    """Evenly spaced prompts that stay within one document (no <|endoftext|> inside)."""
    candidates = torch.linspace(0, len(stream) - 2 * length, steps=count * 4).long().tolist()
    prompts: list[torch.Tensor] = []
    for start in candidates:
        window = stream[start : start + length].long()
        if (window == eot_id).any():
            continue
        prompts.append(window)
        if len(prompts) == count:
            break
    return torch.stack(prompts)


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Plain batched greedy decoding with a KV cache; never stops early (fixed-length output)."""
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    return torch.cat([prompts, *generated], dim=1)


def accepted_lengths(matches: list[bool], k: int) -> list[int]:
    """Simulate greedy speculative decoding over one match sequence.

    Each step the draft proposes up to k tokens; the run of leading matches is accepted and the
    target then contributes one token of its own (the correction, or the bonus token after k).
    """
    lengths = []
    pos = 0
    while pos < len(matches):
        accepted = 0
        while accepted < k and pos + accepted < len(matches) and matches[pos + accepted]:
            accepted += 1
        lengths.append(accepted)
        pos += accepted + 1
    return lengths


@torch.no_grad()
def acceptance_stats(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    prompts: torch.Tensor,
    new_tokens: int,
    k: int,
) -> dict[str, float]:
    seqs = greedy_generate(target, prompts, new_tokens)
    plen = prompts.size(1)
    # Draft's argmax given exactly the target's prefix, at every generated position.
    draft_pred = draft(input_ids=seqs[:, :-1]).logits[:, plen - 1 :].argmax(-1)
    match = draft_pred == seqs[:, plen:]
    lengths = [n for row in match.tolist() for n in accepted_lengths(row, k)]
    rate = match.float().mean().item()
    mean_accepted = sum(lengths) / len(lengths)
    return {
        "match_rate": rate,
        "mean_accepted": mean_accepted,
        "tokens_per_step": mean_accepted + 1.0,
        # What an i.i.d. per-token acceptance rate alone would predict, for comparison.
        "iid_tokens_per_step": (1 - rate ** (k + 1)) / (1 - rate) if rate < 1 else k + 1.0,
        "steps": float(len(lengths)),
    }


@torch.no_grad()
def decode_latency_ms(model: LlamaForCausalLM, context: torch.Tensor, rounds: int = 5) -> float:
    """Batch-1 per-token decode latency with a KV cache, after prefilling `context`.

    Best of several short rounds: the machine is shared, and the minimum is the least
    contaminated by other processes.
    """
    best = float("inf")
    for _ in range(rounds):
        out = model(input_ids=context[None], use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(16):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        best = min(best, (time.perf_counter() - t0) / 16 * 1000)
    return best


@torch.no_grad()
def sample_completion(model_dir: Path, model: LlamaForCausalLM, prompt: str) -> str:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def arch_row(name: str, shape: ModelShape, params: int) -> str:
    return (
        f"| {name} | {params:,} | {shape.hidden} | {shape.layers} | {shape.heads} | "
        f"{shape.kv_heads} | {shape.intermediate} |"
    )


def write_readme(out: Path, r: dict) -> None:
    tgt: TrainStats = r["target_stats"]
    drf: TrainStats = r["draft_stats"]
    acc = r["acceptance"]
    kl = r["kl_weight"]
    sample = r["sample"].replace("```", "` ` `")  # keep the fenced block intact
    prompt = SAMPLE_PROMPT.encode("unicode_escape").decode()
    versions = (
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"
    )
    train_rows = "\n".join(
        f"| {name} | {objective} | {lr:g} | {minutes:g} min | {s.steps:,} | {s.tokens:,} | "
        f"{s.seconds / 60:.1f} min |"
        for name, objective, lr, minutes, s in [
            ("target", "CE", r["target_lr"], r["target_minutes"], tgt),
            ("draft", f"{1 - kl:.1f} CE + {kl:.1f} KL", r["draft_lr"], r["draft_minutes"], drf),
        ]
    )
    loss_rows = "\n".join(
        f"| {name} | {ce:.4f} | {math.exp(ce):.2f} |"
        for name, ce in [("target", r["target_ce"]), ("draft", r["draft_ce"])]
    )
    total_mb = r["target_mb"] + r["draft_mb"]
    # Markdown joins wrapped lines, so the template is wrapped for the source, not the output.
    text = f"""# The toy pair

`target/` and `draft/` are the toy pair Tandem served by default before it shipped a real
model; the CPU-kernel, peer and GPU benchmarks still use them. Both are
`LlamaForCausalLM` checkpoints (bfloat16 safetensors) sharing one tokenizer, trained from scratch
on CPU by `scripts/train_toy_pair.py`. They are a toy pair: they continue
Python-standard-library-style code rather than answer chats, but they are a genuine target/draft
pair (the draft was distilled from the target) for exercising speculative decoding.

## Provenance

- Command (from the repository root): `{r["command"]}`
- Resolved arguments: `{r["resolved_args"]}`
- Date (UTC): {r["date"]}
- Machine: {r["cpu"]}, {r["cores"]} CPU cores, no GPU; torch used up to {r["threads"]} threads
  (1 while other processes kept the CPUs busy, see `adapt_threads`)
- Software: {versions}

## Corpus

The `.py` files of this machine's Python {platform.python_version()} standard library
(`{r["corpus_root"]}`), excluding `site-packages`, `test`/`tests`, `idlelib` and `lib2to3`
directories and files that are not UTF-8. Files are taken in sorted path order (capped at
{r["max_chars"]:,} characters); a file is held out when the SHA-256 of its relative path falls in
the bottom {HELDOUT_PERCENT}%. Each file is followed by `<|endoftext|>` in the token stream.

| split | files | characters | tokens |
|---|---:|---:|---:|
| train | {r["train_files"]:,} | {r["train_chars"]:,} | {r["train_tokens"]:,} |
| held-out | {r["heldout_files"]:,} | {r["heldout_chars"]:,} | {r["heldout_tokens"]:,} |

## Tokenizer

Byte-level BPE trained with `tokenizers` on the train split: vocabulary {VOCAB_SIZE}, ByteLevel
pre-tokenizer and decoder, no normalizer, so decoding reproduces any UTF-8 text exactly. Special
tokens: `<|endoftext|>` (id 0: EOS and padding; no BOS is prepended), `<|im_start|>` (id 1),
`<|im_end|>` (id 2). The chat template is ChatML: `<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n`
per message, plus `<|im_start|>assistant\\n` when `add_generation_prompt` is set. `config.json`
has `eos_token_id` 0; `generation_config.json` lists `[0, 2]`, so generation also stops at
`<|im_end|>`.

## Architectures

Llama: RoPE (theta 10000), RMSNorm, SwiGLU MLP, grouped-query attention, tied input/output
embeddings, vocabulary {VOCAB_SIZE}, {MAX_POSITIONS} max positions.

| model | parameters | hidden | layers | heads | KV heads | MLP |
|---|---:|---:|---:|---:|---:|---:|
{arch_row("target", TARGET_SHAPE, r["target_params"])}
{arch_row("draft", DRAFT_SHAPE, r["draft_params"])}

The target has {r["target_params"] / r["draft_params"]:.1f}x the draft's parameters. On disk
(including tokenizer files): target {r["target_mb"]:.1f} MB, draft {r["draft_mb"]:.1f} MB, total
{total_mb:.1f} MB.

## Training

fp32 on CPU, seed {r["seed"]}; AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only),
gradient clipping 1.0, batches of {BATCH_SIZE} x {SEQ_LEN} tokens. The LR warms up linearly for
{r["warmup"]} steps, then follows a cosine to 10% of peak over the wall-clock budget; training
stops when the budget is spent, so step counts depend on machine speed. The draft's loss mixes
next-token CE with KL(target ‖ draft) against the frozen, bf16-rounded target.

| model | objective | peak LR | budget | steps | tokens | time |
|---|---|---:|---:|---:|---:|---:|
{train_rows}

## Evaluation

All numbers come from the saved bfloat16 weights reloaded in float32.

Held-out cross-entropy on a fixed subset of {r["eval_windows"]} windows of {SEQ_LEN + 1} tokens
({r["eval_tokens"]:,} predicted tokens):

| model | CE (nats/token) | perplexity |
|---|---:|---:|
{loss_rows}

Greedy agreement: for {r["n_prompts"]} held-out prompts of {r["prompt_len"]} tokens, the target
generated {r["new_tokens"]} tokens greedily, and at each position the draft's argmax given the
same prefix was compared with the target's token.

- Per-token match rate: **{acc["match_rate"]:.3f}**
- Greedy speculative decoding with K={r["k"]}, simulated on those match sequences:
  **{acc["mean_accepted"]:.2f}** draft tokens accepted per step on average, i.e.
  {acc["tokens_per_step"]:.2f} tokens per target forward pass (an i.i.d. model with the same
  match rate would predict {acc["iid_tokens_per_step"]:.2f}).
- Batch-1 decode latency here (float32, KV cache, {r["latency_threads"]} thread(s), 128-token
  context, best of 5 rounds on a shared machine, so indicative only): target
  {r["target_ms"]:.1f} ms/token, draft {r["draft_ms"]:.1f} ms/token.

## Sample

Greedy completion by the target (at most {SAMPLE_NEW_TOKENS} new tokens) of `{prompt}`:

```python
{sample}
```
"""
    (out / "README.md").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", type=Path, help="output dir (default: bench/toy_pair; a tmp dir with --quick)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-minutes", type=float, help="default 40 (0.4 with --quick)")
    p.add_argument("--draft-minutes", type=float, help="default 12 (0.25 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="max torch threads (1 while busy)")
    p.add_argument("--max-chars", type=int, help="corpus cap in characters")
    p.add_argument("--quick", action="store_true", help="tiny budgets: an end-to-end smoke test")
    args = p.parse_args()
    if args.out is None:
        # Never let a smoke test overwrite the shipped models by accident.
        args.out = (
            Path(tempfile.mkdtemp(prefix="tandem-pair-")) if args.quick else Path("bench/toy_pair")
        )
    if args.target_minutes is None:
        args.target_minutes = 0.4 if args.quick else 40.0
    if args.draft_minutes is None:
        args.draft_minutes = 0.25 if args.quick else 12.0
    if args.max_chars is None:
        args.max_chars = 2_000_000 if args.quick else 64_000_000
    return args


def resolved_args(args: argparse.Namespace) -> str:
    parts = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.extend([flag] if value else [])
        else:
            parts.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()  # keep the training log readable
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    argv = [os.path.relpath(sys.argv[0]), *sys.argv[1:]]
    command = "python " + " ".join(shlex.quote(a) for a in argv)
    log(f"command: {command}")
    log(f"output: {out.resolve()}  threads: {args.threads}  quick: {args.quick}")

    n_prompts, eval_windows = (8, 16) if args.quick else (50, 128)
    prompt_len, new_tokens, k = 64, 64, 4
    target_lr, draft_lr, kl_weight = 1e-3, 2e-3, 0.7
    warmup, log_every = (10, 5) if args.quick else (50, 25)

    corpus = collect_corpus(args.max_chars)
    log(
        f"corpus: {corpus.root}: {len(corpus.train_files)} train files "
        f"({corpus.train_chars:,} chars), {len(corpus.heldout_files)} held-out files "
        f"({corpus.heldout_chars:,} chars)"
    )

    t0 = time.monotonic()
    tok = train_tokenizer(corpus.train_texts)
    eot_id = tok.convert_tokens_to_ids(EOT)
    im_end_id = tok.convert_tokens_to_ids(IM_END)
    target_dir, draft_dir = out / "target", out / "draft"
    for d in (target_dir, draft_dir):
        save_tokenizer(tok, d)
        check_tokenizer(d, corpus.heldout_texts[0])
    log(f"tokenizer trained and checked in {time.monotonic() - t0:.1f}s (vocab {len(tok)})")

    train_stream = encode_stream(tok, corpus.train_texts)
    heldout_stream = encode_stream(tok, corpus.heldout_texts)
    log(f"tokens: train {len(train_stream):,}, held-out {len(heldout_stream):,}")

    # ---- target -------------------------------------------------------------------------
    seed_everything(args.seed)
    target = build_model(TARGET_SHAPE, eot_id, im_end_id)
    target_params = count_params(target)
    log(f"target: {target_params:,} parameters")
    target_stats = train_time_bounded(
        "target",
        target,
        batches(train_stream, args.seed),
        ce_loss,
        args.target_minutes * 60,
        target_lr,
        warmup_steps=warmup,
        log_every=log_every,
        max_threads=args.threads,
    )
    # From here on, the bf16-rounded weights we ship (reloaded in fp32): the draft is distilled
    # from, and everything is evaluated on, exactly what users will load.
    target = save_pair_member(target, tok, target_dir)
    for p in target.parameters():
        p.requires_grad_(False)

    # ---- draft --------------------------------------------------------------------------
    seed_everything(args.seed + 1)
    draft = build_model(DRAFT_SHAPE, eot_id, im_end_id)
    draft_params = count_params(draft)
    log(f"draft: {draft_params:,} parameters ({target_params / draft_params:.1f}x smaller)")
    draft_stats = train_time_bounded(
        "draft",
        draft,
        batches(train_stream, args.seed + 1),
        make_distill_loss(target, kl_weight),
        args.draft_minutes * 60,
        draft_lr,
        warmup_steps=warmup,
        log_every=log_every,
        max_threads=args.threads,
    )
    draft = save_pair_member(draft, tok, draft_dir)

    # ---- evaluation (bf16 weights reloaded in fp32) --------------------------------------
    log("evaluating")
    adapt_threads(args.threads)
    windows = heldout_windows(heldout_stream, eval_windows)
    target_ce = heldout_loss(target, windows)
    draft_ce = heldout_loss(draft, windows)
    log(
        f"held-out CE: target {target_ce:.4f} (ppl {math.exp(target_ce):.2f}), "
        f"draft {draft_ce:.4f} (ppl {math.exp(draft_ce):.2f})"
    )
    prompts = heldout_prompts(heldout_stream, n_prompts, prompt_len, eot_id)
    acc = acceptance_stats(target, draft, prompts, new_tokens, k)
    log(
        f"greedy match rate {acc['match_rate']:.3f}; K={k}: mean accepted "
        f"{acc['mean_accepted']:.2f}, tokens/step {acc['tokens_per_step']:.2f}"
    )
    context = heldout_stream[:128].long()
    latency_threads = torch.get_num_threads()
    target_ms = decode_latency_ms(target, context)
    draft_ms = decode_latency_ms(draft, context)
    log(f"decode latency: target {target_ms:.1f} ms/token, draft {draft_ms:.1f} ms/token")
    sample = sample_completion(target_dir, target, SAMPLE_PROMPT)
    log(f"sample:\n{sample}")

    results = {
        "command": command,
        "resolved_args": resolved_args(args),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": args.threads,
        "latency_threads": latency_threads,
        "seed": args.seed,
        "corpus_root": corpus.root,
        "max_chars": args.max_chars,
        "train_files": len(corpus.train_files),
        "heldout_files": len(corpus.heldout_files),
        "train_chars": corpus.train_chars,
        "heldout_chars": corpus.heldout_chars,
        "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
        "target_params": target_params,
        "draft_params": draft_params,
        "target_mb": dir_size_mb(target_dir),
        "draft_mb": dir_size_mb(draft_dir),
        "target_stats": target_stats,
        "draft_stats": draft_stats,
        "target_lr": target_lr,
        "draft_lr": draft_lr,
        "kl_weight": kl_weight,
        "warmup": warmup,
        "target_minutes": args.target_minutes,
        "draft_minutes": args.draft_minutes,
        "eval_windows": len(windows),
        "eval_tokens": len(windows) * SEQ_LEN,
        "target_ce": target_ce,
        "draft_ce": draft_ce,
        "n_prompts": len(prompts),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "k": k,
        "acceptance": acc,
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "sample": sample,
    }
    write_readme(out, results)
    total_mb = results["target_mb"] + results["draft_mb"]
    log(
        f"done: target {target_params:,} params, draft {draft_params:,} params, "
        f"{total_mb:.1f} MB on disk; README at {out / 'README.md'}"
    )


if __name__ == "__main__":
    main()
