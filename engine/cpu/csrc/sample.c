#include "vec.h"
#include <float.h>
#include <stdlib.h>

/* ---------------------------------------------------------------------------------------
 * Inverse-CDF sampling, row by row: for each row of non-negative mass p[vocab] and a draw
 * u in [0, 1), the first index i whose cumulative mass exceeds u times the row's total
 * (engine/sample/sampler.py `sample_from`, whose torch path builds the whole float64 CDF of
 * every row).
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

/* In one block of mass p[n] whose blocks before it sum to `run`: the first index at which the
 * running sum passes `point`, or (rounding having left the point past the block's own sum)
 * its last index with mass. The caller found the block by its sum, so it has mass. */
static int64_t scan_block(const float *p, int64_t n, double run, double point) {
  int64_t last = -1;
  for (int64_t i = 0; i < n; i++) {
    if (p[i] > 0) last = i;
    run += (double)p[i];
    if (run > point) return i;
  }
  return last;
}

/* For draw u over blocks of masses sums[blocks] totalling `total` (> 0): the point u * total
 * (strictly below the total), the first block whose running total passes it, and in `run`
 * the sum of the blocks before that one. Such a block exists, since the blocks' running total
 * ends at `total` (the same additions), which is above the point. */
static int64_t find_block(const double *sums, int64_t blocks, double total, double u,
                          double *point, double *run) {
  *point = u * total;
  const double below = nextafter(total, 0.0);
  if (*point > below) *point = below;
  int64_t b = 0;
  *run = 0;
  while (b < blocks - 1 && *run + sums[b] <= *point) *run += sums[b++];
  return b;
}

static int64_t sample_row(const float *p, int64_t vocab, double u, double *sums) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  double total = 0;
  for (int64_t b = 0; b < blocks; b++) {
    sums[b] = block_mass(p + b * SAMPLE_BLOCK, span(vocab, b * SAMPLE_BLOCK, SAMPLE_BLOCK));
    total += sums[b];
  }
  if (!(total > 0)) return vocab; /* no mass: as the torch path answers (past the end) */
  double point, run;
  const int64_t start = find_block(sums, blocks, total, u, &point, &run) * SAMPLE_BLOCK;
  return start + scan_block(p + start, span(vocab, start, SAMPLE_BLOCK), run, point);
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

/* ---------------------------------------------------------------------------------------
 * Sampling straight from logits (engine/sample/sampler.py `sample_logits`): row r's token is
 * drawn from softmax(logits[r] / T_r) with draw uniform[r], without the probabilities being
 * written out. The mass of token i is w_i = exp((x_i - max) / T), the softmax's numerator
 * (exp_v, within 2 ulp of expf); dividing by the row's sum would not move which token the
 * draw picks, up to rounding, so the mass is sampled as sample_rows samples a row (float64
 * block sums, then one block scanned). A block's weights are computed by one function both
 * times they are needed, so the scan sees the values the sums were made of. A row with a NaN,
 * or all -inf, or a +inf logit has no finite mass: out is vocab, as sample_rows answers for
 * torch's softmax of such a row (NaN throughout). */

/* w[i] = exp((x[i] - m) * inv_t), i < n <= SAMPLE_BLOCK: 16 lanes at a time (vec.h exp16),
 * fewer dependent steps than 8. */
static void block_weights(const float *x, int64_t n, float m, float inv_t, float *w) {
  const v8 vm = splat(m), vt = splat(inv_t);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = *(const v16 *)(x + i);
    *(v16 *)(w + i) = exp16((v - splat16(m)) * splat16(inv_t));
  }
  for (; i + 8 <= n; i += 8) store(w + i, exp_v((load(x + i) - vm) * vt));
  for (; i < n; i++) w[i] = exp_v((splat(x[i]) - vm) * vt)[0];
}

