"""From logits to the distribution each row (one verified position) samples from, the draws,
and logprobs; seeded rows race keyed by (seed, position) alone (docs/VERIFICATION.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cpu import kernels as cpu_kernels
from engine.cpu import sampling as cpu_sampling
from engine.sample.backends import backend_for
from engine.types.outputs import TokenLogprob
from engine.types.request import Request, SamplingParams


@dataclass
class RowSpec:
    """The context of one row: which request, and the tokens generated before it."""

    request: Request
    prior_drafts: list[int] = field(default_factory=list)  # this step's drafts before the row

    @property
    def num_generated(self) -> int:
        return self.request.num_output_tokens + len(self.prior_drafts)


def edits_logits(req: Request) -> bool:
    """Whether `apply_penalties_and_masks` may change any of `req`'s rows (after its output)."""
    if _rewrites(req):
        return True
    return req.params.min_tokens > req.num_output_tokens and bool(req.stop_token_ids)


def _rewrites(req: Request) -> bool:
    return req.grammar is not None or req.params.has_penalties or bool(req.params.logit_bias)


def _changes(row: RowSpec) -> bool:
    return _rewrites(row.request) or _masks_stops(row)


def apply_penalties_and_masks(
    logits: torch.Tensor,  # [num_rows, vocab], modified in place unless an inference tensor
    rows: list[RowSpec],
) -> torch.Tensor:
    changed = [i for i, row in enumerate(rows) if _changes(row)]
    if not changed:  # the common case: plain rows, left as they are
        return logits
    # A forward's logits are inference tensors, not writable in place outside inference_mode.
    if logits.is_inference():
        logits = logits.clone()
    constrained = [i for i in changed if rows[i].request.grammar is not None]
    if constrained:  # one host-to-device copy and one fill for every constrained row
        allowed = torch.stack([_grammar_mask(rows[i], logits.shape[1]) for i in constrained])
        index = torch.tensor(constrained, device=logits.device)
        refused = ~allowed.to(logits.device)
        logits[index] = logits[index].masked_fill(refused, float("-inf"))
    for i in changed:
        row = rows[i]
        params = row.request.params
        if row.request.grammar is None and _masks_stops(row):  # (grammar rows: done above)
            logits[i, list(row.request.stop_token_ids)] = float("-inf")
        if params.has_penalties:
            generated = row.request.output_token_ids + row.prior_drafts
            if generated:
                counts = torch.bincount(
                    torch.tensor(generated, device=logits.device), minlength=logits.shape[1]
                )[: logits.shape[1]].to(logits.dtype)
                logits[i] -= params.frequency_penalty * counts
                logits[i] -= params.presence_penalty * (counts > 0).to(logits.dtype)
    vocab = logits.shape[1]  # a draft's vocabulary may be smaller than the target's
    biased = [(i, t, b) for i in changed for t, b in rows[i].request.params.logit_bias if t < vocab]
    if biased:  # one scatter-add for every biased row
        at, tokens, biases = zip(*biased, strict=True)
        index = (torch.tensor(at, device=logits.device), torch.tensor(tokens, device=logits.device))
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=True)
    return logits


def _grammar_mask(row: RowSpec, vocab: int) -> torch.Tensor:  # [vocab] bool, on the CPU
    """The grammar's mask; min_tokens also refuses the stops unless nothing else is left."""
    allowed = row.request.grammar.allowed(row.prior_drafts)
    if allowed.shape[0] != vocab:  # a draft vocabulary of another size: the rest is refused
        allowed = torch.cat([allowed, allowed.new_zeros(max(0, vocab - allowed.shape[0]))])
        allowed = allowed[:vocab]
    if _masks_stops(row):
        without_stops = allowed.clone()
        without_stops[[t for t in row.request.stop_token_ids if t < vocab]] = False
        if bool(without_stops.any()):
            allowed = without_stops
    return allowed


def _masks_stops(row: RowSpec) -> bool:
    min_tokens = row.request.params.min_tokens
    return bool(min_tokens) and row.num_generated < min_tokens and bool(row.request.stop_token_ids)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows]
    """`Tensor.argmax` (NaN counts as largest); on the CPU through numpy's, far cheaper."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab] after penalties and masks
    rows: list[RowSpec],
) -> torch.Tensor:  # [num_rows, vocab]
    """The distribution each row samples from (one-hot for greedy rows)."""
    params = [row.request.params for row in rows]
    if all(p.greedy for p in params):  # the common case; skips the softmax and the blend
        return torch.zeros_like(logits).scatter_(1, argmax(logits)[:, None], 1.0)
    probs = torch.softmax(scaled_logits(logits, params), dim=-1)
    if any(p.greedy for p in params):
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, argmax(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def scaled_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits over each row's temperature (1 if greedy), top-k and top-p dropped to -inf."""
    temperatures = [p.temperature if not p.greedy else 1.0 for p in params]
    if len(set(temperatures)) == 1:  # one request, or one setting: a scalar divides the same
        scaled = logits / temperatures[0]
    else:
        scaled = (
            logits / torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[:, None]
        )
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy):
        scaled = _top_k_top_p(scaled, params)
    return scaled


def kernel_rows(rows: torch.Tensor) -> bool:
    """Whether Tandem's CPU kernels take these rows (float32 in the CPU's memory)."""
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and cpu_kernels.available()


def _top_k_top_p(scaled: torch.Tensor, params: list) -> torch.Tensor:
    vocab = scaled.shape[1]
    top_k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=scaled.device
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=scaled.dtype, device=scaled.device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    drop = rank >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # The smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# A race time is -log u with u = (k + 1/2) / 2^24, so -log(time) is at most this.
_MOST_BONUS = -math.log(-math.log1p(-(2.0**-25)))


