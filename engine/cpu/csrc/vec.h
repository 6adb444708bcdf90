/* Tandem's CPU kernels (engine/cpu/csrc/*.c): what they share. Built together once per machine
 * by engine/cpu/build.py (cc -O3 -march=native -fopenmp) into one library called through
 * ctypes (engine/cpu/kernels.py); plain C with GCC/Clang vector extensions, so the same
 * source compiles to AVX2, AVX-512 or NEON code.
 *
 * Why: a decoding or verifying step multiplies every weight by a handful of rows and attends a
 * handful of queries per request. torch's CPU GEMMs are built for big matrices (on the default
 * pair, one AVX2 core, 5 rows cost 2x what 1 row costs) and its attention needs each
 * request's keys gathered into a dense tensor first. Here a weight is streamed from memory
 * once per call whatever the row count, and keys are read once, in place.
 *
 * Threads: each call takes its thread count from the caller (torch's); the OpenMP runtime is
 * the one torch already loaded (same soname), so both share one pool of workers.
 */
#ifndef TANDEM_VEC_H
#define TANDEM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))

/* How the GGUF linears take x (gemm_vnni.c): float32 (gemm_quant.c's kernel, AMX tiles from
 * AMX_MIN_ROWS rows), VNNI on x in 24-bit fixed point (as close as float32), or VNNI on x
 * rounded to int8 per block of 32 (every call, whatever its row count). */
#define VNNI_OFF 0
#define VNNI_EXACT 1
#define VNNI_INT8 2

INLINE v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* acc + a * b, rounded once on x86 machines with FMA. Without FMA (the x86-64 baseline) it is
 * a multiply and an add. On other machines it is the plain expression, which -ffp-contract
 * fuses where they have a multiply-add (NEON): that case is not pinned down. Every
 * accumulation that must give the same bits in each tile shape (a row alone or among others,
 * a verification's query or a decode) is written with it rather than left to -ffp-contract:
 * GCC keeps a loop's lone chain of multiply-adds as separate multiplies and adds on some
 * tunings (`--param avoid-fma-max-bits`, which -mtune=sapphirerapids sets in GCC 13) while it
 * fuses the tiles with several chains, and their bits then differ. */
#if defined(__FMA__)
#include <immintrin.h>
#endif
INLINE v8 madd(v8 acc, v8 a, v8 b) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  return acc + a * b;
#endif
}

/* 16 float32 lanes: one AVX-512 register, or two 8-lane halves. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
INLINE v16 splat16(float x) {
  return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
INLINE v16 madd16(v16 acc, v16 a, v16 b) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#else
  v8 h[3][2];
  memcpy(h[0], &acc, 64), memcpy(h[1], &a, 64), memcpy(h[2], &b, 64);
  for (int i = 0; i < 2; i++) h[0][i] = madd(h[0][i], h[1][i], h[2][i]);
  memcpy(&acc, h[0], 64);
  return acc;
#endif
}
INLINE v8 load(const float *p) { return *(const v8 *)p; }
INLINE void store(float *p, v8 v) { *(v8 *)p = v; } /* v8 is 4-byte aligned: any float * */
INLINE v8 select_v(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }
INLINE float hsum(v8 v) {
  float s = 0;
  for (int i = 0; i < 8; i++) s += v[i];
  return s;
}
/* An output row's n columns: row (+ bias) (+ residual), in that order, written to y. */
INLINE void put_row(float *row, int n, const float *bias, const float *res, float *y) {
  if (bias)
    for (int c = 0; c < n; c++) row[c] += bias[c];
  if (res)
    for (int c = 0; c < n; c++) row[c] += res[c];
  memcpy(y, row, (size_t)n * sizeof(float));
}
/* How many of `width` items starting at `start` exist among `total`: a panel group's panels,
 * a group's or a panel's columns (the last ones of a matrix are short). */
