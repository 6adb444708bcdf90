"""Tandem's CPU kernels (engine/cpu/csrc), loaded once and wrapped for ctypes; without a C
compiler the engine keeps torch's paths (`unavailable_reason()`). Float32; GIL released."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

import torch

from engine.cpu import build as kernel_build
from engine.cpu.panels import panel_format

logger = logging.getLogger(__name__)

MAX_BLOCK = 256  # longest KV block the attention kernel takes: MAX_BLOCK in attention.c
PAIRS = torch.int16  # a KV cache of bfloat16 pairs: engine/cpu/pairs.py


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    return _loaded()[1]


def load() -> ctypes.CDLL | None:
    """The kernel library, built and loaded on first use; None when it cannot be."""
    return _loaded()[0]


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return _declare(ctypes.CDLL(str(kernel_build.build()))), None
    except (OSError, RuntimeError) as exc:
        logger.warning("Tandem's CPU kernels are unavailable, using torch's: %s", exc)
        return None, str(exc)


def isa() -> str | None:
    """The kernels' ISA (avx512f, avx2+fma, neon...), `+vnni`/`+amx` when in use, or None."""
    lib = load()
    if lib is None:
        return None
    vnni = ("", "+vnni", "+vnni-int8")[lib.tandem_vnni_active()]
    return lib.tandem_isa().decode() + vnni + ("+amx" if lib.tandem_amx_active() else "")


def set_amx(enabled: bool) -> bool:
    """AMX for the GGUF linears where the CPU allows (`TANDEM_AMX=0`: off); whether now on."""
    return bool(require().tandem_amx_enable(int(enabled)))


def set_vnni(enabled: bool) -> bool:
    """VNNI for the GGUF linears where the CPU has it (off unless `TANDEM_VNNI=1`, gemm_vnni.c
    says why); whether now on."""
    return bool(require().tandem_vnni_enable(int(enabled)))


ACTIVATIONS = ("float32", "int8")
"""How the GGUF linears take their input rows: float32, or rounded to int8 per block of 32
(integer dot products on VNNI: gemm_vnni.c; a change of the served model's numbers)."""

_activations = "float32"


def activations() -> str:
    """The mode the GGUF linears run in now (process-wide)."""
    return _activations


def use_activations(mode: str) -> bool:
    """Switch the GGUF linears to `mode` (ACTIVATIONS) process-wide for the calls that follow;
    whether the CPU can (int8 needs AVX-512 VNNI; float32 keeps `TANDEM_VNNI=1`'s path)."""
    global _activations
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, not {mode!r}")
    lib = require()
    if mode == "float32":
        lib.tandem_vnni_enable(int(os.environ.get("TANDEM_VNNI") == "1"))
    elif lib.tandem_vnni_enable(2) != 2:
        return False
    _activations = mode
    return True


_KERNELS = {
    "float32": "tandem_linear",
    "bfloat16": "tandem_linear_bf16",
    "Q8_0": "tandem_linear_q8_0",
    "Q4_1": "tandem_linear_q4_1",
}


def linear(
    x: torch.Tensor,  # [rows, in] float32, contiguous
    panels: torch.Tensor,  # pack_linear_weight(weight) or pack_quant_weight(blocks, quant)
    bias: torch.Tensor | None,  # [out] float32, contiguous
    out_features: int,
    residual: torch.Tensor | None = None,  # [rows, out] float32, contiguous: added, in place
    quant: str | None = None,  # the GGUF type of quantized panels
) -> torch.Tensor:  # [rows, out]: x @ weight.T + bias (+ residual, which is then returned)
    lib = require()
    x = x.contiguous()
    rows, in_features = x.shape
    out = residual if residual is not None else torch.empty(rows, out_features)
    kernel = getattr(lib, _KERNELS[panel_format(panels, quant)])
    if rows:
        kernel(
            x.data_ptr(),
            panels.data_ptr(),
            _ptr(bias),
            _ptr(residual),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, dim] float32 -> RMSNorm(x) * weight, a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    require().tandem_rms_norm(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] fused gate/up output -> silu(gate) * up [rows, inter]."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    require().tandem_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def rotary_cache(
    qkv: torch.Tensor,  # [tokens, (heads + 2 kv_heads) * head_dim] float32, contiguous
    positions: torch.Tensor,  # [tokens] int64
    slots: torch.Tensor,  # [tokens] int64 cache slots
    cos: torch.Tensor,  # [positions, head_dim] float32
    sin: torch.Tensor,
    heads: int,
    key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], a KV_TYPES dtype
    value_cache: torch.Tensor,
) -> torch.Tensor:  # q [tokens, heads, head_dim], rotated
    """Rotary embedding on q and k (rotate-half); k and v written to their cache slots
    (rounded to nearest even into a 16-bit cache, as torch's `.to()` rounds)."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim)
    require().tandem_rotary_cache(
        qkv.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        heads,
        kv_heads,
        head_dim,
        q.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_type(key_cache.dtype),
        key_cache.shape[1],
    )
    return q


KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, PAIRS: 3}
"""The KV cache dtypes the attention kernel reads (KV_F32, KV_F16, KV_BF16, KV_BF16P in vec.h)."""


def kv_type(dtype: torch.dtype) -> int:
    if dtype not in KV_TYPES:
        raise ValueError(f"the CPU attention kernel does not read a {dtype} KV cache")
    return KV_TYPES[dtype]


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def attention_supports(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether `paged_attention` takes these shapes (head_dim 32/64/128, blocks <= 256)."""
    return bool(require().tandem_attention_supports(heads, kv_heads, head_dim, block_size))


