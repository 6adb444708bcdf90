#include "vec.h"
#include <stdlib.h>

/* ---------------------------------------------------------------------------------------
 * Linear on GGUF-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ residual),
 * W kept in its GGUF quantization, the sums in float32.
 *
 * GGUF stores W row by row in blocks of 32 consecutive weights with their own scale:
 *   Q8_0: w = d * q,      q an int8, d a float16;
 *   Q4_1: w = d * q + m,  q a 4-bit unsigned, d and m float16.
 * Per block and row of x the kernel sums q * x (q widened to float32: exact), then
 *   y += d * sum_k q_k x_k  (+ m * sum_k x_k for Q4_1, the row's block sums computed once)
 * which is sum_k w_k x_k for the file's weights, rounded in another order than a float32
 * matrix of the dequantized weights would be (as close to the exact sum in
 * tests/test_cpu_kernels.py, from a few blocks on closer). No weight is dequantized: per 16
 * weights a mask and a conversion (Q4_1) widen the quants, and each row of x costs one
 * multiply-add (dequantizing w = d * q + m first would cost one more per 16 weights).
 * Every tile shape sums a row the same way, so a row's result does not depend on the others.
 * engine/cpu/panels.py repacks the blocks once into panels of QPANEL output rows, so a
 * vector lane is an output column (as in gemm.c) and one unpacked vector of weights serves
 * every row of x:
 *   Q8_0 panel block: d[16] float16, then for k = 0..31: q[16] int8 (column c at byte c);
 *   Q4_1 panel block: d[16], m[16] float16, then for k = 0..31: 8 bytes, even columns in
 *                     the low 32-bit word, odd ones in the high (column c's nibble at bits
 *                     32 * (c % 2) + 4 * (c / 2)), so one 64-bit broadcast and one mask
 *                     unpack all 16, each times a power of 2 that the scales undo
 *                     (q4_quants).
 * The scales stay the file's float16 and are widened in registers (exact), so the kernel
 * reads the file's own 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of float32's 32 (widened
 * scales were a sixth more bytes). A one-row pass is then bound by the memory or by these
 * instructions, depending on the machine.
 */
#define QPANEL 16
#define QBLOCK 32
/* Rows of x per tile: each tile unpacks the panel's weights once. AVX-512 has 32 vector
 * registers, AVX2 16 (two per 16-lane vector): 8 rows and 4. */
#if defined(__AVX512F__)
#define QROWS 8
#else
#define QROWS 4
#endif
/* A tile takes several panels side by side (tile_panels): with few rows, one accumulator per
 * row would be one chain of dependent adds, each waiting for the one before (4 cycles), and
 * the panels' chains are independent. Each output is still summed over k in the same order.
 * QGROUP is the most panels a tile (and a thread's work item) takes. */
#define QGROUP 4
/* Blocks ahead whose weights a tile prefetches (see prefetch_blocks). */
#define QAHEAD 4

typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef uint64_t v8q __attribute__((vector_size(64), aligned(8)));

INLINE v16 load16(const float *p) { return *(const v16 *)p; }
INLINE void store16(float *p, v16 v) { *(v16 *)p = v; }

enum { Q8_0 = 0, Q4_1 = 1 };

INLINE int64_t block_bytes(const int type) {
  return type == Q4_1 ? 2 * QPANEL * 2 + QBLOCK * 8 : QPANEL * 2 + QBLOCK * QPANEL;
}

INLINE int64_t scale_bytes(const int type) { return (type == Q4_1 ? 2 : 1) * QPANEL * 2; }

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif /* else vec.h's half_to_float widens each scale */

/* The 16 float16 scales at p (one per column) as float32. */
INLINE v16 load_halves(const uint8_t *p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
  v16 out;
  memcpy(&out, &lo, 32);
  memcpy((char *)&out + 32, &hi, 32);
  return out;
#else
  v16 out;
  for (int c = 0; c < 16; c++) {
    uint16_t h;
    memcpy(&h, p + 2 * c, 2);
    out[c] = half_to_float(h);
  }
  return out;
#endif
}

/* out[i] = all[idx[i] % 16]: one permute instruction (which reads an index's low 4 bits). */
INLINE v16u spread(v16u all, v16u idx) {
#if defined(__clang__)
  v16u out;
  for (int i = 0; i < 16; i++) out[i] = all[idx[i] & 15];
  return out;
#else
  return __builtin_shuffle(all, idx);
#endif
}