static float row_max(const float *x, int64_t n) { /* NaNs are passed over */
  v8 mx = splat(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 v = load(x + i);
    mx = select_v(v > mx, v, mx);
  }
  float m = hmax(mx);
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* A row's mass computed a block at a time: fill(ctx, at, n, out) writes the masses of tokens
 * at..at + n - 1 (n <= SAMPLE_BLOCK). */
typedef void (*fill_fn)(const void *ctx, int64_t at, int64_t n, float *out);

/* sample_row for a row whose masses `fill` computes: float64 block sums, then the block the
 * point falls in computed again (by the same function: the values the sums were made of) and
 * scanned. `vocab` when the row has no mass (or a NaN). */
static int64_t sample_filled(fill_fn fill, const void *ctx, int64_t vocab, double u,
                             double *sums) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  float w[SAMPLE_BLOCK];
  double total = 0;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n = span(vocab, b * SAMPLE_BLOCK, SAMPLE_BLOCK);
    fill(ctx, b * SAMPLE_BLOCK, n, w);
    sums[b] = block_mass(w, n);
    total += sums[b];
  }
  if (!(total > 0)) return vocab;
  double point, run;
  const int64_t start = find_block(sums, blocks, total, u, &point, &run) * SAMPLE_BLOCK;
  const int64_t n = span(vocab, start, SAMPLE_BLOCK);
  fill(ctx, start, n, w);
  return start + scan_block(w, n, run, point);
}

struct softmax_row {
  const float *x;
  float m, inv_t;
};

static void fill_softmax(const void *ctx, int64_t at, int64_t n, float *out) {
  const struct softmax_row *s = ctx;
  block_weights(s->x + at, n, s->m, s->inv_t, out);
}

static int64_t sample_logits_row(const float *x, int64_t vocab, float inv_t, double u,
                                 double *sums) {
  const struct softmax_row row = {x, row_max(x, vocab), inv_t};
  return sample_filled(fill_softmax, &row, vocab, u, sums); /* vocab for a NaN: see above */
}

/* out[r] = the token drawn from softmax(logits[r] * inv_temperature[r]) with uniform[r]. */
void tandem_sample_logits(const float *logits, const float *inv_temperature,
                          const double *uniform, int64_t rows, int64_t vocab, int64_t *out,
                          int nthreads) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows >= 4)
  for (int64_t r = 0; r < rows; r++) {
    double sums[blocks];
    out[r] = sample_logits_row(logits + r * vocab, vocab, inv_temperature[r], uniform[r], sums);
  }
}

/* ---------------------------------------------------------------------------------------
 * Softmax rows, for the kernels below: out[r] = softmax(x[r] * inv_t[r]) as w_i / sum(w),
 * w_i = exp((x_i - max) * inv_t) the numerators tandem_sample_logits draws from, their sum in
 * float64 (block_mass). Three passes over the row (max, numerators, scale). A row's values
 * depend on that row alone. A row with a NaN or an infinite maximum (+inf, or no finite
 * logit) has no distribution: it is written NaN throughout, as torch's softmax answers. */
static void softmax_row(const float *x, int64_t vocab, float inv_t, float *out) {
  v8 mx = splat(-INFINITY);
  v8i nan = (v8i){0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const v8 v = load(x + i);
    nan |= v != v;
    mx = select_v(v > mx, v, mx);
  }
  float m = hmax(mx);
  int bad = 0;
  for (int l = 0; l < 8; l++) bad |= nan[l] != 0;
  for (; i < vocab; i++) {
    bad |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
  if (bad || isinf(m)) {
    for (i = 0; i < vocab; i++) out[i] = NAN;
    return;
  }
  double total = 0;
  for (int64_t at = 0; at < vocab; at += SAMPLE_BLOCK) {
    const int64_t n = span(vocab, at, SAMPLE_BLOCK);
    block_weights(x + at, n, m, inv_t, out + at);
    total += block_mass(out + at, n);
  }
  const v8 scale = splat((float)(1.0 / total)); /* total >= 1: the maximum's own exp(0) */
  for (i = 0; i + 8 <= vocab; i += 8) store(out + i, load(out + i) * scale);
  for (; i < vocab; i++) out[i] *= scale[0];
}

static void softmax_rows(const float *x, const float *inv_temperature, float *out,
                         int64_t rows, int64_t vocab, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows >= 2)
  for (int64_t r = 0; r < rows; r++)
    softmax_row(x + r * vocab, vocab, inv_temperature[r], out + r * vocab);
}

/* ---------------------------------------------------------------------------------------
 * The token that ends a request's verified drafts (engine/sample/rejection_sampler.py): the
 * bonus, drawn from the target's row p after its last kept draft, or the recovered token of a
 * rejected draft, drawn from the residual max(0, w p - q) (q the distribution the draft came
 * from, w the block weight: 1 for token verification), or from p itself where the residual
 * has no mass. The residual's values are torch's: the product w p and the difference rounded
 * to float32 each (not fused into one multiply-add). A model-free drafter has no q row: q is
 * one-hot at the rejected draft token. */
