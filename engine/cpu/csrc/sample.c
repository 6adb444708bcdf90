#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * Inverse-CDF sampling, row by row: for each row of non-negative mass p[vocab] and a draw
 * u in [0, 1), the first index i whose cumulative mass exceeds u times the row's total
 * (engine/sample/sampler.py `sample_from`, whose torch path builds the whole float64 CDF of
 * every row: about 200 us a row over a 49K vocabulary on the 2-core Xeon, most of a sampled
 * step's verification).
 *
 * Here the mass is summed in float64 by blocks of SAMPLE_BLOCK (8 lanes each, then the lanes
 * in order), the block totals in order give the row's total and the block the point falls in,
 * and only that block is scanned index by index. Sums in another order round differently
 * from one long running sum (in the last bits of a float64), so a draw lands on a different
 * token than torch's path only when u times the total is within such a rounding of a token's
 * boundary. The chosen token always has mass (the first one past the point has; if rounding
 * leaves the point past the block's scan, its last token with mass is taken).
 */
#define SAMPLE_BLOCK 256

static double block_mass(const float *p, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) lanes[l] += (double)p[i + l];
  double s = 0;
  for (int l = 0; l < 8; l++) s += lanes[l];
  for (; i < n; i++) s += (double)p[i];
  return s;
}

static int64_t sample_row(const float *p, int64_t vocab, double u, double *sums) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  double total = 0;
  for (int64_t b = 0; b < blocks; b++) {
    sums[b] = block_mass(p + b * SAMPLE_BLOCK, span(vocab, b * SAMPLE_BLOCK, SAMPLE_BLOCK));
    total += sums[b];
  }
  if (!(total > 0)) return vocab; /* no mass: as the torch path answers (past the end) */
  double point = u * total;
  const double below = nextafter(total, 0.0); /* strictly below the total */
  if (point > below) point = below;
  /* The first block whose running total passes the point: one exists, since the blocks'
   * running total ends at `total` (the same additions), which is above the point. */
  double run = 0;
  int64_t b = 0;
  while (b < blocks - 1 && run + sums[b] <= point) run += sums[b++];
  const int64_t start = b * SAMPLE_BLOCK, end = start + span(vocab, start, SAMPLE_BLOCK);
  int64_t last = -1;
  for (int64_t i = start; i < end; i++) {
    if (p[i] > 0) last = i;
    run += (double)p[i];
    if (run > point) return i;
  }
  return last; /* the block has mass (its total passed the point), so last >= 0 */
}

/* out[r] = the token sampled from row r of probs [rows, vocab] with draw uniform[r]. */
void tandem_sample_rows(const float *probs, const double *uniform, int64_t rows, int64_t vocab,
                        int64_t *out, int nthreads) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows >= 4)
  for (int64_t r = 0; r < rows; r++) {
    double sums[blocks];
    out[r] = sample_row(probs + r * vocab, vocab, uniform[r], sums);
  }
}
