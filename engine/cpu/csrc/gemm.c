#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * Linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ residual[M, N], a transformer block's
 * skip connection; y may be the residual itself).
 *
 * W is packed once into panels of PANEL output columns, each panel stored k-major:
 * panels[p][k][c] = W[p * PANEL + c][k] (zero past N). A tile of up to ROWS rows keeps its
 * 2 x ROWS accumulators in registers while the panel streams past once (with AVX-512, 16-lane
 * tiles of up to 8 rows: linear_tile16); further tiles of the same call find the panel in
 * cache. Each output is summed over k in order, one fused multiply-add a step (vec.h madd),
 * whatever M is, so a row's result does not depend on the other rows in the batch.
 *
 * Panels are float32, or bfloat16 when every weight of the matrix is exactly a bfloat16
 * value (a bfloat16 checkpoint loaded in float32): a bfloat16 is the top half of a float32,
 * so widening is exact and the arithmetic is the float32 one, on half the bytes from memory.
 */
#define PANEL 16
#define ROWS 6

typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));

/* Panel row k: its PANEL weights as two float32 vectors. A bfloat16 panel row is stored
 * interleaved, columns 0, 8, 1, 9, ..., 7, 15, so 32-bit lane j holds column j in its low
 * half and column j + 8 in its high half: one shift and one mask widen all 16. */
INLINE void panel_row(const int bf16, const void *panel, int64_t k, v8 *lo, v8 *hi) {
  if (bf16) {
    const v8u w = *(const v8u *)((const uint16_t *)panel + k * PANEL);
    *lo = (v8)(w << 16);
    *hi = (v8)(w & 0xffff0000u);
  } else {
    const float *p = (const float *)panel + k * PANEL;
    *lo = load(p);
    *hi = load(p + 8);
  }
}

/* With one or two rows, a tile takes GROUP (one row) or 2 (two rows) panels side by side, so
 * its chains of dependent adds are independent enough to hide the adds' latency; each output
 * is still summed over k in order. */
#define GROUP 4

/* y[m rows, the columns of np panels], the panels `pstride` weights apart. */
INLINE void linear_tile(const int bf16, const int np, const int m, const float *x, int64_t K,
                        const void *panel, int64_t pstride, const float *bias, const float *res,
                        float *y, int64_t N, int cols) {
  v8 lo[GROUP][ROWS], hi[GROUP][ROWS];
  for (int p = 0; p < np; p++)
    for (int r = 0; r < m; r++) lo[p][r] = hi[p][r] = (v8){0};
  for (int64_t k = 0; k < K; k++) {
    for (int p = 0; p < np; p++) {
      v8 w_lo, w_hi;
      const void *pp = (const char *)panel + p * pstride * (bf16 ? 2 : 4);
      panel_row(bf16, pp, k, &w_lo, &w_hi);
      for (int r = 0; r < m; r++) {
        const float s = x[r * K + k];
        lo[p][r] = madd(lo[p][r], splat(s), w_lo);
        hi[p][r] = madd(hi[p][r], splat(s), w_hi);
      }
    }
  }
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * PANEL, PANEL);
    for (int r = 0; r < m; r++) {
      float row[PANEL];
      store(row, lo[p][r]);
      store(row + 8, hi[p][r]);
      put_row(row, n, bias ? bias + p * PANEL : 0, res ? res + r * N + p * PANEL : 0,
              y + r * N + p * PANEL);
    }
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512: a panel row is one 16-lane vector, so a row's accumulator for a panel is one
 * register (two with 8 lanes), and a tile holds 16 of them: up to 4 rows of 4 panels or 8 rows
 * of 2. The multiply-adds are the ones of the 8-lane tiles above, per output in the same order,
 * so the results are the same bit for bit. */
#define ROWS16 8

/* Panel row k as 16 float32 lanes: the columns in order, or for bfloat16 in the stored order
 * 0, 8, 1, 9, ..., 7, 15 (one zero-extending load and one shift); `column_lane` maps back. */
INLINE v16 panel_row16(const int bf16, const void *panel, int64_t k) {
  if (bf16) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + k * PANEL));
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16);
  }
  return *(const v16 *)((const float *)panel + k * PANEL);
}

INLINE int column_lane(const int bf16, int c) { return !bf16 ? c : c < 8 ? 2 * c : 2 * c - 15; }

INLINE void linear_tile16(const int bf16, const int np, const int m, const float *x, int64_t K,
                          const void *panel, int64_t pstride, const float *bias,
                          const float *res, float *y, int64_t N, int cols) {
  v16 acc[GROUP][ROWS16];
  for (int p = 0; p < np; p++)
    for (int r = 0; r < m; r++) acc[p][r] = (v16){0};
  for (int64_t k = 0; k < K; k++)
    for (int p = 0; p < np; p++) {
      const v16 w = panel_row16(bf16, (const char *)panel + p * pstride * (bf16 ? 2 : 4), k);
      for (int r = 0; r < m; r++) acc[p][r] = madd16(acc[p][r], splat16(x[r * K + k]), w);
    }
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * PANEL, PANEL);
    for (int r = 0; r < m; r++) {
      float lanes[PANEL], row[PANEL];
      *(v16 *)lanes = acc[p][r];
      for (int c = 0; c < n; c++) row[c] = lanes[column_lane(bf16, c)];
      put_row(row, n, bias ? bias + p * PANEL : 0, res ? res + r * N + p * PANEL : 0,
              y + r * N + p * PANEL);
    }
  }
}