/* Q8_0: the 16 quants of quant row j of a 64-byte load (rows j0..j0+3), one per output
 * column, as float32. Row j is words 4j..4j+3; column c's int8 is byte c % 4 of word
 * 4j + c / 4: one permute, then a shift to the top and back (arithmetic) sign-extends.
 * (GCC 12 turns a plain int8 -> int32 vector conversion into a chain of inserts.) Used where
 * the CPU has neither AVX-512 nor AVX2 (AVX2: quants_avx2). */
INLINE v16 q8_quants(v16u all, int j) {
  const uint32_t a = 4 * j, b = a + 1, c = a + 2, e = a + 3;
  const v16u word = spread(all, (v16u){a, a, a, a, b, b, b, b, c, c, c, c, e, e, e, e});
  const v16u up = {24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0};
  const v16i q = (v16i)(word << up) >> 24;
  return __builtin_convertvector(q, v16);
}

#if defined(__AVX512F__)
/* Q8_0 with AVX-512: the 16 quants of quant row k (16 int8s, one per column) as float32:
 * one sign-extending load and one conversion. */
INLINE v16 q8_quants_row(const uint8_t *quants, int k) {
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(quants + k * 16)));
  return (v16)_mm512_cvtepi32_ps(q);
}
#endif

/* Q4_1: the 16 quants of quant row k (8 bytes: a nibble per column) as float32, each left
 * where it lies: column c's quant times 2^s, s = 4 * (c / 2) (Q4_SCALE undoes it, see below).
 * A 64-bit broadcast puts row k's low 32-bit word (even columns) in the even lanes and its
 * high word (odd columns) in the odd ones; one mask keeps each lane's nibble and one unsigned
 * conversion makes it a float (q * 2^s < 2^32 has 4 significant bits: exact). The block's
 * sums of q * 2^s * x are then 2^s times the sums of q * x, rounded alike (a power of 2
 * scales each rounding exactly), and the block's scale d times 2^-s (exact) undoes it: the
 * same bits as shifting each nibble down first (unless a block's sum of q * x passes 2^100,
 * where 2^s times it overflows; as the AVX2 tile below). The mask gives the same bits as
 * shifting each nibble down, without a shift and a permute per 16 weights. */
INLINE v16 q4_quants(const uint8_t *quants, int k) {
  uint64_t bytes;
  memcpy(&bytes, quants + k * 8, 8);
  const v16u word = (v16u)(v8q){bytes, bytes, bytes, bytes, bytes, bytes, bytes, bytes};
  const v16u nibble = {15,       15,       15 << 4,  15 << 4,  15 << 8,  15 << 8,
                       15 << 12, 15 << 12, 15 << 16, 15 << 16, 15 << 20, 15 << 20,
                       15 << 24, 15 << 24, 15u << 28, 15u << 28};
  return __builtin_convertvector(word & nibble, v16);
}

/* Per column c, 2^-s: what turns a sum of q4_quants' scaled quants back into one of q. */
#define Q4_SCALE                                                                       \
  (v16) {                                                                              \
    1.0f, 1.0f, 0x1p-4f, 0x1p-4f, 0x1p-8f, 0x1p-8f, 0x1p-12f, 0x1p-12f, 0x1p-16f, 0x1p-16f, \
        0x1p-20f, 0x1p-20f, 0x1p-24f, 0x1p-24f, 0x1p-28f, 0x1p-28f                      \
  }

/* Before block b of np panels `pstride` bytes apart: ask for block b + QAHEAD of each, and on
 * the first block for blocks 0..QAHEAD as well. A tile reads its panels as np streams that
 * each cross a 4 KiB page every 13 (Q4_1) or 8 (Q8_0) blocks, where the hardware prefetcher
 * (likely) loses them, and a tile of few rows does too little work per block to hide a miss.
 * The hint is for the outer caches (prefetcht2), not L1: blocks of several panels ahead are
 * more lines than L1 keeps in flight, and there they would hold up the tile's loads. */
INLINE void prefetch_blocks(const int type, const int np, const uint8_t *panel,
                            int64_t pstride, int64_t b, int64_t nb) {
  prefetch_panels(panel, np, pstride, block_bytes(type), b, nb, QAHEAD);
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
/* AVX2 (no AVX-512): a panel's 16 columns are two 8-lane vectors, h = 0 (columns 0-7) and
 * h = 1 (8-15), and the quants are widened with AVX2's own instructions. Written with the
 * 16-lane types, as below, GCC splits each vector through the stack on AVX2, far slower.
 * Same products, sums and order per column. */
#define HALF 8

/* Q8_0: row k's 16 quants (16 int8s), as float32, in two halves. */
INLINE void q8_quants_avx2(const uint8_t *quants, int k, v8 q[2]) {
  for (int h = 0; h < 2; h++) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(quants + k * QPANEL + h * HALF));
    q[h] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}