struct residual_row {
  const float *p, *q; /* q NULL: one-hot at `token` */
  float w;
  int64_t token;
};

#if defined(__clang__)
#define NO_CONTRACT
#elif defined(__GNUC__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

NO_CONTRACT static void fill_residual(const void *ctx, int64_t at, int64_t n, float *out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const struct residual_row *r = ctx;
  for (int64_t i = 0; i < n; i++) {
    const float wp = r->w * r->p[at + i];
    const float q = r->q ? r->q[at + i] : (at + i == r->token ? 1.0f : 0.0f);
    const float d = wp - q;
    out[i] = d > 0 ? d : 0.0f;
  }
}

/* The final token with draw u: from the residual r (NULL: none, the bonus), or from p where
 * the residual has no mass (vocab for a row without mass). sums: blocks of the vocabulary. */
static int64_t final_token(const struct residual_row *r, const float *p, int64_t vocab,
                           double u, double *sums) {
  const int64_t token = r ? sample_filled(fill_residual, r, vocab, u, sums) : vocab;
  return token < vocab ? token : sample_row(p, vocab, u, sums);
}

/* For each of n requests: p is row rows[i] of probs [*, vocab]; q_rows[i] < 0 asks for the
 * bonus (a token from p), else the residual of q row q_rows[i] (of q [*, vocab], or NULL for
 * one-hot at tokens[i]) with weight w[i]; uniform[i] is the draw. out[i] = the token (vocab
 * for a row without mass, as sample_rows answers). */
void tandem_sample_final(const float *probs, const int64_t *rows, const float *q,
                         const int64_t *q_rows, const int64_t *tokens, const float *w,
                         const double *uniform, int64_t n, int64_t vocab, int64_t *out,
                         int nthreads) {
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && n >= 4)
  for (int64_t i = 0; i < n; i++) {
    double sums[blocks];
    const float *p = probs + rows[i] * vocab;
    const struct residual_row r = {p, q && q_rows[i] >= 0 ? q + q_rows[i] * vocab : 0, w[i],
                                   tokens[i]};
    out[i] = final_token(q_rows[i] >= 0 ? &r : 0, p, vocab, uniform[i], sums);
  }
}

/* ---------------------------------------------------------------------------------------
 * A sampling step's verification in one call (engine/sample/rejection_sampler.py
 * `verify_sampled`): for chains of drafts whose rows are plain softmax(logits / T) rows, the
 * target's probabilities (softmax_row, all rows in parallel), the decisions of token or block
 * verification on the drafts, and the final token (tandem_sample_final's draw), with the
 * arithmetic of `emitted_tokens`: p/q ratios, block weights and h in float32, each product and
 * difference rounded on its own, draws compared in float64. A residual's mass is summed in
 * float64 (torch sums float32 in another order), so the two paths can decide differently only
 * for a draw within a rounding of h. */
#define TINY 1e-30f

/* sum_x max(0, w p(x) - q(x)) (q NULL: one-hot at `token`), rounded to float32. */
static float residual_mass(const float *p, const float *q, float w, int64_t token,
                           int64_t vocab) {
  const struct residual_row r = {p, q, w, token};
  float buf[SAMPLE_BLOCK];
  double total = 0;
  for (int64_t at = 0; at < vocab; at += SAMPLE_BLOCK) {
    const int64_t n = span(vocab, at, SAMPLE_BLOCK);
    fill_residual(&r, at, n, buf);
    total += block_mass(buf, n);
  }
  return (float)total;
}

/* A min with Python's rule, as `min(a, b)` answers: a unless b < a (a NaN stays). */
static float min_first(float a, float b) { return b < a ? b : a; }

/* row[id], or 0 for an id outside the vocabulary (a draft drawn from a row without mass). */
static float mass_at(const float *row, int64_t id, int64_t vocab) {
  return id >= 0 && id < vocab ? row[id] : 0.0f;
}

/* How many of request's k drafts block verification keeps (tau), and w_tau. p: its k + 1
 * rows; q: its k rows (NULL: one-hot at each draft); ids, u: its drafts and its rows' draws. */
