#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * Linear on GGUF-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ residual),
 * W kept in its GGUF quantization, each weight dequantized in registers to exactly the
 * float32 value gguf's own dequantizer gives it, and the products summed in float32.
 *
 * GGUF stores W row by row in blocks of 32 consecutive weights with their own scale:
 *   Q8_0: w = d * q,      q an int8, d a float16;
 *   Q4_1: w = d * q + m,  q a 4-bit unsigned, d and m float16.
 * engine/cpu_kernels.py repacks the blocks once into panels of QPANEL output rows, so a
 * vector lane is an output column (as in gemm.c) and one unpacked vector of weights serves
 * every row of x:
 *   Q8_0 panel block: d[16] float32, then for k = 0..31: q[16] int8 (column c at byte c);
 *   Q4_1 panel block: d[16], m[16] float32, then for k = 0..31: 8 bytes, column c's
 *                     nibble at bits 4c..4c+3 of that little-endian 64-bit word.
 * The scales are widened to float32 at packing (exact), so the kernel reads 6 (Q4_1) or
 * 9 (Q8_0) bits per weight instead of float32's 32.
 *
 * d * q + m is a multiply and an add in gguf, and the compiler may fuse them here into one
 * FMA: the same value either way, because d * q is exact in float32 (d, a widened float16,
 * has 11 significant bits, q at most 8), so only the add rounds.
 */
#define QPANEL 16
#define QBLOCK 32
/* Rows of x per tile: each tile unpacks the panel's weights once. 8 rows' accumulators fit
 * AVX-512's 32 vector registers; AVX2 (16 registers, two per 16-lane vector) takes 4. */
#if defined(__AVX512F__)
#define QROWS 8
#else
#define QROWS 4
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

INLINE v16 load16(const float *p) { return *(const v16 *)p; }
INLINE void store16(float *p, v16 v) { *(v16 *)p = v; }
INLINE v16 splat16(float x) {
  return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

enum { Q8_0 = 0, Q4_1 = 1 };

INLINE int64_t block_bytes(const int type) {
  return type == Q4_1 ? 2 * QPANEL * 4 + QBLOCK * 8 : QPANEL * 4 + QBLOCK * QPANEL;
}

/* out[i] = all[idx[i]]: one permute instruction. */
INLINE v16u spread(v16u all, v16u idx) {
#if defined(__clang__)
  v16u out;
  for (int i = 0; i < 16; i++) out[i] = all[idx[i]];
  return out;
#else
  return __builtin_shuffle(all, idx);
#endif
}

/* Q8_0: the 16 weights of quant row j of a 64-byte load (rows j0..j0+3), one per output
 * column, as float32. Row j is words 4j..4j+3; column c's int8 is byte c % 4 of word
 * 4j + c / 4: one permute, then a shift to the top and back (arithmetic) sign-extends. */
INLINE v16 q8_weights(v16u all, int j, v16 d) {
  const uint32_t a = 4 * j, b = a + 1, c = a + 2, e = a + 3;
  const v16u word = spread(all, (v16u){a, a, a, a, b, b, b, b, c, c, c, c, e, e, e, e});
  const v16u up = {24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0};
  const v16i q = (v16i)(word << up) >> 24;
  return __builtin_convertvector(q, v16) * d;
}

/* Q4_1: the 16 weights of quant row k (8 bytes: a nibble per column) as float32. */
INLINE v16 q4_1_weights(const uint8_t *quants, int k, v16 d, v16 m) {
  uint32_t lo, hi;
  memcpy(&lo, quants + k * 8, 4);
  memcpy(&hi, quants + k * 8 + 4, 4);
  const v16u word = {lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi};
  const v16u shift = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
  const v16i q = (v16i)((word >> shift) & 15);
  return __builtin_convertvector(q, v16) * d + m;
}

INLINE void quant_tile(const int type, const int rows, const float *x, int64_t K,
                       const uint8_t *panel, const float *bias, const float *res, float *y,
                       int64_t N, int cols) {
  v16 acc[QROWS];
  for (int r = 0; r < rows; r++) acc[r] = (v16){0};
  const int64_t stride = block_bytes(type);
  for (int64_t b = 0; b < K / QBLOCK; b++) {
    const uint8_t *blk = panel + b * stride;
    const v16 d = load16((const float *)blk);
    const v16 m = type == Q4_1 ? load16((const float *)blk + QPANEL) : (v16){0};
    const float *xb = x + b * QBLOCK;
    if (type == Q4_1) {
      const uint8_t *quants = blk + 2 * QPANEL * 4;
      for (int k = 0; k < QBLOCK; k++) {
        const v16 w = q4_1_weights(quants, k, d, m);
        for (int r = 0; r < rows; r++) acc[r] += splat16(xb[r * K + k]) * w;
      }
    } else {
      const uint8_t *quants = blk + QPANEL * 4;
      for (int k0 = 0; k0 < QBLOCK; k0 += 4) {
        const v16u all = *(const v16u *)(quants + k0 * QPANEL);
        for (int j = 0; j < 4; j++) {
          const v16 w = q8_weights(all, j, d);
          for (int r = 0; r < rows; r++) acc[r] += splat16(xb[r * K + k0 + j]) * w;
        }
      }
    }
  }
  for (int r = 0; r < rows; r++) {
    float row[QPANEL];
    store16(row, acc[r]);
    if (bias)
      for (int c = 0; c < cols; c++) row[c] += bias[c];
    if (res)
      for (int c = 0; c < cols; c++) row[c] += res[r * N + c];
    memcpy(y + r * N, row, (size_t)cols * sizeof(float));
  }
}

INLINE void quant_linear(const int type, const float *x, const uint8_t *panels,
                         const float *bias, const float *residual, float *y, int64_t M,
                         int64_t N, int64_t K, int nthreads) {
  const int64_t num_panels = (N + QPANEL - 1) / QPANEL;
  const int64_t panel_bytes = (K / QBLOCK) * block_bytes(type);
  /* Panels in dynamic chunks of 4: a worker the OS preempts (the server's event loop
   * shares these cores) holds the call up for one chunk, not for half the matrix. */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4) if (nthreads > 1)
  for (int64_t p = 0; p < num_panels; p++) {
    const uint8_t *panel = panels + p * panel_bytes;
    const float *b = bias ? bias + p * QPANEL : 0;
    const int cols = N - p * QPANEL < QPANEL ? (int)(N - p * QPANEL) : QPANEL;
    for (int64_t r = 0; r < M; r += QROWS) {
      const float *xr = x + r * K;
      const float *rr = residual ? residual + r * N + p * QPANEL : 0;
      float *yr = y + r * N + p * QPANEL;
#define TILE(n) quant_tile(type, n, xr, K, panel, b, rr, yr, N, cols)
      switch (M - r < QROWS ? M - r : QROWS) { /* constant row counts: unrolled tiles */
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 3: TILE(3); break;
#if QROWS == 8
        case 4: TILE(4); break;
        case 5: TILE(5); break;
        case 6: TILE(6); break;
        case 7: TILE(7); break;
        default: TILE(8); break;
#else
        default: TILE(4); break;
#endif
      }
#undef TILE
    }
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