OUT_OF_MEMORY = -2
"""What the attention kernel (and the layer stack around it) returns when it cannot allocate."""


def paged_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim] float32, contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], a KV_TYPES dtype
    value_cache: torch.Tensor,
    tables: torch.Tensor,  # [num_seqs, width] int64 block ids
    q_starts: torch.Tensor,  # [num_seqs] int64: first row of each request in query
    q_lens: torch.Tensor,  # [num_seqs] int64
    ctx_lens: torch.Tensor,  # [num_seqs] int64: keys each request attends (new ones included)
    scale: float,
    out: torch.Tensor,  # [tokens, heads, head_dim]: the requests' rows are written
    tree: torch.Tensor | None = None,  # [tokens] int64 draft-tree bits (0 = causal) or None
    tree_base: torch.Tensor | None = None,  # [num_seqs] int64 slot of bit 0, with tree
) -> None:
    lib = require()
    _, block_size, kv_heads, head_dim = key_cache.shape
    status = lib.tandem_paged_attention(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        ctx_lens.data_ptr(),
        _ptr(tree),
        _ptr(tree_base),
        tables.shape[0],
        out.data_ptr(),
        query.shape[1],
        kv_heads,
        head_dim,
        block_size,
        scale,
        kv_type(key_cache.dtype),
        torch.get_num_threads(),
    )
    if status == OUT_OF_MEMORY:
        raise MemoryError("the CPU attention kernel could not allocate its partial results")
    if status != 0:
        raise ValueError(
            f"the CPU attention kernel does not take heads={query.shape[1]}, "
            f"kv_heads={kv_heads}, head_dim={head_dim}, block_size={block_size}"
        )


def require() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"Tandem's CPU kernels are unavailable: {unavailable_reason()}")
    return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    quant = (lib.tandem_linear_q8_0, lib.tandem_linear_q4_1)
    for linear in (lib.tandem_linear, lib.tandem_linear_bf16, *quant):
        linear.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
        linear.restype = None
    lib.tandem_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.tandem_rms_norm.restype = None
    lib.tandem_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.tandem_silu_mul.restype = None
    lib.tandem_rotary_cache.argtypes = [ptr] * 5 + [i64] * 4 + [ptr] * 3 + [i32, i64]
    lib.tandem_rotary_cache.restype = None
    lib.tandem_attention_supports.argtypes = [i64, i64, i64, i64]
    lib.tandem_attention_supports.restype = i32
    lib.tandem_attention_pairs.argtypes = [i64, i64]
    lib.tandem_attention_pairs.restype = i32
    lib.tandem_paged_attention.argtypes = (
        [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr]
        + [i64] * 4
        + [ctypes.c_float, i32, i32]
    )
    lib.tandem_paged_attention.restype = i32
    head = [ptr, ptr, ctypes.c_float, i64, ptr]  # with the final norm: tandem_layers' tail
    lib.tandem_layers.argtypes = (
        [ptr, i64, ptr, ptr] + [i64] * 6 + [ctypes.c_float] * 2 + [ptr, i32] + head
    )
    lib.tandem_layers.restype = i32
    lib.tandem_sample_rows.argtypes = [ptr, ptr, i64, i64, ptr, i32]
    lib.tandem_sample_logits.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i32]
    lib.tandem_sample_final.argtypes = [ptr] * 7 + [i64, i64, ptr, i32]
    lib.tandem_verify_sampled.argtypes = [ptr] * 7 + [i32, i64, i64, ptr, ptr, i32]
    lib.tandem_sample_head.argtypes = [ptr] * 4 + [i64] * 3 + [ptr] * 3 + [i32]
    lib.tandem_race_rows.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i32]
    samplers = ("rows", "logits", "final", "head")
    for name in [f"sample_{s}" for s in samplers] + ["verify_sampled", "race_rows"]:
        getattr(lib, f"tandem_{name}").restype = None  # wrapped in engine/cpu/sampling.py
    lib.tandem_isa.argtypes = []
    lib.tandem_isa.restype = ctypes.c_char_p
    for unit in ("amx", "vnni"):  # tandem_amx_active(), tandem_amx_enable(int), ...
        getattr(lib, f"tandem_{unit}_active").argtypes = []
        getattr(lib, f"tandem_{unit}_enable").argtypes = [i32]
        getattr(lib, f"tandem_{unit}_active").restype = i32
        getattr(lib, f"tandem_{unit}_enable").restype = i32
    return lib