static int64_t block_keep(const float *p, const float *q, const int64_t *ids, const double *u,
                          int64_t k, int64_t vocab, float *w_tau) {
  float w[k + 1];
  w[0] = 1.0f;
  for (int64_t j = 0; j < k; j++) {
    const float px = mass_at(p + j * vocab, ids[j], vocab);
    const float qx = q ? mass_at(q + j * vocab, ids[j], vocab) : 1.0f;
    const float ratio = qx > 0 ? px / (TINY > qx ? TINY : qx) : 0.0f;
    w[j + 1] = min_first(w[j] * ratio, 1.0f);
  }
  int64_t tau = 0;
  for (int64_t i = 1; i <= k; i++) {
    float h = 0.0f;
    if (i == k) {
      h = w[k];
    } else if (w[i] > 0) {
      const float m = q ? residual_mass(p + i * vocab, q + i * vocab, w[i], -1, vocab)
                        : w[i] * (1.0f - mass_at(p + i * vocab, ids[i], vocab)); /* one-hot */
      const float denom = m + 1.0f - w[i];
      h = denom > 0 ? m / (TINY > denom ? TINY : denom) : 0.0f;
    }
    if (u[i - 1] < (double)h) tau = i;
  }
  *w_tau = w[tau];
  return tau;
}

/* The token method: drafts kept while u q(x) <= p(x), both positive (float64 products). */
static int64_t token_keep(const float *p, const float *q, const int64_t *ids, const double *u,
                          int64_t k, int64_t vocab) {
  int64_t kept = 0;
  for (; kept < k; kept++) {
    const float px = mass_at(p + kept * vocab, ids[kept], vocab);
    const float qx = q ? mass_at(q + kept * vocab, ids[kept], vocab) : 1.0f;
    if (!(px > 0 && qx > 0 && u[kept] * (double)qx <= (double)px)) break;
  }
  return kept;
}

/* For batch requests, request i owning num_drafts[i] drafts and num_drafts[i] + 1 rows (in
 * order): logits [rows, vocab] and inv_temperature per request; probs [rows, vocab] receives
 * the softmax rows; q [num_draft, vocab] the drafts' distributions (NULL: one-hot, a
 * model-free drafter); ids the drafts; uniform one draw per row (row j < k decides on draft
 * j + 1, the last one draws the final token). kept[i] = the drafts kept, out[i] = the final
 * token (vocab for a row without mass). block: 1 for block verification, 0 for the token
 * method. */
void tandem_verify_sampled(const float *logits, const float *inv_temperature, float *probs,
                           const float *q, const int64_t *ids, const int64_t *num_drafts,
                           const double *uniform, int block, int64_t batch, int64_t vocab,
                           int64_t *kept, int64_t *out, int nthreads) {
  int64_t rows = 0, starts[batch + 1], draft_starts[batch + 1];
  for (int64_t i = 0; i < batch; i++) {
    starts[i] = rows, draft_starts[i] = rows - i;
    rows += num_drafts[i] + 1;
  }
  float inv_row[rows > 0 ? rows : 1];
  for (int64_t i = 0; i < batch; i++)
    for (int64_t j = starts[i]; j <= starts[i] + num_drafts[i]; j++)
      inv_row[j] = inv_temperature[i];
  softmax_rows(logits, inv_row, probs, rows, vocab, nthreads);
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && batch >= 4)
  for (int64_t i = 0; i < batch; i++) {
    const int64_t k = num_drafts[i], d = draft_starts[i];
    const float *p = probs + starts[i] * vocab, *qi = q ? q + d * vocab : 0;
    const double *u = uniform + starts[i];
    float w = 1.0f;
    const int64_t tau = block ? block_keep(p, qi, ids + d, u, k, vocab, &w)
                              : token_keep(p, qi, ids + d, u, k, vocab);
    double sums[blocks];
    const float *row = p + tau * vocab;
    /* a rejected draft's residual, or (all kept) the bonus */
    const struct residual_row r = {row, qi && tau < k ? qi + tau * vocab : 0, w,
                                   tau < k ? ids[d + tau] : -1};
    kept[i] = tau;
    out[i] = final_token(tau < k ? &r : 0, row, vocab, u[k], sums);
  }
}

/* ---------------------------------------------------------------------------------------
 * Sampled drafts over a restricted LM head (engine/spec/proposers/draft_model.py): row r of
 * logits [rows, n] holds the draft's logits for the n tokens head[0..n-1] (increasing ids).
 * q[r] (a row of the whole vocabulary) gets softmax(logits[r] * inv_t[r]) at those tokens and
 * 0 everywhere else, and out[r] is the token drawn from it with uniform[r]: the draw walks the
 * head's masses in order, which is the widened row's own order (its other tokens have no
 * mass), so the token is distributed as q[r] (vocab for a row without mass). scratch [rows, n]
 * holds the head's distribution on the way. One call for what took a widening, a softmax
 * over the vocabulary and a draw. */
