"""What a step costs on this machine, measured rather than assumed.

A pass's cost has two parts that grow with different things, and a draft-length policy has to
see both: speculation adds tokens to a pass but no sequences.

- target pass: `table(num_tokens) + kv_coef * kv_tokens + qk_coef * qk_pairs`, where the table
  is timed at start-up over log-spaced token counts (short sequences, so it holds the weights'
  cost: flat while they are memory-bound, then rising), `kv_tokens` is the sum of the context
  lengths of the pass's sequences (keys read) and `qk_pairs` the sum of query x context
  (scores computed). The two coefficients are fitted at start-up from decode batches.
- draft pass: `fixed * passes + per_token * drafts + per_pair * pairs`, fitted at start-up
  over batch sizes and context lengths.

The start-up fit is cached per machine, models and settings (`calibration_key`), so later
starts skip it; `--recalibrate on` forces a fresh one. Every real step then rescales its
prediction by the measured/predicted ratio (a running mean at first, an EMA after that,
one step's ratio clipped to [0.5, 2] so a pause on a shared machine moves the model a little,
not a lot).

The verifier capacity P is the number of tokens a target pass takes for about the cost of a
single-token pass (within `CAPACITY_SLACK`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.model_runner import ModelRunner, SeqInput

logger = logging.getLogger(__name__)

CAPACITY_SLACK = 1.25
_EMA = 0.05
# Start-up calibration shapes: sequences of the table, decode batches of the attention fit.
_TABLE_CHUNK = 16
_CALIBRATION_CONTEXTS = (64, 256)


@dataclass(frozen=True)
class PassShape:
    """What a forward pass holds, in the units the cost model charges for."""

    num_tokens: int
    kv_tokens: int = 0
    """Sum over sequences of the context each one attends to (keys read)."""
    qk_pairs: int = 0
    """Sum over sequences of query tokens x context (attention scores)."""

    @classmethod
    def of(cls, query_lens: list[int], context_lens: list[int]) -> PassShape:
        return cls(
            sum(query_lens),
            sum(context_lens),
            sum(q * c for q, c in zip(query_lens, context_lens, strict=True)),
        )


class _Scale:
    """Measured / predicted, averaged: a running mean over the first observations (so an
    unlucky calibration is replaced outright), an EMA after that (so drift is followed)."""

    def __init__(self) -> None:
        self.value = 1.0
        self.count = 0

    def observe(self, measured: float, calibrated: float) -> None:
        """`calibrated`: the start-up fit's prediction for what took `measured` seconds."""
        if calibrated <= 0:
            return
        self.count += 1
        rate = max(_EMA, 1.0 / self.count)
        ratio = float(np.clip(measured / calibrated, 0.5 * self.value, 2.0 * self.value))
        self.value += rate * (ratio - self.value)


