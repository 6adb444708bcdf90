"""The cost model's start-up calibration: passes of known shapes timed and fitted into a
`CostModel`, cached per machine, models and settings so later starts skip it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.model.inputs import SeqInput
from engine.model.runner import ModelRunner
from engine.spec.cost.draft import DraftCost
from engine.spec.cost.model import CostModel, PassShape
from engine.spec.cost.trace import traced_if_asked

logger = logging.getLogger(__name__)

# Start-up calibration shapes: sequences of the table, decode batches of the attention fit.
_TABLE_CHUNK = 16
_CALIBRATION_CONTEXTS = (64, 256)
# Seconds of timed calls of one shape past which two are enough (_min_time).
_TIMING_BUDGET = 0.2


def calibration_key(runners: list[ModelRunner], settings: dict) -> str:
    """A hash of what the timings depend on: machine, torch, engine code, models, settings."""
    from engine.cpu import kernels as cpu_kernels
    from engine.cpu.build import cpu_identity

    h = hashlib.sha256()
    h.update(cpu_identity().encode())
    if any(runner.kernels != "torch" for runner in runners):  # e.g. AMX tiles on or off
        h.update(str(cpu_kernels.isa()).encode())
    h.update(f"{platform.python_version()} {torch.__version__} {torch.get_num_threads()}".encode())
    if torch.cuda.is_available():
        h.update(torch.cuda.get_device_name(0).encode())
    engine_dir = Path(__file__).resolve().parents[2]  # the whole engine, its kernels included
    for path in sorted([*engine_dir.rglob("*.py"), *engine_dir.rglob("*.[ch]")]):
        h.update(path.read_bytes())
    for runner in runners:
        h.update(json.dumps(runner.hf_config.to_dict(), sort_keys=True, default=str).encode())
        h.update(f"{runner.device} {runner.dtype} {runner.kv_dtype} {runner.model_impl}".encode())
        h.update(f"weights {runner.quantization}".encode())  # --quantization's rounding
        h.update(type(runner.attention_backend).__name__.encode())
        graphs = runner.decode_graphs  # which passes run as graphs changes what they cost
        h.update(f"graphs {graphs.max_query_len if graphs is not None else 0}".encode())
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
    """The calibration stored under `key` unless `fresh`, else `calibrate()` (then stored)."""
    path = calibration_cache_dir() / f"{key}.json"
    if not fresh:
        try:
            cost = CostModel.from_dict(json.loads(path.read_text()))
            logger.info(
                "cost model from %s (calibrated earlier on this machine; --recalibrate on to "
                "redo it): target pass %.2f ms (1 token), verifier capacity P=%d",
                path,
                cost.target_seconds[0] * 1e3,
                cost.capacity(),
            )
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


def calibrate(runners: list[ModelRunner], fresh: bool, **shape: int) -> CostModel:
    """The cost model of `runners` (target, then draft): cached unless `fresh`, else timed."""
    target, draft = runners[0], (runners[1] if len(runners) > 1 else None)
    cost = cached_calibration(
        calibration_key(runners, shape),
        lambda: calibrate_runners(target, draft, **shape),
        fresh=fresh,
    )
    return traced_if_asked(cost)


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
    """Time target and draft passes of known shapes, writing garbage KV into blocks nobody
    holds yet (distinct per sequence while the pool lasts, spread out as in real use)."""
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

    # The weights' cost by token count: sequences short (attention small) and graph-sized.
    sizes = _log_sizes(max_tokens)
    graphs = target.decode_graphs
    chunk = min(_TABLE_CHUNK, graphs.max_query_len) if graphs is not None else _TABLE_CHUNK
    chunk = min(chunk, max_context)
    table = []
    for n in sizes:
        chunks = table_chunks(n, chunk)
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
                residuals.append(seconds - float(cost.table_seconds(shape.num_tokens)))
    cost.kv_coef, cost.qk_coef = _nonneg_lstsq(np.array(rows), np.array(residuals))

    if draft is not None:
        # Draft passes as steps run them, rows weighted by 1 / time (small ones fit as well).
        rows, times = [], []
        for b in sorted({1, 2, 4, min(8, max_batch), min(16, max_batch), max_batch}):
            for ctx in contexts:
                rows.append([1.0, b, b * ctx, 0.0])
                times.append(timed(draft, batch(b, 1, ctx)))
        for ctx in contexts:
            for n in sorted({min(16, ctx), min(64, ctx)}):
                rows.append([1.0, 1.0, n * ctx, n - 1.0])
                times.append(timed(draft, sequences([n], [ctx])))
        weights = 1.0 / np.array(times)
        fit = _nonneg_lstsq(np.array(rows) * weights[:, None], np.ones(len(times)))
        cost.draft = DraftCost(*fit)

    logger.info(
        "cost model calibrated in %.1fs: target pass %.2f ms (1 token) .. %.2f ms (%d) "
        "+ %.2f us/key + %.4f us/score; draft pass %.2f ms + %.3f ms/draft + %.4f us/score "
        "+ %.3f ms/token fed; verifier capacity P=%d",
        time.perf_counter() - started,
        cost.target_seconds[0] * 1e3,
        cost.target_seconds[-1] * 1e3,
        int(cost.sizes[-1]),
        cost.kv_coef * 1e6,
        cost.qk_coef * 1e6,
        cost.draft.fixed * 1e3,
        cost.draft.per_token * 1e3,
        cost.draft.per_pair * 1e6,
        cost.draft.per_fed * 1e3,
        cost.capacity(),
    )
    return cost


def table_chunks(num_tokens: int, chunk: int = _TABLE_CHUNK) -> list[int]:
    """Query lengths for a pass of `num_tokens` tokens: the fewest within `chunk`, even."""
    count = -(-num_tokens // chunk)
    return [num_tokens // count + (i < num_tokens % count) for i in range(count)]


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Least squares with coefficients >= 0: refit without negative columns until none is."""
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


def _min_time(fn: Callable[[], object], repeats: int, budget: float = _TIMING_BUDGET) -> float:
    """Best of 1 + `repeats` calls (interference only ever adds time); at two once they took
    `budget` seconds: a long pass's noise is a small share, and it would take the start."""
    times: list[float] = []
    while len(times) <= repeats and (len(times) < 2 or sum(times) < budget):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