/* Q4_1: row k's 16 quants in two halves, each quant left where it lies, times 2^s:
 * columns 0-7 use bits 0-15 of the row's two 32-bit words and columns 8-15 bits 16-31
 * (column c's nibble at bit 32 * (c % 2) + 4 * (c / 2)), so a 64-bit broadcast of the row
 * (columns 0-7) or of the row read 2 bytes on (8-15: bits 16-31 moved to 0-15) and one mask
 * of nibble j of lanes 2j and 2j + 1 give q * 2^s with s = 0, 0, 4, 4, 8, 8, 12, 12 in both
 * halves: exact as int32 (q * 2^12 < 2^16) and as float32. A column's block sum is then 2^s
 * times the sum of q * x, rounded alike (a power of 2 scales each rounding exactly), and the
 * block's scale d times 2^-s (Q4_SUM_SCALE, exact) undoes it: the same bits as shifting each
 * nibble down first, one shift per half and row of quants fewer (unless a block's sum of q * x
 * passes 2^116, where 2^s times it overflows). The last row of a block shifts its own
 * broadcast instead (`last`), so no read passes the block. */
#define Q4_SUM_SCALE \
  (v8) { 1.0f, 1.0f, 0x1p-4f, 0x1p-4f, 0x1p-8f, 0x1p-8f, 0x1p-12f, 0x1p-12f }
INLINE void q4_quants_avx2(const uint8_t *quants, int k, const int last, v8 q[2]) {
  const __m256i nibble = _mm256_setr_epi32(15, 15, 15 << 4, 15 << 4, 15 << 8, 15 << 8,
                                           15 << 12, 15 << 12);
  const uint8_t *row = quants + k * 8;
  const __m256i lo = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)row));
  const __m256i hi = last ? _mm256_srli_epi64(lo, 16)
                          : _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(row + 2)));
  q[0] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(lo, nibble));
  q[1] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(hi, nibble));
}

/* The 16 float16 scales at p in two halves. */
INLINE void halves_avx2(const uint8_t *p, v8 out[2]) {
  for (int h = 0; h < 2; h++)
    out[h] = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + h * 2 * HALF)));
}

/* One quant row k of the tile's panels into the rows' block sums (`last`: k is the block's
 * last row, q4_quants_avx2). */
INLINE void quant_step(const int type, const int np, const int rows, const float *xb, int64_t K,
                       const uint8_t *const *quants, int k, const int last,
                       v8 sum[QGROUP][QROWS][2]) {
  for (int p = 0; p < np; p++) {
    v8 q[2];
    if (type == Q4_1) q4_quants_avx2(quants[p], k, last, q);
    else q8_quants_avx2(quants[p], k, q);
    for (int r = 0; r < rows; r++) {
      const v8 xk = splat(xb[r * K + k]);
      sum[p][r][0] = madd(sum[p][r][0], xk, q[0]);
      sum[p][r][1] = madd(sum[p][r][1], xk, q[1]);
    }
  }
}