INLINE int span(int64_t total, int64_t start, int64_t width) {
  return (int)(total - start < width ? total - start : width);
}
/* Before block b of np panels `pstride` bytes apart, blocks of `bytes`: ask the outer caches
 * (prefetcht2) for block b + ahead of each, and on the first block for blocks 0..ahead as
 * well. Past a panel's last block (nb), the next tile's: the np panels that follow these,
 * where a worker's run of panels goes on (the GEMMs' guided schedule). A prefetch never
 * faults, so the last tile's, past the end of the matrix, is harmless. */
INLINE void prefetch_panels(const uint8_t *panel, int np, int64_t pstride, int64_t bytes,
                            int64_t b, int64_t nb, int ahead) {
  for (int64_t a = b == 0 ? 0 : b + ahead; a <= b + ahead; a++)
    for (int p = 0; p < np; p++) {
      const uint8_t *at = a < nb ? panel + p * pstride + a * bytes
                                 : panel + (np + p) * pstride + (a - nb) * bytes;
      for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + line, 0, 1);
    }
}

INLINE float hmax(v8 v) {
  float m = v[0];
  for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
  return m;
}

#if defined(__clang__)
#define EVEN(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define ODD(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15)
#else
#define EVEN(a, b) __builtin_shuffle(a, b, (v8i){0, 2, 4, 6, 8, 10, 12, 14})
#define ODD(a, b) __builtin_shuffle(a, b, (v8i){1, 3, 5, 7, 9, 11, 13, 15})
#endif

/* r[u] = sum of the lanes of x[u]: three rounds of pairwise adds. */
INLINE v8 reduce8(const v8 *x) {
  const v8 a = EVEN(x[0], x[1]) + ODD(x[0], x[1]), b = EVEN(x[2], x[3]) + ODD(x[2], x[3]);
  const v8 c = EVEN(x[4], x[5]) + ODD(x[4], x[5]), d = EVEN(x[6], x[7]) + ODD(x[6], x[7]);
  const v8 ab = EVEN(a, b) + ODD(a, b), cd = EVEN(c, d) + ODD(c, d);
  return EVEN(ab, cd) + ODD(ab, cd);
}

/* exp(x), Cephes' expf polynomial, within 2 ulp. Below -87 (masked keys, -inf, included)
 * the result is exactly 0; inputs past 88 are taken as 88 (exp(88) ~ 1.7e38). Defined for 8
 * lanes (exp_v) and for 16 (exp16: one AVX-512 register where the machine has them, two
 * 8-lane halves elsewhere), the same operations lane by lane. */
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
#define DEFINE_EXP(name, V, VI, SPLAT)                                                        \
  INLINE V name(V x) {                                                                        \
    const VI dead = x < SPLAT(-87.0f), big = x > SPLAT(88.0f);                                \
    x = (V)((VI)x & ~dead);                                                                   \
    x = (V)(((VI)SPLAT(88.0f) & big) | ((VI)x & ~big));                                       \
    const V fx = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);                               \
    V n = __builtin_convertvector(__builtin_convertvector(fx, VI), V);                        \
    n -= (V)((VI)SPLAT(1.0f) & (n > fx)); /* floor */                                         \
    x = x - n * SPLAT(0.693359375f) + n * SPLAT(2.12194440e-4f);                              \
    V y = SPLAT(1.9875691500e-4f);                                                            \
    y = y * x + SPLAT(1.3981999507e-3f);                                                      \
    y = y * x + SPLAT(8.3334519073e-3f);                                                      \
    y = y * x + SPLAT(4.1665795894e-2f);                                                      \
    y = y * x + SPLAT(1.6666665459e-1f);                                                      \
    y = y * x + SPLAT(5.0000001201e-1f);                                                      \
    y = y * x * x + x + SPLAT(1.0f);                                                          \
    const VI scale = (__builtin_convertvector(n, VI) + 127) << 23; /* 2^n */                  \
    return (V)((VI)(y * (V)scale) & ~dead);                                                   \
  }
DEFINE_EXP(exp_v, v8, v8i, splat)
DEFINE_EXP(exp16, v16, v16i, splat16)