#define TILE_FN linear_tile16
#define TILE_ROWS ROWS16
#define PANELS_PER_TILE(M) ((M) <= 4 ? GROUP : 2) /* 16 accumulators a tile */
#else
#define TILE_FN linear_tile
#define TILE_ROWS ROWS
#define PANELS_PER_TILE(M) ((M) == 1 ? GROUP : (M) == 2 ? 2 : 1)
#endif

/* One group of np panels, all rows of x: unrolled tiles (of the widest vectors there are). */
INLINE void linear_group(const int bf16, const int np, const float *x, const void *panel,
                         int64_t pstride, const float *b, const float *residual, float *y,
                         int64_t M, int64_t N, int64_t K, int cols) {
  for (int64_t r = 0; r < M; r += TILE_ROWS) {
    const float *xr = x + r * K;
    const float *rr = residual ? residual + r * N : 0;
    float *yr = y + r * N;
    const int rows = M - r < TILE_ROWS ? (int)(M - r) : TILE_ROWS;
#define TILE(g, m) TILE_FN(bf16, g, m, xr, K, panel, pstride, b, rr, yr, N, cols)
    if (np == 4 && rows == 1) TILE(4, 1);
#if defined(__AVX512F__)
    else if (np == 4 && rows == 2) TILE(4, 2);
    else if (np == 4 && rows == 3) TILE(4, 3);
    else if (np == 4 && rows == 4) TILE(4, 4);
    else if (np == 2 && rows == 5) TILE(2, 5);
    else if (np == 2 && rows == 6) TILE(2, 6);
    else if (np == 2 && rows == 7) TILE(2, 7);
    else if (np == 2 && rows == 8) TILE(2, 8);
#else
    else if (np == 2 && rows == 2) TILE(2, 2);
#endif
    else
      for (int p = 0; p < np; p++) { /* one panel at a time (and a group's last panels) */
        const void *pp = (const char *)panel + p * pstride * (bf16 ? 2 : 4);
        const float *bp = b ? b + p * PANEL : 0;
        const float *rp = rr ? rr + p * PANEL : 0;
        const int c = span(cols, p * PANEL, PANEL);
#define TILE1(m) TILE_FN(bf16, 1, m, xr, K, pp, pstride, bp, rp, yr + p * PANEL, N, c)
        switch (rows) { /* constant row counts: unrolled tiles */
          case 1: TILE1(1); break;
          case 2: TILE1(2); break;
          case 3: TILE1(3); break;
          case 4: TILE1(4); break;
          case 5: TILE1(5); break;
#if defined(__AVX512F__)
          case 6: TILE1(6); break;
          case 7: TILE1(7); break;
          default: TILE1(8); break;
#else
          default: TILE1(6); break;
#endif
        }
#undef TILE1
      }
#undef TILE
  }
}

/* The group kernels, each compiled for its format (outside the OpenMP region, which GCC
 * outlines before inlining, so a format passed into it would stay a run-time value). */
#define GROUP_ARGS                                                                         \
  const int np, const float *x, const void *panel, int64_t pstride, const float *b,       \
      const float *residual, float *y, int64_t M, int64_t N, int64_t K, int cols
#define GROUP_PASS np, x, panel, pstride, b, residual, y, M, N, K, cols
static void group_f32(GROUP_ARGS) { linear_group(0, GROUP_PASS); }
static void group_bf16(GROUP_ARGS) { linear_group(1, GROUP_PASS); }

static void linear(const int bf16, const float *x, const void *panels, const float *bias,
                   const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                   int nthreads) {
  const int64_t num_panels = (N + PANEL - 1) / PANEL;
  const int64_t pstride = K * PANEL; /* weights per panel */
  const int group = PANELS_PER_TILE(M);
  const int64_t num_groups = (num_panels + group - 1) / group;
  void (*const run)(GROUP_ARGS) = bf16 ? group_bf16 : group_f32;
  /* Guided, as gemm_vnni.c says why: each worker reads one long run of panels, and one the
   * OS preempts is made up for by the small work items at the end. */
#pragma omp parallel for num_threads(nthreads) schedule(guided, 1) if (nthreads > 1)
  for (int64_t g = 0; g < num_groups; g++) {
    const int64_t p0 = g * group;
    const int np = span(num_panels, p0, group);
    const int cols = span(N, p0 * PANEL, np * PANEL);
    run(np, x, (const char *)panels + p0 * pstride * (bf16 ? 2 : 4), pstride,
        bias ? bias + p0 * PANEL : 0, residual ? residual + p0 * PANEL : 0, y + p0 * PANEL, M,
        N, K, cols);
  }
}

void tandem_linear(const float *x, const float *panels, const float *bias, const float *residual,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
  linear(0, x, panels, bias, residual, y, M, N, K, nthreads);
}

void tandem_linear_bf16(const float *x, const uint16_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads) {
  linear(1, x, panels, bias, residual, y, M, N, K, nthreads);
}

/* The vector instructions the compiler chose for these kernels (cc -march=native picks the
 * machine's own): the 16-lane float32 vectors of the GGUF kernels and the 8-lane ones of the
 * others run as one AVX-512 or AVX2 register each, or as pairs or quads of narrower ones. */
const char *tandem_isa(void) {
#if defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#elif defined(__AVX__)
  return "avx";
#elif defined(__ARM_NEON)
  return "neon";
#elif defined(__SSE2__)
  return "sse2";
#else
  return "generic";
#endif
}