class CostModel:
    def __init__(
        self,
        sizes: list[int],
        target_seconds: list[float],
        draft_fixed: float,
        draft_per_token: float,
        *,
        kv_coef: float = 0.0,
        qk_coef: float = 0.0,
        draft_per_pair: float = 0.0,
    ) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # A bigger pass never costs less: timing noise must not make it look that way.
        self.target_seconds = np.maximum.accumulate(np.asarray(target_seconds, dtype=np.float64))
        self.kv_coef = kv_coef
        self.qk_coef = qk_coef
        self.draft_fixed = draft_fixed
        self.draft_per_token = draft_per_token
        self.draft_per_pair = draft_per_pair
        self.target_scale = _Scale()
        self.draft_scale = _Scale()

    def target_time(
        self,
        num_tokens: np.ndarray | float,
        kv_tokens: np.ndarray | float = 0.0,
        qk_pairs: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        return self.target_scale.value * self._target_calibrated(num_tokens, kv_tokens, qk_pairs)

    def draft_time(
        self,
        num_passes: np.ndarray | float,
        num_drafts: np.ndarray | float,
        qk_pairs: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Seconds for `num_passes` draft passes proposing `num_drafts` tokens in total whose
        queries attend `qk_pairs` keys in total."""
        return self.draft_scale.value * self._draft_calibrated(num_passes, num_drafts, qk_pairs)

    def _target_calibrated(
        self,
        num_tokens: np.ndarray | float,
        kv_tokens: np.ndarray | float,
        qk_pairs: np.ndarray | float,
    ) -> np.ndarray:
        """The start-up fit alone, before the online scale."""
        return (
            self._table(num_tokens)
            + self.kv_coef * np.asarray(kv_tokens, dtype=np.float64)
            + self.qk_coef * np.asarray(qk_pairs, dtype=np.float64)
        )

    def _draft_calibrated(
        self,
        num_passes: np.ndarray | float,
        num_drafts: np.ndarray | float,
        qk_pairs: np.ndarray | float,
    ) -> np.ndarray:
        return (
            self.draft_fixed * np.asarray(num_passes, dtype=np.float64)
            + self.draft_per_token * np.asarray(num_drafts, dtype=np.float64)
            + self.draft_per_pair * np.asarray(qk_pairs, dtype=np.float64)
        )

    def _table(self, num_tokens: np.ndarray | float) -> np.ndarray:
        # Linear inside the table, linear extrapolation past its end (compute-bound regime).
        n = np.asarray(num_tokens, dtype=np.float64)
        table = self.target_seconds
        inside = np.interp(n, self.sizes, table)
        if len(self.sizes) >= 2:
            slope = (table[-1] - table[-2]) / (self.sizes[-1] - self.sizes[-2])
            inside = np.where(n > self.sizes[-1], table[-1] + slope * (n - self.sizes[-1]), inside)
        return inside

    def capacity(self) -> int:
        """Verifier capacity P: most tokens a pass holds within CAPACITY_SLACK x one token."""
        limit = CAPACITY_SLACK * self.target_seconds[0]
        ok = self.sizes[self.target_seconds <= limit]
        return int(ok.max()) if ok.size else 1

    def observe_target(self, shape: PassShape, seconds: float) -> None:
        calibrated = self._target_calibrated(shape.num_tokens, shape.kv_tokens, shape.qk_pairs)
        self.target_scale.observe(seconds, float(calibrated))

    def observe_draft(
        self, num_passes: int, num_drafts: int, qk_pairs: int, seconds: float
    ) -> None:
        calibrated = self._draft_calibrated(num_passes, num_drafts, qk_pairs)
        self.draft_scale.observe(seconds, float(calibrated))

    def to_dict(self) -> dict:
        """The start-up fit (not the online scale), as JSON-able numbers."""
        return {
            "sizes": [int(s) for s in self.sizes],
            "target_seconds": [float(t) for t in self.target_seconds],
            "kv_coef": self.kv_coef, "qk_coef": self.qk_coef, "draft_fixed": self.draft_fixed,
            "draft_per_token": self.draft_per_token, "draft_per_pair": self.draft_per_pair,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls(
            data["sizes"], data["target_seconds"], data["draft_fixed"], data["draft_per_token"],
            kv_coef=data["kv_coef"], qk_coef=data["qk_coef"],
            draft_per_pair=data["draft_per_pair"],
        )  # fmt: skip


def calibration_key(runners: list[ModelRunner], settings: dict) -> str:
    """What a calibration's timings depend on: this machine (CPU model and flags, torch and
    its thread count), the engine's code, each model's config and weight files, and the
    settings that shape the timed passes. Any change gives another key."""
    from engine.kernel_build import cpu_identity

    h = hashlib.sha256()
    h.update(cpu_identity().encode())
    h.update(f"{platform.python_version()} {torch.__version__} {torch.get_num_threads()}".encode())
    if torch.cuda.is_available():
        h.update(torch.cuda.get_device_name(0).encode())
    engine_dir = Path(__file__).resolve().parent
    for path in sorted([*engine_dir.rglob("*.py"), *engine_dir.glob("csrc/*.[ch]")]):
        h.update(path.read_bytes())
    for runner in runners:
        h.update(json.dumps(runner.hf_config.to_dict(), sort_keys=True, default=str).encode())
        h.update(f"{runner.device} {runner.dtype} {runner.model_impl}".encode())
        h.update(type(runner.attention_backend).__name__.encode())
        head = runner.head_tokens
        h.update(f"{runner.kernels} {None if head is None else head.tolist()}".encode())
        model_dir = Path(runner.name)
        if model_dir.is_dir():
            for weights in sorted(model_dir.glob("*.safetensors")) + sorted(
                model_dir.glob("*.bin")
            ):
                stat = weights.stat()
                h.update(f"{weights.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:24]


def calibration_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "calibration"


def cached_calibration(
    key: str, calibrate: Callable[[], CostModel], fresh: bool = False
) -> CostModel:
    """The calibration stored under `key`, else `calibrate()` (then stored). `fresh` skips
    the lookup. A cache that cannot be read or written only costs a calibration."""
    path = calibration_cache_dir() / f"{key}.json"
    if not fresh:
        try:
            cost = CostModel.from_dict(json.loads(path.read_text()))
            logger.info(
                "cost model from %s (calibrated earlier on this machine; --recalibrate on to "
                "redo it): target pass %.2f ms (1 token), verifier capacity P=%d",
                path, cost.target_seconds[0] * 1e3, cost.capacity(),
            )  # fmt: skip
            return cost
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the cached calibration %s: %s", path, exc)
    cost = calibrate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cost.to_dict()))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the calibration in %s: %s", path, exc)
    return cost


def calibrate_runners(
    target: ModelRunner,
    draft: ModelRunner | None,
    block_size: int,
    num_blocks: int,
    max_tokens: int,
    max_batch: int,
    max_context: int,
    repeats: int = 5,
) -> CostModel:
    """Time target and draft passes of known shapes before any request runs.

    The KV written and read here is garbage in blocks nobody holds yet; real requests
    overwrite it. Sequences get distinct blocks while the pool lasts (then they wrap), so the
    keys a decode batch reads are as spread out as in real use.
    """
    device = target.device
    started = time.perf_counter()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def batch(num_seqs: int, query_len: int, context: int) -> list[SeqInput]:
        return sequences([query_len] * num_seqs, [context] * num_seqs)

    def sequences(query_lens: list[int], contexts: list[int]) -> list[SeqInput]:
        seqs, first = [], 0
        for q, ctx in zip(query_lens, contexts, strict=True):
            per_seq = -(-ctx // block_size)
            table = [(first + b) % num_blocks for b in range(per_seq)]
            first += per_seq
            seqs.append(SeqInput([0] * q, ctx - q, table, [q - 1]))
        return seqs

    def timed(runner: ModelRunner, seqs: list[SeqInput], n: int = repeats) -> float:
        return _min_time(lambda: (runner.forward(seqs), sync()), n)

    # The weights' cost by token count: short sequences, so attention stays small.
    sizes = _log_sizes(max_tokens)
    table = []
    for n in sizes:
        chunks = table_chunks(n)
        table.append(timed(target, sequences(chunks, chunks)))
    cost = CostModel(sizes, table, 0.0, 0.0)

    # Attention: decode batches over short and long contexts, one and several queries each;
    # what the table does not explain is fitted to keys read and scores computed.
    contexts = sorted({min(c, max_context) for c in _CALIBRATION_CONTEXTS})
    batches = sorted({min(8, max_batch), max_batch})
    rows, residuals = [], []
    for b in batches:
        for ctx in contexts:
            for q in sorted({1, min(5, ctx)}):
                seconds = timed(target, batch(b, q, ctx), max(2, repeats // 2))
                shape = PassShape.of([q] * b, [ctx] * b)
                rows.append([shape.kv_tokens, shape.qk_pairs])
                residuals.append(seconds - float(cost._table(shape.num_tokens)))
    cost.kv_coef, cost.qk_coef = _nonneg_lstsq(np.array(rows), np.array(residuals))

    if draft is not None:
        rows, times = [], []
        for b in sorted({1, min(8, max_batch), max_batch}):
            for ctx in contexts:
                rows.append([1.0, b, b * ctx])
                times.append(timed(draft, batch(b, 1, ctx)))
        fixed, per_token, per_pair = _nonneg_lstsq(np.array(rows), np.array(times))
        cost.draft_fixed, cost.draft_per_token, cost.draft_per_pair = fixed, per_token, per_pair

    logger.info(
        "cost model calibrated in %.1fs: target pass %.2f ms (1 token) .. %.2f ms (%d) "
        "+ %.2f us/key + %.4f us/score; draft pass %.2f ms + %.3f ms/token + %.4f us/score; "
        "verifier capacity P=%d",
        time.perf_counter() - started, cost.target_seconds[0] * 1e3,
        cost.target_seconds[-1] * 1e3, int(cost.sizes[-1]), cost.kv_coef * 1e6,
        cost.qk_coef * 1e6, cost.draft_fixed * 1e3, cost.draft_per_token * 1e3,
        cost.draft_per_pair * 1e6, cost.capacity(),
    )  # fmt: skip
    return cost


def table_chunks(num_tokens: int) -> list[int]:
    """Query lengths of the sequences that time a pass of exactly `num_tokens` tokens: as
    few as keep each at most `_TABLE_CHUNK`, as even as they divide."""
    count = -(-num_tokens // _TABLE_CHUNK)
    return [num_tokens // count + (i < num_tokens % count) for i in range(count)]


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0 (costs cannot be negative): refit without
    the columns that come out negative until none does."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [c for c, s in zip(active, sol, strict=True) if s >= 0]
    return [float(c) for c in coef]


def _log_sizes(limit: int) -> list[int]:
    """Every size up to 8 (1 + K for the usual K: interpolating there would hide whether a
    verification pass costs what a decode does), then 1.5x and 2x steps up to `limit`."""
    sizes = list(range(1, 9))
    n = 8
    while n < limit:
        sizes += [n * 3 // 2, n * 2]
        n *= 2
    return sorted({s for s in sizes if s < limit} | {max(limit, 1)})


def _min_time(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats`: interference on a shared machine only ever adds time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