/* ---------------------------------------------------------------------------------------
 * KV cache elements (engine/cpu/kernels.py KV_TYPES): float32, or 16 bits (float16 as llama.cpp
 * keeps its cache by default, or bfloat16) widened exactly to float32 as they are loaded and
 * rounded to nearest even as they are stored, as torch's .to() rounds. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_BF16P = 3 };
/* KV_BF16P: bfloat16 in attention_pairs.c's layout, read by its dot products alone (not by
 * load_kv / kv_at / store_kv); layer.c's tandem_rotary_cache writes it. Its task functions,
 * tandem_attend_pairs_<head size>, take attention.c's task (attend_tile's parameters). */
#define PAIRS_PARAMS                                                                          \
  const float *q, const void *k_cache, const void *v_cache, const int64_t *table,             \
      int64_t q_start, int64_t q_len, int64_t ctx, const int64_t *tree, int64_t base,         \
      int64_t kv_head, int64_t row0, int rows, int64_t heads, int64_t kv_heads,               \
      int64_t block_size, float scale, int64_t b_lo, int64_t b_hi, float *part
#define PAIRS_DIMS(X) X(32) X(64) X(96) X(128)
/* attention.c's SPLIT_KEYS on a KV_BF16P cache: its tasks score so much faster that a span's
 * fixed costs (one softmax a row, a partial result to merge) weigh more; at 256 a long
 * context still splits into several spans. attention_pairs.c sizes its buffers by it. */
#define PAIRS_SPLIT_KEYS 256
typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2)));

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

INLINE float half_to_float(uint16_t h) { /* IEEE binary16 -> binary32, exact */
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13); /* inf, NaN */
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (!man) bits = sign; /* +-0 */
  else { /* subnormal: man * 2^-24 is exact in float32 */
    float f = (float)man * 5.9604644775390625e-8f;
    memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

INLINE uint16_t float_to_half(float f) { /* round to nearest even; overflow -> inf */
#ifdef __F16C__
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00 | (uint16_t)((ax >> 13) & 0x3ff); /* NaN */
  if (ax >= 0x477ff000) return sign | 0x7c00; /* rounds past 65504: inf */
  if (ax < 0x38800000) { /* a subnormal half (or 0): scale so the half's step is 1, round */
    float a;
    memcpy(&a, &ax, 4);
    return sign | (uint16_t)__builtin_rintf(a * 16777216.0f); /* rint: nearest even */
  }
  const uint32_t rounded = ax + 0xfff + ((ax >> 13) & 1); /* nearest even on the cut bits */
  return sign | (uint16_t)((rounded - 0x38000000) >> 13);
#endif
}

INLINE uint16_t float_to_bf16(float f) { /* round to nearest even; NaN -> 0x7fc0, as torch */
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* 8 consecutive cache elements from element i of `base`, as float32. */
INLINE v8 load_kv(const int kv, const void *base, int64_t i) {
  if (kv == KV_F32) return load((const float *)base + i);
  const v8u16 h = *(const v8u16 *)((const uint16_t *)base + i);
#ifdef __AVX2__
  if (kv == KV_BF16) return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
#else
  if (kv == KV_BF16) return (v8)(__builtin_convertvector(h, v8i) << 16);
#endif
#ifdef __F16C__
  return (v8)_mm256_cvtph_ps((__m128i)h);
#else
  v8 out;
  for (int j = 0; j < 8; j++) out[j] = half_to_float(h[j]);
  return out;
#endif
}

/* One cache element, as float32 (the scalar widening; tests/test_kv_cache_dtype.py builds it). */
INLINE float kv_at(const int kv, const void *base, int64_t i) {
  if (kv == KV_F32) return ((const float *)base)[i];
  const uint16_t h = ((const uint16_t *)base)[i];
  if (kv == KV_BF16) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  return half_to_float(h);
}

/* n float32 values into the cache at element i of `base`. */
INLINE void store_kv(const int kv, void *base, int64_t i, const float *x, int64_t n) {
  if (kv == KV_F32) memcpy((float *)base + i, x, (size_t)n * sizeof(float));
  else if (kv == KV_BF16)
    for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = float_to_bf16(x[j]);
  else
    for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = float_to_half(x[j]);
}

#endif