void tandem_sample_head(const float *logits, const float *inv_temperature, const int64_t *head,
                        const double *uniform, int64_t rows, int64_t n, int64_t vocab, float *q,
                        float *scratch, int64_t *out, int nthreads) {
  const int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows >= 4)
  for (int64_t r = 0; r < rows; r++) {
    float *dist = scratch + r * n, *row = q + r * vocab;
    double sums[blocks];
    softmax_row(logits + r * n, n, inv_temperature[r], dist);
    memset(row, 0, (size_t)vocab * sizeof(float));
    for (int64_t i = 0; i < n; i++) row[head[i]] = dist[i];
    const int64_t at = sample_row(dist, n, uniform[r], sums);
    out[r] = at < n ? head[at] : vocab;
  }
}

/* ---------------------------------------------------------------------------------------
 * The coupled race of seeded rows (engine/sample/sampler.py `coupled_winner`, the same tokens,
 * on CPU rows): for log-weights z[vocab] and the row's key (its seed and output position), the
 * token maximising z(x) - log E(x), E(x) = -log u(x), u(x) = (k + 1/2) / 2^24 with k the top
 * 24 bits of splitmix64 stepped x + 1 times from the key. With m = z(top) and E_top its time,
 * x can win only if E(x) < exp(z(x) - m) E_top, and E >= 1 - u, so only if z(x) >= m +
 * log(2^-10 / E_top) or 1 - u(x) < 2^-10 (u's top ten bits all ones). Those few get the exact
 * key in float64; every other token costs a hash and two compares. out[r] = -1 for a row with
 * a NaN or no finite top (the caller's own path answers those).
 *
 * z = logits / t[r] (t = 1: the logits) as float32 division rounds it (torch's `logits / t`),
 * found without dividing the row: the rounded quotient never decreases as l grows, so each
 * threshold on z is one on l (`least_quotient_at`) and only the candidates are divided. Rows
 * fewer than twice the threads are split into a share per thread (logits the LM head has just
 * written are read from memory, and each thread reads only its share). Each share gives its
 * maximum and first index, then its best candidate; the row's winner is the greatest
 * (key, -x) over the shares, the one a pass over the whole row in order finds. */
#define RACE_LUCKY ((1u << 24) - (1u << 14) - 1) /* from here 1 - u < 2^-10 (one spare) */

INLINE uint64_t race_bits(uint64_t key, int64_t x) {
  uint64_t s = key + (uint64_t)(x + 1) * 0x9E3779B97F4A7C15ull;
  s = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9ull;
  s = (s ^ (s >> 27)) * 0x94D049BB133111EBull;
  return (s ^ (s >> 31)) >> 40;
}

static double race_time(uint64_t key, int64_t x) {
  return -log(((double)race_bits(key, x) + 0.5) * 0x1p-24);
}

struct race_share {
  float m;       /* the share's largest z */
  int nan;       /* whether it holds a NaN */
  int64_t top;   /* the first x with z(x) = m */
  double best;   /* the share's best key among its candidates (-inf: none) */
  int64_t win;   /* its token */
};

/* The least float a with a / t >= v (t > 0): division by t rounds monotonically, so
 * l / t >= v exactly when l >= a, and a row is compared without dividing it. */
static float least_quotient_at(float v, float t) {
  float a = v * t;
  if (isinf(a) && !isinf(v)) a = a > 0 ? FLT_MAX : -FLT_MAX;
  while (!(a / t >= v) && a != INFINITY) a = nextafterf(a, INFINITY);
  for (float b = nextafterf(a, -INFINITY); b / t >= v && b != a; b = nextafterf(b, -INFINITY))
    a = b;
  return a;
}

/* A share's largest z = l / t (the largest l over t) and the first x with z(x) = it: the
 * first l at or above the least float with that quotient. */