def _mix64(x: int) -> int:  # splitmix64's finaliser
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def race_key(seed: int, position: int) -> int:
    return _mix64(_mix64(seed & _MASK64) ^ position)


def race_times(seed: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """Exp(1) race times -log u of `tokens`: u = (k + 1/2) / 2^24, k the top 24 bits of
    splitmix64 stepped token + 1 times from `race_key`; a function of (seed, position, token)."""
    key = np.uint64(race_key(seed, position))
    x = key + (tokens.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return -np.log(((x >> np.uint64(40)).astype(np.float64) + 0.5) * 2.0**-24)


def coupled_winner(z: np.ndarray, seed: int, position: int) -> int:
    """argmax_x z(x) - log E(x), E = `race_times`: the exponential race's sample of softmax(z)
    for log-weights z. A token wins only within `_MOST_BONUS` of the top's key (E >= 1 - u)."""
    top = int(z.argmax())
    best = float(z[top]) - math.log(race_times(seed, position, np.array([top]))[0])
    candidates = np.flatnonzero(z >= best - _MOST_BONUS - 1e-6)
    if candidates.size <= 1:
        return top
    keys = z[candidates].astype(np.float64) - np.log(race_times(seed, position, candidates))
    return int(candidates[keys.argmax()])


def coupled_tokens(
    logits: torch.Tensor,  # [n, vocab] seeded rows, after penalties and masks
    rows: list[RowSpec],  # each row's request and place: its noise is (seed, output position)
) -> list[int]:
    """Each row's coupled sample of the distribution it samples from (`scaled_logits`)."""
    params = [row.request.params for row in rows]
    masked = any(p.top_k > 0 or p.top_p < 1.0 for p in params)  # else the kernel divides
    scaled = scaled_logits(logits, params) if masked else None
    tokens = [-1] * len(rows)
    if kernel_rows(logits):
        keys = [race_key(_seed(row), row.num_generated) for row in rows]
        if scaled is None:
            tokens = cpu_sampling.race_rows(logits, [p.temperature for p in params], keys)
        else:
            tokens = cpu_sampling.race_rows(scaled, [1.0] * len(rows), keys)
    z = None
    for j, row in enumerate(rows):
        if tokens[j] < 0:
            if z is None:
                scaled = scaled_logits(logits, params) if scaled is None else scaled
                z = scaled.detach().to("cpu", torch.float32).numpy()
            tokens[j] = coupled_winner(z[j], _seed(row), row.num_generated)
    return tokens


def _seed(row: RowSpec) -> int:
    seed = row.request.params.seed
    assert seed is not None  # only seeded requests are coupled
    return seed


def couple_seeded_rows(
    probs: torch.Tensor,  # [rows, vocab] `logits_to_probs` of `logits`
    rows: list[RowSpec],
    logits: torch.Tensor,  # after penalties and masks
) -> torch.Tensor:
    """Seeded sampling rows made one-hot at their coupled sample (the others unchanged)."""
    idx = [i for i, row in enumerate(rows) if row.request.params.coupled]
    if idx:
        tokens = coupled_tokens(logits[idx], [rows[i] for i in idx])
        probs[idx] = 0.0
        probs[idx, tokens] = 1.0
    return probs


def target_tokens(logits: torch.Tensor, rows: list[RowSpec]) -> list[int]:
    """Each greedy or seeded row's token (after penalties and masks): argmax or coupled race."""
    idx = [i for i, row in enumerate(rows) if row.request.params.coupled]
    if len(idx) == len(rows):
        return coupled_tokens(logits, rows)
    tokens = argmax(logits).tolist()
    if idx:
        for i, token in zip(idx, coupled_tokens(logits[idx], [rows[i] for i in idx]), strict=True):
            tokens[i] = token
    return tokens


def request_uniforms(
    requests: list[Request],
    num_rows: list[int],
    device: torch.device,
) -> torch.Tensor:  # [sum(num_rows)] float64
    """num_rows[i] U[0, 1) draws from request i's generator (zeros for one-hot rows)."""
    parts = [
        torch.zeros(n, dtype=torch.float64, device=device)
        if req.params.greedy or req.params.coupled
        else torch.rand(n, generator=req.generator, dtype=torch.float64, device=device)
        for req, n in zip(requests, num_rows, strict=True)
    ]
    if len(parts) == 1:  # one request (concurrency 1): no copy
        return parts[0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] (any non-negative mass) x [rows] U[0, 1) -> [rows]: the first token whose
    cumulative mass exceeds u times the row's total (engine/sample/backends.py)."""
    probs = probs.contiguous()
    return backend_for(probs).sample(probs, uniform)


def plain_sampling(params: SamplingParams) -> bool:
    """Whether rows sample softmax(logits / T) as is: not greedy, seeded, top-k or top-p."""
    return not (params.greedy or params.coupled or params.top_k > 0 or params.top_p < 1.0)


def sample_logits(
    logits: torch.Tensor,  # [rows, vocab] after penalties and masks
    temperatures: list[float],  # per row, > 0
    uniform: torch.Tensor,  # [rows] U[0, 1)
) -> torch.Tensor:  # [rows] token ids
    """`sample_from` on softmax(logits / T), which the CPU backend never writes out."""
    logits = logits.contiguous()
    return backend_for(logits).sample_logits(logits, temperatures, uniform)


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw model logits
    token_ids: list[int],  # one per row
    num_top: int,
) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0]
    chosen_list = chosen.tolist()
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True)
        ]
    else:
        tops = [()] * len(token_ids)
    return [
        TokenLogprob(token_id=t, logprob=lp, top=top)
        for t, lp, top in zip(token_ids, chosen_list, tops, strict=True)
    ]