/* quant_tile below, on AVX2. */
INLINE void quant_tile(const int type, const int np, const int rows, const float *x, int64_t K,
                       const float *xsum, const uint8_t *panel, int64_t pstride,
                       const float *bias, const float *res, float *y, int64_t N, int cols) {
  v8 acc[QGROUP][QROWS][2];
  for (int p = 0; p < np; p++)
    for (int r = 0; r < rows; r++) acc[p][r][0] = acc[p][r][1] = splat(0.0f);
  const int64_t stride = block_bytes(type), nb = K / QBLOCK;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *quants[QGROUP];
    v8 sum[QGROUP][QROWS][2];
    for (int p = 0; p < np; p++) {
      quants[p] = panel + p * pstride + b * stride + scale_bytes(type);
      for (int r = 0; r < rows; r++) sum[p][r][0] = sum[p][r][1] = splat(0.0f);
    }
    prefetch_blocks(type, np, panel, pstride, b, nb);
    const float *xb = x + b * QBLOCK;
    for (int k = 0; k < QBLOCK - 1; k++) quant_step(type, np, rows, xb, K, quants, k, 0, sum);
    quant_step(type, np, rows, xb, K, quants, QBLOCK - 1, 1, sum);
    for (int p = 0; p < np; p++) {
      const uint8_t *blk = panel + p * pstride + b * stride;
      v8 d[2], m[2];
      halves_avx2(blk, d);
      if (type == Q4_1) d[0] *= Q4_SUM_SCALE, d[1] *= Q4_SUM_SCALE;
      for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) acc[p][r][h] = madd(acc[p][r][h], d[h], sum[p][r][h]);
      if (type == Q4_1) {
        halves_avx2(blk + 2 * QPANEL, m);
        for (int r = 0; r < rows; r++)
          for (int h = 0; h < 2; h++)
            acc[p][r][h] = madd(acc[p][r][h], m[h], splat(xsum[r * nb + b]));
      }
    }
  }
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * QPANEL, QPANEL);
    for (int r = 0; r < rows; r++) {
      float row[QPANEL];
      store(row, acc[p][r][0]);
      store(row + HALF, acc[p][r][1]);
      put_row(row, n, bias ? bias + p * QPANEL : 0, res ? res + r * N + p * QPANEL : 0,
              y + r * N + p * QPANEL);
    }
  }
}
#else
/* y[rows, the columns of np panels], the panels `pstride` bytes apart. Per block, each
 * row's sum of q * x over the block's 32 k (q the quants as float32: exact), then
 *   total += d * sum (+ m * the block's sum of x, Q4_1)
 * xsum: row r's block sums of x at xsum[r * K / 32 + block] (Q4_1). */
INLINE void quant_tile(const int type, const int np, const int rows, const float *x, int64_t K,
                       const float *xsum, const uint8_t *panel, int64_t pstride,
                       const float *bias, const float *res, float *y, int64_t N, int cols) {
  v16 acc[QGROUP][QROWS];
  for (int p = 0; p < np; p++)
    for (int r = 0; r < rows; r++) acc[p][r] = (v16){0};
  const int64_t stride = block_bytes(type), nb = K / QBLOCK;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *quants[QGROUP];
    v16 sum[QGROUP][QROWS];
    for (int p = 0; p < np; p++) {
      quants[p] = panel + p * pstride + b * stride + scale_bytes(type);
      for (int r = 0; r < rows; r++) sum[p][r] = (v16){0};
    }
    prefetch_blocks(type, np, panel, pstride, b, nb);
    const float *xb = x + b * QBLOCK;
    if (type == Q4_1) {
      for (int k = 0; k < QBLOCK; k++)
        for (int p = 0; p < np; p++) {
          const v16 q = q4_quants(quants[p], k);
          for (int r = 0; r < rows; r++) sum[p][r] = madd16(sum[p][r], splat16(xb[r * K + k]), q);
        }
    } else {
#if defined(__AVX512F__)
      for (int k = 0; k < QBLOCK; k++)
        for (int p = 0; p < np; p++) {
          const v16 q = q8_quants_row(quants[p], k);
          for (int r = 0; r < rows; r++) sum[p][r] = madd16(sum[p][r], splat16(xb[r * K + k]), q);
        }
#else
      for (int k0 = 0; k0 < QBLOCK; k0 += 4) {
        v16u all[QGROUP];
        for (int p = 0; p < np; p++) all[p] = *(const v16u *)(quants[p] + k0 * QPANEL);
        for (int j = 0; j < 4; j++)
          for (int p = 0; p < np; p++) {
            const v16 q = q8_quants(all[p], j);
            for (int r = 0; r < rows; r++)
              sum[p][r] = madd16(sum[p][r], splat16(xb[r * K + k0 + j]), q);
          }
      }
#endif
    }
    for (int p = 0; p < np; p++) {
      const uint8_t *blk = panel + p * pstride + b * stride;
      const v16 d = type == Q4_1 ? load_halves(blk) * Q4_SCALE : load_halves(blk);
      for (int r = 0; r < rows; r++) acc[p][r] = madd16(acc[p][r], d, sum[p][r]);
      if (type == Q4_1) {
        const v16 m = load_halves(blk + 2 * QPANEL);
        for (int r = 0; r < rows; r++)
          acc[p][r] = madd16(acc[p][r], m, splat16(xsum[r * nb + b]));
      }
    }
  }
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * QPANEL, QPANEL);
    for (int r = 0; r < rows; r++) {
      float row[QPANEL];
      store16(row, acc[p][r]);
      put_row(row, n, bias ? bias + p * QPANEL : 0, res ? res + r * N + p * QPANEL : 0,
              y + r * N + p * QPANEL);
    }
  }
}
#endif