static void race_max(const float *l, float t, int64_t lo, int64_t hi, struct race_share *s) {
  float top_l = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : top_l) reduction(| : nan)
  for (int64_t i = lo; i < hi; i++) {
    nan |= l[i] != l[i];
    top_l = l[i] > top_l ? l[i] : top_l;
  }
  const float m = top_l / t;
  int64_t top = lo;
  if (!nan && !isinf(m)) {
    const float a = least_quotient_at(m, t);
    for (int found = 0; !found; top += found ? 0 : 16) { /* a block of 16 at a time */
      const int n = (int)span(hi, top, 16);
#pragma omp simd reduction(| : found)
      for (int j = 0; j < n; j++) found |= l[top + j] >= a;
    }
    while (!(l[top] >= a)) top++;
  }
  s->m = m, s->nan = nan, s->top = top;
}

/* The row's largest z and its first index from its shares (in order); 0 if it races in C. */
static int race_top(const struct race_share *s, int shares, float *m, int64_t *top) {
  int nan = 0;
  *m = -INFINITY, *top = 0;
  for (int p = 0; p < shares; p++) {
    nan |= s[p].nan;
    if (s[p].m > *m) *m = s[p].m, *top = s[p].top;
  }
  return !nan && !isinf(*m);
}

/* A share's best candidate: the tokens with z >= near (l at or above the least float with
 * that quotient) or a lucky u, each keyed exactly; the top is the row's, keyed by the caller. */
static void race_candidates(const float *l, float t, int64_t lo, int64_t hi, uint64_t key,
                            float near, int64_t top, struct race_share *s) {
  const float at = least_quotient_at(near, t);
  double best = -INFINITY;
  int64_t win = hi;
  for (int64_t b = lo; b < hi; b += 16) {
    const int n = (int)span(hi, b, 16);
    int hit[16], any = 0;
    if (n == 16) {
#pragma omp simd reduction(| : any)
      for (int j = 0; j < 16; j++) {
        hit[j] = (l[b + j] >= at) | (race_bits(key, b + j) >= RACE_LUCKY);
        any |= hit[j];
      }
    } else {
      for (int j = 0; j < n; j++) {
        hit[j] = (l[b + j] >= at) | (race_bits(key, b + j) >= RACE_LUCKY);
        any |= hit[j];
      }
    }
    for (int j = 0; any && j < n; j++) {
      const int64_t x = b + j;
      if (!hit[j] || x == top) continue;
      const double k = (double)(l[x] / t) - log(race_time(key, x));
      if (k > best) best = k, win = x; /* x ascending: a tie keeps the earlier */
    }
  }
  s->best = best, s->win = win;
}

void tandem_race_rows(const float *logits, const float *temperature, const uint64_t *keys,
                      int64_t rows, int64_t vocab, int64_t *out, int nthreads) {
  const int team = nthreads > 1 ? nthreads : 1;
  const int shares = rows >= 2 * team || vocab < 4096 ? 1 : team;
  const int64_t tasks = rows * shares, width = (vocab + shares - 1) / shares;
  struct race_share small[64];
  struct race_share *s = tasks <= 64 ? small : malloc((size_t)tasks * sizeof *s);
  if (!s) {
    for (int64_t r = 0; r < rows; r++) out[r] = -1;
    return;
  }
#pragma omp parallel num_threads(team) if (team > 1 && tasks > 1)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tasks; i++) {
      const int64_t r = i / shares, lo = i % shares * width;
      const int64_t hi = lo + width < vocab ? lo + width : vocab;
      race_max(logits + r * vocab, temperature[r], lo, hi > lo ? hi : lo, s + i);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tasks; i++) {
      const int64_t r = i / shares, lo = i % shares * width;
      const int64_t hi = lo + width < vocab ? lo + width : vocab;
      float m;
      int64_t top;
      s[i].best = -INFINITY, s[i].win = vocab;
      if (!race_top(s + r * shares, shares, &m, &top) || hi <= lo) continue;
      const uint64_t key = keys[r];
      const float near = (float)((double)m + log(0x1p-10 / race_time(key, top))) - 1e-3f;
      race_candidates(logits + r * vocab, temperature[r], lo, hi, key, near, top, s + i);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      float m;
      int64_t top;
      if (!race_top(s + r * shares, shares, &m, &top)) {
        out[r] = -1;
        continue;
      }
      double best = (double)m - log(race_time(keys[r], top));
      int64_t win = top;
      for (int p = 0; p < shares; p++) {
        const struct race_share *c = s + r * shares + p;
        if (c->best > best || (c->best == best && c->win < win)) best = c->best, win = c->win;
      }
      out[r] = win;
    }
  }
  if (s != small) free(s);
}
