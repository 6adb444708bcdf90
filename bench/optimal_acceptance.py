"""How close do verifiers come to the best possible multi-draft acceptance, on the default pair?

  python -m bench.optimal_acceptance                       # T = 1, 24 prompts, 1, 2, 4 drafts
  python -m bench.optimal_acceptance --temperature 0.7 --prompts 48

For a sample of positions it logs the target's distribution p and the draft's q (both at
--temperature): the target samples an answer to each held-out chat instruction
(bench/chat_prompts.py), then both models read it, teacher-forced. At each position, with n
drafts drawn from q, the best acceptance rate any verifier can reach (keeping the output
exactly p) is the value of an optimal transport problem between p and the random set S of
drafts (Hu et al., 2025). Its dual is a subset selection:

    alpha* = min over token sets A of  p(outside A) + P(S meets A)

computed here exactly by enumerating every set A of a reduced alphabet: the --bins - 1 tokens
where max(p, q) is largest, plus the rest as one bin (merging tokens can only make matching
easier, so binned figures are upper bounds of the full-vocabulary ones; every figure below is
on the same bins). Reported beside each optimum, for drafts drawn with and without
replacement:
- rrs: recursive rejection sampling (test the drafts in turn, each against the residual the
  previous rejections left; for drafts without replacement the draft distribution shrinks
  too), exact expectation over the drafts;
- greedy: the optimum for the "greedy" draft sampler (the top n - 1 draft tokens fixed, the
  last one drawn from q over the rest), which Hu et al. show a verifier reaches:
  1 - sum over x outside the top of max(0, p(x) - q'(x)).
With n = 1 all of these are sum_x min(p, q), which token verification reaches. The last
column is RRS with drafts drawn with replacement on the full vocabulary (no bins), exact.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.chat_prompts import bench_messages
from bench.default_engine import DRAFT, TARGET
from engine.model.files import prepare


def log_distributions(
    prompts: int, max_tokens: int, temperature: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """[positions, vocab] p and q at every answer position (float64)."""
    target_dir, draft_dir = prepare(TARGET), prepare(DRAFT)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    ps, qs = [], []
    for messages in bench_messages(prompts):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        out = target.generate(
            ids,
            max_new_tokens=max_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
        )
        span = slice(ids.shape[1] - 1, out.shape[1] - 1)  # positions predicting the answer
        for model, sink in ((target, ps), (draft, qs)):
            logits = model(out).logits[0, span].double() / temperature
            sink.append(torch.softmax(logits, dim=-1).numpy())
    return np.concatenate(ps), np.concatenate(qs)


def binned(p: np.ndarray, q: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """[positions, bins]: the bins - 1 tokens with the largest max(p, q), then the rest."""
    top = np.argsort(-np.maximum(p, q), axis=1)[:, : bins - 1]
    pt, qt = np.take_along_axis(p, top, 1), np.take_along_axis(q, top, 1)
    pb = np.concatenate([pt, 1 - pt.sum(1, keepdims=True)], 1).clip(min=0)
    qb = np.concatenate([qt, 1 - qt.sum(1, keepdims=True)], 1).clip(min=0)
    return pb / pb.sum(1, keepdims=True), qb / qb.sum(1, keepdims=True)


def _subset_sums(weights: np.ndarray) -> np.ndarray:
    """weights [positions, 2^m] over sets T -> f[:, U] = sum over T within U (zeta transform)."""
    f = weights.copy()
    m = int(np.log2(f.shape[1]))
    for bit in range(m):
        step = 1 << bit
        view = f.reshape(f.shape[0], -1, 2 * step)
        view[:, :, step:] += view[:, :, :step]
    return f


def _draft_sets(q: np.ndarray, n: int, replacement: bool) -> np.ndarray:
    """[positions, 2^m] the probability that n drafts from q are exactly the set T."""
    pos, m = q.shape
    out = np.zeros((pos, 1 << m))
    seqs = (
        itertools.product(range(m), repeat=n)
        if replacement
        else itertools.permutations(range(m), n)
    )
    seqs_arr = np.array(list(seqs))  # [num_seqs, n]
    prob = np.ones((pos, len(seqs_arr)))
    used = np.zeros((pos, len(seqs_arr)))
    for j in range(n):
        qj = q[:, seqs_arr[:, j]]
        prob *= qj / (1 if replacement else np.clip(1 - used, 1e-300, None))
        used += qj
    masks = np.bitwise_or.reduce(1 << seqs_arr, axis=1)
    order = np.argsort(masks, kind="stable")
    uniq, starts = np.unique(masks[order], return_index=True)
    out[:, uniq] = np.add.reduceat(prob[:, order], starts, axis=1)
    return out


def optimum(p: np.ndarray, q: np.ndarray, n: int, replacement: bool) -> np.ndarray:
    """[positions] min over A of p(not A) + P(S meets A), over every set A of the bins."""
    m = p.shape[1]
    sets = np.arange(1 << m)
    member = (sets[:, None] >> np.arange(m)[None, :]) & 1  # [2^m, m]
    p_in = p @ member.T  # [positions, 2^m] p(A)
    avoid = _subset_sums(_draft_sets(q, n, replacement))  # P(S within U)
    meets = 1 - avoid[:, (1 << m) - 1 - sets]  # P(S meets A) = 1 - P(S within not-A)
    return (1 - p_in + meets).min(axis=1)


def rrs(p: np.ndarray, q: np.ndarray, n: int, replacement: bool) -> np.ndarray:
    """[positions] acceptance of recursive rejection sampling, exact over the drafts."""
    pos, m = q.shape
    seqs = np.array(
        list(
            itertools.product(range(m), repeat=n)
            if replacement
            else itertools.permutations(range(m), n)
        )
    )
    total = np.zeros(pos)
    for seq in seqs:
        residual, qcur, prob, reject = p.copy(), q.copy(), np.ones(pos), np.ones(pos)
        for x in seq:
            qx = qcur[:, x]
            prob = prob * qx
            ratio = np.where(qx > 0, residual[:, x] / np.clip(qx, 1e-300, None), 0)
            reject = reject * (1 - np.minimum(1, ratio))
            residual = np.clip(residual - qcur, 0, None)
            norm = residual.sum(1, keepdims=True)
            residual = np.where(norm > 0, residual / np.clip(norm, 1e-300, None), 0)
            if not replacement:
                qcur = qcur.copy()
                qcur[:, x] = 0
                qn = qcur.sum(1, keepdims=True)
                qcur = np.where(qn > 0, qcur / np.clip(qn, 1e-300, None), 0)
        total += prob * (1 - reject)
    return total


def rrs_iid_full(p: np.ndarray, q: np.ndarray, n: int) -> np.ndarray:
    """[positions] RRS with drafts drawn with replacement, on the full vocabulary: the
    residual after a rejection does not depend on the rejected token, so the acceptance is
    1 - prod_i (1 - sum min(r_{i-1}, q)) exactly."""
    residual, reject = p.copy(), np.ones(len(p))
    for _ in range(n):
        reject *= 1 - np.minimum(residual, q).sum(1)
        residual = np.clip(residual - q, 0, None)
        residual /= np.clip(residual.sum(1, keepdims=True), 1e-300, None)
    return 1 - reject


def greedy_sampler_optimum(p: np.ndarray, q: np.ndarray, n: int) -> np.ndarray:
    """[positions] the optimum for drafts = top n - 1 of q plus one draw from q over the rest."""
    order = np.argsort(-q[:, :-1], axis=1)  # tokens only: the last bin is the rest
    top = order[:, : n - 1]
    rest = q.copy()
    np.put_along_axis(rest, top, 0.0, axis=1)
    rest /= np.clip(rest.sum(1, keepdims=True), 1e-300, None)
    pr = p.copy()
    np.put_along_axis(pr, top, 0.0, axis=1)
    return 1 - np.clip(pr - rest, 0, None).sum(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--bins", type=int, default=12, help="top tokens + 1 bin for the rest")
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    start = time.perf_counter()
    with torch.inference_mode():
        p_full, q_full = log_distributions(args.prompts, args.max_tokens, args.temperature)
    p, q = binned(p_full, q_full, args.bins)
    full_single = np.minimum(p_full, q_full).sum(1).mean()
    print(
        f"{len(p)} positions from {args.prompts} prompts, T={args.temperature}, "
        f"{args.bins - 1} top tokens + 1 bin; sum min(p, q) on the full vocabulary "
        f"{full_single:.3f}, on the bins {np.minimum(p, q).sum(1).mean():.3f}"
    )
    print(
        "| drafts | optimum, iid | rrs, iid | optimum, w/o repl. | rrs, w/o repl. "
        "| greedy sampler | rrs, iid, full vocabulary |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.drafts:
        cells = [
            optimum(p, q, n, True).mean(),
            rrs(p, q, n, True).mean(),
            optimum(p, q, n, False).mean(),
            rrs(p, q, n, False).mean(),
            greedy_sampler_optimum(p, q, n).mean(),
            rrs_iid_full(p_full, q_full, n).mean(),
        ]
        print(f"| {n} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