/* Panels per tile of `rows` rows. A row and panel has two accumulators, the block's sum and
 * the total; the totals are touched once a block, so where the registers run short (AVX-512
 * from 3 rows of 4 panels) the compiler keeps them in memory for little. More panels share
 * each row's loads until the accumulators outgrow the registers: AVX-512 4 panels up to 4
 * rows, AVX2 (16 registers) 2 up to 2 rows; 1 beyond (`python -m bench.cpu_kernels gguf`). */
INLINE int tile_panels(const int rows) {
#if QROWS == 8
  return rows <= 4 ? 4 : 2;
#else
  return rows <= 2 ? 2 : 1;
#endif
}

/* One group of np panels (all rows of x): the unrolled tiles. */
INLINE void quant_group(const int type, const int np, const float *x, const float *xsum,
                        const uint8_t *panel, int64_t panel_bytes, const float *b,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int cols) {
  const int64_t nb = K / QBLOCK;
  for (int64_t r = 0; r < M; r += QROWS) {
    const float *xr = x + r * K, *sr = xsum ? xsum + r * nb : 0;
    const float *rr = residual ? residual + r * N : 0;
    const int rows = M - r < QROWS ? (int)(M - r) : QROWS;
    const int tp = tile_panels(rows);
    for (int p0 = 0; p0 < np; p0 += tp) {
      const int n = np - p0 < tp ? np - p0 : tp;
      const uint8_t *pp = panel + p0 * panel_bytes;
      const float *bp = b ? b + p0 * QPANEL : 0;
      const float *rp = rr ? rr + p0 * QPANEL : 0;
      float *yp = y + r * N + p0 * QPANEL;
      const int c = span(cols, p0 * QPANEL, n * QPANEL);
#define TILE(g, m) quant_tile(type, g, m, xr, K, sr, pp, panel_bytes, bp, rp, yp, N, c)
      /* constant panel and row counts: unrolled tiles */
      if (n == 4 && rows == 1) TILE(4, 1);
#if QROWS == 8
      else if (n == 4 && rows == 2) TILE(4, 2);
      else if (n == 4 && rows == 3) TILE(4, 3);
      else if (n == 4 && rows == 4) TILE(4, 4);
      else if (n == 2 && rows == 5) TILE(2, 5);
      else if (n == 2 && rows == 6) TILE(2, 6);
      else if (n == 2 && rows == 7) TILE(2, 7);
      else if (n == 2 && rows == 8) TILE(2, 8);
#endif
      else if (n == 2 && rows == 1) TILE(2, 1);
      else if (n == 2 && rows == 2) TILE(2, 2);
      else
        for (int p = 0; p < n; p++) { /* one panel at a time (and a group's last panels) */
          const uint8_t *p1 = pp + p * panel_bytes;
          const float *b1 = bp ? bp + p * QPANEL : 0, *r1 = rp ? rp + p * QPANEL : 0;
          const int c1 = span(c, p * QPANEL, QPANEL);
#define TILE1(m) quant_tile(type, 1, m, xr, K, sr, p1, panel_bytes, b1, r1, yp + p * QPANEL, N, c1)
          switch (rows) {
            case 1: TILE1(1); break;
            case 2: TILE1(2); break;
            case 3: TILE1(3); break;
#if QROWS == 8
            case 4: TILE1(4); break;
            case 5: TILE1(5); break;
            case 6: TILE1(6); break;
            case 7: TILE1(7); break;
            default: TILE1(8); break;
#else
            default: TILE1(4); break;
#endif
          }
#undef TILE1
        }
#undef TILE
    }
  }
}

/* The group kernels, each compiled for its type (outside the OpenMP region, which GCC
 * outlines before inlining, so a type passed into it would stay a run-time value). */
#define GROUP_ARGS                                                                         \
  const int np, const float *x, const float *xsum, const uint8_t *panel, int64_t panel_bytes, \
      const float *b, const float *residual, float *y, int64_t M, int64_t N, int64_t K,     \
      int cols