class Weight(ctypes.Structure):
    """A packed linear for `layers` (tandem_weight in layer.c)."""

    _fields_ = [("panels", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("format", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """One decoder layer's weights and KV cache for `layers` (tandem_layer in layer.c)."""

    _fields_ = [
        ("qkv", Weight),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
    ]


class Batch(ctypes.Structure):
    """The batch's positions, cache slots and attention layout (tandem_batch in layer.c)."""

    _fields_ = [
        ("positions", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("q_starts", ctypes.c_void_p),
        ("q_lens", ctypes.c_void_p),
        ("ctx_lens", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("tree", ctypes.c_void_p),
        ("tree_base", ctypes.c_void_p),
        ("kv_type", ctypes.c_int64),
    ]


WEIGHT_FORMATS = {"float32": 0, "bfloat16": 1, "Q8_0": 2, "Q4_1": 3}
"""tandem_weight.format: the panels of pack_linear_weight or pack_quant_weight."""


def weight(panels: torch.Tensor, bias: torch.Tensor | None, quant: str | None) -> Weight:
    """A packed linear's panels (kept alive by the caller) as a `Weight`."""
    return Weight(panels.data_ptr(), _ptr(bias), WEIGHT_FORMATS[panel_format(panels, quant)])


def layers(
    stack: ctypes.Array,  # of Layer, one per decoder layer in order
    batch: Batch,
    hidden: torch.Tensor,  # [tokens, dim] float32, contiguous: updated in place
    shape: tuple[int, int, int, int],  # heads, kv_heads, head_dim, intermediate size
    eps: float,
    scale: float,
    head: tuple[Weight, torch.Tensor, float, int] | None = None,
    scratch: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Every layer of a Llama-family model over `hidden` in one call, as engine/model/native/
    llama.py's kernels compute it. `head` (LM head Weight, final norm weight, eps, width): its
    logits [tokens, width] are returned. `scratch(n)`: >= n float32s, or None."""
    heads, kv_heads, head_dim, inter = shape
    tokens, dim = hidden.shape
    floats = tokens * (dim + (3 * heads + 2 * kv_heads) * head_dim + 3 * inter)
    buffer = scratch(floats) if scratch is not None else torch.empty(floats)
    logits, tail = None, (None, None, 0.0, 0, None)
    if head is not None:
        logits = torch.empty(tokens, head[3])
        tail = (ctypes.addressof(head[0]), head[1].data_ptr(), head[2], head[3], logits.data_ptr())
    status = require().tandem_layers(
        ctypes.addressof(stack),
        len(stack),
        ctypes.addressof(batch),
        hidden.data_ptr(),
        tokens,
        dim,
        heads,
        kv_heads,
        head_dim,
        inter,
        eps,
        scale,
        buffer.data_ptr(),
        torch.get_num_threads(),
        *tail,
    )
    if status == OUT_OF_MEMORY:
        raise MemoryError("the CPU attention kernel could not allocate its partial results")
    if status != 0:
        raise ValueError(
            f"the CPU attention kernel does not take heads={heads}, kv_heads={kv_heads}, "
            f"head_dim={head_dim}, block_size={batch.block_size}"
        )
    return logits
