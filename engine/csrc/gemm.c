#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * Linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+ residual[M, N], a transformer block's
 * skip connection; y may be the residual itself).
 *
 * W is packed once into panels of PANEL output columns, each panel stored k-major:
 * panels[p][k][c] = W[p * PANEL + c][k] (zero past N). A tile of up to ROWS rows keeps its
 * 2 x ROWS accumulators in registers while the panel streams past once; further tiles of the
 * same call find the panel in cache. Each output is summed over k in order, whatever M is,
 * so a row's result does not depend on the other rows in the batch.
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

INLINE void linear_tile(const int bf16, const int m, const float *x, int64_t K,
                        const void *panel, const float *bias, const float *res, float *y,
                        int64_t N, int cols) {
  v8 lo[ROWS], hi[ROWS];
  for (int r = 0; r < m; r++) lo[r] = hi[r] = (v8){0};
  for (int64_t k = 0; k < K; k++) {
    v8 w_lo, w_hi;
    panel_row(bf16, panel, k, &w_lo, &w_hi);
    for (int r = 0; r < m; r++) {
      const float s = x[r * K + k];
      lo[r] += s * w_lo;
      hi[r] += s * w_hi;
    }
  }
  for (int r = 0; r < m; r++) {
    float row[PANEL];
    store(row, lo[r]);
    store(row + 8, hi[r]);
    if (bias)
      for (int c = 0; c < cols; c++) row[c] += bias[c];
    if (res)
      for (int c = 0; c < cols; c++) row[c] += res[r * N + c];
    memcpy(y + r * N, row, (size_t)cols * sizeof(float));
  }
}

INLINE void linear(const int bf16, const float *x, const void *panels, const float *bias,
                   const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                   int nthreads) {
  const int64_t num_panels = (N + PANEL - 1) / PANEL;
  const int64_t panel_bytes = K * PANEL * (bf16 ? 2 : 4);
  /* Panels in dynamic chunks of 4: a worker the OS preempts (the server's event loop
   * shares these cores) holds the call up for one chunk, not for half the matrix. */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4) if (nthreads > 1)
  for (int64_t p = 0; p < num_panels; p++) {
    const void *panel = (const char *)panels + p * panel_bytes;
    const float *b = bias ? bias + p * PANEL : 0;
    const int cols = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
    for (int64_t r = 0; r < M; r += ROWS) {
      const float *xr = x + r * K;
      const float *rr = residual ? residual + r * N + p * PANEL : 0;
      float *yr = y + r * N + p * PANEL;
#define TILE(m) linear_tile(bf16, m, xr, K, panel, b, rr, yr, N, cols)
      switch (M - r < ROWS ? M - r : ROWS) { /* constant row counts: unrolled tiles */
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 3: TILE(3); break;
        case 4: TILE(4); break;
        case 5: TILE(5); break;
        default: TILE(6); break;
      }
#undef TILE
    }
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
