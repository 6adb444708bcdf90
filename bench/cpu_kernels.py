"""The CPU kernels benchmark: Tandem's C kernels against torch's operators, on the default
model's (SmolLM2-135M's) shapes. Milliseconds, best of --repeats rounds of --iters calls, one
thread unless --threads.

  python -m bench.cpu_kernels gguf            # the GGUF linears: float32, VNNI, int8, AMX
  python -m bench.cpu_kernels gguf-vs BASE --repeats 100      # against commit BASE's kernels
  python -m bench.cpu_kernels attention-vs BASE --threads 2 --repeats 40

`gguf`: the 30 layers' linears on Q4_1 and the LM head on Q8_0 (random weights quantized by
the `gguf` package) through the float32 vector kernel, VNNI on x in 24-bit fixed point and in
int8 (--cpu-activations int8), and AMX tiles from 6 rows ("n/a" without the unit), and the
median of the rounds' int8 / float32 ratios. `-vs BASE` builds commit BASE's engine/cpu/csrc
and alternates the two libraries round by round (the median ratio is steadier than best-ofs).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.cpu import build as kernel_build
from engine.cpu import kernels as cpu_kernels
from engine.cpu import memory as cpu_memory
from engine.cpu import panels as cpu_panels

# SmolLM2-135M: hidden 576, q|k|v 960, o 576, gate|up 3072, down from 1536, 30 layers;
# vocabulary 49,152. (out, in, GGUF type)
GGUF_LAYER = [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1")]
GGUF_HEAD = (49152, 576, "Q8_0")
# Its attention: 9 query heads over 3 kv heads of 64, blocks of 16 tokens, 30 layers.
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK, ATTN_LAYERS = 9, 3, 64, 16, 30


def best_ms(fn, iters: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters * 1e3)
    return min(times)


def bench_gguf(args: argparse.Namespace) -> None:
    shapes, panels = _gguf_weights()
    isa = cpu_kernels.isa() or ""
    vnni_default, amx_default = "+vnni" in isa, "+amx" in isa  # what the engine would run
    has_vnni, has_tiles = cpu_kernels.set_vnni(True), cpu_kernels.set_amx(True)
    units = {  # column: (x as, tiles on), where the CPU has what it needs
        "float32": ("float32", False),
        "VNNI": ("vnni", False),
        "int8": ("int8", False),
        "AMX": ("vnni" if vnni_default else "float32", True),
    }
    present = [u for u, ok in zip(units, (True, has_vnni, has_vnni, has_tiles), strict=True) if ok]
    print(
        "| rows | float32 vector kernel | VNNI (24-bit x) | VNNI (int8 x) | AMX tiles (6+ rows) "
        "| int8 / float32 |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        xs = {inp: torch.randn(rows, inp) for _, inp, _ in shapes}

        def one_model(xs: dict = xs) -> None:
            for (out, inp, kind), panel in zip(shapes, panels, strict=True):
                cpu_kernels.linear(xs[inp], panel, None, out, None, kind)

        def one_round(unit: str) -> float:  # a warm-up call after the switch, then --iters
            x_as, tiles = units[unit]
            cpu_kernels.use_activations("int8" if x_as == "int8" else "float32")
            if x_as != "int8":
                cpu_kernels.set_vnni(x_as == "vnni")
            cpu_kernels.set_amx(tiles)
            return best_ms(one_model, args.iters, 1)

        times = _alternated(one_round, present, args.repeats)
        cells = [f"{min(times[u]):.2f} ms" if u in times else "n/a" for u in units]
        ratio = f"{_median_ratio(times['float32'], times['int8']):.3f}" if has_vnni else "n/a"
        print(f"| {rows} | " + " | ".join(cells) + f" | {ratio} |")
    cpu_kernels.set_vnni(vnni_default)
    cpu_kernels.set_amx(amx_default)


def _gguf_weights() -> tuple[list, list[torch.Tensor]]:
    """The default model's linears as (out, in, GGUF type) and their panels: random weights
    quantized by the `gguf` package, a copy per layer (96 MB in all, read from memory as in a
    real pass)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    shapes = GGUF_LAYER * 30 + [GGUF_HEAD]
    made: dict[tuple, torch.Tensor] = {}
    for out, inp, kind in set(shapes):
        blocks = quantize(torch.randn(out, inp).numpy(), GGMLQuantizationType[kind])
        made[(out, inp, kind)] = cpu_panels.pack_quant_weight(blocks, kind)
    return shapes, [made[shape].clone() for shape in shapes]


def _libraries(base: str) -> dict[str, ctypes.CDLL]:
    """The kernels of commit `base` (built from its engine/cpu/csrc) and of this checkout."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "archive", base, "engine/cpu/csrc"], cwd=root, capture_output=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(tmp, filter="data")
        paths = {base: kernel_build.build(Path(tmp) / "engine/cpu/csrc")}
    paths["this checkout"] = kernel_build.build()
    return {name: ctypes.CDLL(str(path)) for name, path in paths.items()}


def _alternated(one: Callable[[str], float], names: list[str], repeats: int) -> dict:
    """Each name's times of `one(name)` over `repeats` rounds, the order alternating."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 else names[::-1]:
            times[name].append(one(name))
    return times


def _vs_cells(times: dict[str, list[float]]) -> str:
    """Each side's median and best, and the median of the rounds' ratios (second / first)."""
    cells = [f"{statistics.median(t):.2f}, {min(t):.2f} ms" for t in times.values()]
    return f"{cells[0]} | {cells[1]} | {_median_ratio(*times.values()):.3f}"