#define GROUP_PASS np, x, xsum, panel, panel_bytes, b, residual, y, M, N, K, cols
static void group_q8_0(GROUP_ARGS) { quant_group(Q8_0, GROUP_PASS); }
static void group_q4_1(GROUP_ARGS) { quant_group(Q4_1, GROUP_PASS); }

/* Each row's sums of x over the blocks of 32, in one fixed order (a row's sums do not
 * depend on the other rows): [M][K / 32] in a buffer that lives as long as its thread. */
static const float *block_sums(const float *x, int64_t M, int64_t K) {
  static __thread float *buf;
  static __thread int64_t size;
  const int64_t nb = K / QBLOCK;
  if (size < M * nb) {
    free(buf);
    size = M * nb;
    buf = malloc((size_t)size * sizeof(float));
  }
  for (int64_t i = 0; i < M * nb; i++) {
    const v16 two = load16(x + i * QBLOCK) + load16(x + i * QBLOCK + 16);
    float s = 0.0f;
    for (int c = 0; c < 16; c++) s += two[c];
    buf[i] = s;
  }
  return buf;
}

/* Calls of this many rows of x or more run on AMX tiles where the CPU has them (gemm_amx.c:
 * the same sums in another rounding order). 6: at concurrency 1 a step decodes 1 token or
 * verifies 1 + at most 4 by default, so those steps keep this kernel's numbers; from about
 * ten rows the tiles' multiply-adds win. */
#define AMX_MIN_ROWS 6
int tandem_amx_active(void);
void tandem_amx_linear(int q4, int64_t stride, const float *x, const uint8_t *panels,
                       const float *bias, const float *residual, float *y, int64_t M, int64_t N,
                       int64_t K, int nthreads);

/* The vector kernel's calls run on VNNI integer dot products where the CPU has them and
 * TANDEM_VNNI=1 asks for them (gemm_vnni.c: x in 24-bit fixed point per block, the sums in
 * another order; it says why that is not the default); every call does in the int8 mode. */
int tandem_vnni_active(void);
void tandem_vnni_linear(int q4, const float *x, const float *xsum, const uint8_t *panels,
                        const float *bias, const float *residual, float *y, int64_t M, int64_t N,
                        int64_t K, int nthreads);

static void quant_linear(const int type, const float *x, const uint8_t *panels,
                         const float *bias, const float *residual, float *y, int64_t M,
                         int64_t N, int64_t K, int nthreads) {
  const int vnni = tandem_vnni_active();
  if (M >= AMX_MIN_ROWS && tandem_amx_active() && vnni != VNNI_INT8) {
    tandem_amx_linear(type == Q4_1, block_bytes(type), x, panels, bias, residual, y, M, N, K,
                      nthreads);
    return;
  }
  const float *xsum = type == Q4_1 ? block_sums(x, M, K) : 0;
  if (vnni != VNNI_OFF) {
    tandem_vnni_linear(type == Q4_1, x, xsum, panels, bias, residual, y, M, N, K, nthreads);
    return;
  }
  const int64_t num_panels = (N + QPANEL - 1) / QPANEL;
  const int64_t panel_bytes = (K / QBLOCK) * block_bytes(type);
  const int group = tile_panels(M < QROWS ? (int)M : QROWS); /* panels per work item */
  const int64_t num_groups = (num_panels + group - 1) / group;
  void (*const run)(GROUP_ARGS) = type == Q4_1 ? group_q4_1 : group_q8_0;
  /* Guided, as gemm_vnni.c says why: each worker reads one long run of panels, and one the
   * OS preempts is made up for by the small work items at the end. */
#pragma omp parallel for num_threads(nthreads) schedule(guided, 1) if (nthreads > 1)
  for (int64_t g = 0; g < num_groups; g++) {
    const int64_t p0 = g * group;
    const int np = span(num_panels, p0, group);
    const int cols = span(N, p0 * QPANEL, np * QPANEL);
    run(np, x, xsum, panels + p0 * panel_bytes, panel_bytes, bias ? bias + p0 * QPANEL : 0,
        residual ? residual + p0 * QPANEL : 0, y + p0 * QPANEL, M, N, K, cols);
  }
}

/* K must be a multiple of 32 (GGUF guarantees it for these types). */
void tandem_linear_q8_0(const float *x, const uint8_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads) {
  quant_linear(Q8_0, x, panels, bias, residual, y, M, N, K, nthreads);
}

void tandem_linear_q4_1(const float *x, const uint8_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads) {
  quant_linear(Q4_1, x, panels, bias, residual, y, M, N, K, nthreads);
}