def _median_ratio(first: list[float], second: list[float]) -> float:
    """The median over rounds of second / first (times of one round each)."""
    return statistics.median(b / a for a, b in zip(first, second, strict=True))


def bench_gguf_vs(args: argparse.Namespace) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    kernels = {}
    for name, lib in _libraries(args.base).items():
        kernels[name] = {
            kind: getattr(lib, f"tandem_linear_{kind.lower()}") for kind in ("Q4_1", "Q8_0")
        }
        for fn in kernels[name].values():
            fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
            fn.restype = None
    shapes, panels = _gguf_weights()
    names = list(kernels)
    header = f"| rows | {names[0]} (median, best) | {names[1]} (median, best) | median ratio"
    print(header + " | same outputs |")
    print("|---:|---:|---:|---:|---|")
    for rows in args.rows:
        xs = {inp: torch.randn(rows, inp) for _, inp, _ in shapes}
        ys = {out: torch.empty(rows, out) for out, _, _ in shapes}
        calls = [(kind, xs[inp].data_ptr(), panel.data_ptr(), ys[out].data_ptr(), out, inp)
                 for (out, inp, kind), panel in zip(shapes, panels, strict=True)]  # fmt: skip

        def one_model(name: str, calls: list = calls, rows: int = rows) -> float:
            start = time.perf_counter()
            for kind, x, w, y, n, k in calls:
                kernels[name][kind](x, w, None, None, y, rows, n, k, args.threads)
            return (time.perf_counter() - start) * 1e3

        outputs = []
        for name in names:  # each library's outputs of every linear, to compare bit for bit
            one_model(name)
            outputs.append([y.clone() for y in ys.values()])
        same = all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
        times = _alternated(one_model, names, args.repeats)
        print(f"| {rows} | {_vs_cells(times)} | {'yes' if same else 'no'} |")


# (requests, queries each, keys each): decodes and verifications at c=1 and c=16.
ATTENTION_CASES = [(1, 1, 150), (1, 2, 150), (1, 3, 150), (1, 5, 150), (1, 1, 600), (1, 2, 600),
                   (1, 3, 600), (1, 1, 2000), (1, 2, 2000), (16, 1, 150), (16, 2, 150),
                   (16, 5, 150)]  # fmt: skip


def bench_attention_vs(args: argparse.Namespace) -> None:
    """The C kernel over all 30 layers (each its own cache) on BASE's kernels and this
    checkout's, alternated."""
    heads, kv_heads, head_dim, block = ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    kernels = {}
    for name, lib in _libraries(args.base).items():
        fn = kernels[name] = lib.tandem_paged_attention
        fn.argtypes = [ptr] * 8 + [ptr, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float]
        fn.argtypes += [ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    names = list(kernels)
    gen = torch.Generator().manual_seed(0)
    print(f"| requests | queries each | keys each | {names[0]} (median, best) | {names[1]} "
          "(median, best) | median ratio | same outputs |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|")
    for seqs, q_len, ctx in ATTENTION_CASES:
        caches, tables = _pass_caches(seqs, ctx, gen)
        per_seq = tables.shape[1]
        q_lens, ctx_lens = torch.full((seqs,), q_len), torch.full((seqs,), ctx)
        q_starts = torch.arange(seqs) * q_len
        query = torch.randn(seqs * q_len, heads, head_dim, generator=gen)
        out = torch.empty_like(query)
        table_args = (tables.data_ptr(), per_seq, q_starts.data_ptr(), q_lens.data_ptr(),
                      ctx_lens.data_ptr(), None, None, seqs, out.data_ptr())  # fmt: skip

        calls = [(query.data_ptr(), k.data_ptr(), v.data_ptr(), *table_args) for k, v in caches]

        def one_pass(name: str, calls: list = calls) -> float:
            start = time.perf_counter()
            for call in calls:
                status = kernels[name](
                    *call, heads, kv_heads, head_dim, block, 0.125, 0, args.threads
                )  # fmt: skip
                assert status == 0, status
            return (time.perf_counter() - start) * 1e3

        outputs = []
        for name in names:
            one_pass(name)
            outputs.append(out.clone())
        same = torch.equal(*outputs)
        times = _alternated(one_pass, names, args.repeats)
        print(f"| {seqs} | {q_len} | {ctx} | {_vs_cells(times)} | {'yes' if same else 'no'} |")


def _pass_caches(seqs: int, ctx: int, gen: torch.Generator) -> tuple[list, torch.Tensor]:
    """Each layer's own caches for `seqs` requests of `ctx` keys, and their block tables
    (scattered over the pool): a pass's keys and values come from memory, as in a real pass."""
    per_seq = -(-ctx // ATTN_BLOCK)
    shape = (seqs * per_seq, ATTN_BLOCK, ATTN_KV_HEADS, ATTN_HEAD_DIM)
    caches = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))
              for _ in range(ATTN_LAYERS)]  # fmt: skip
    return caches, torch.randperm(seqs * per_seq, generator=gen).view(seqs, per_seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["attention-vs", "gguf", "gguf-vs"])
    p.add_argument("base", nargs="?", default="HEAD", help="*-vs: the commit to compare with")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9, 16, 33, 64, 512])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu_memory.keep_freed_memory()  # as the engine runs
    if not cpu_kernels.available():
        raise SystemExit(f"the kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    print(f"{args.what}, {args.threads} thread(s), torch {torch.__version__}")
    run = {
        "attention-vs": bench_attention_vs,
        "gguf": bench_gguf,
        "gguf-vs": bench_gguf_vs,
    }
    run[args.what](args)


if __name__ == "__main__":
    main()
