/* Tandem's CPU kernels: float32 linear layers on panel-packed weights, and paged attention
 * reading K/V straight from the block tables. Built once per machine by engine/cpu_kernels.py
 * (cc -O3 -march=native -fopenmp) and called through ctypes; plain C with GCC/Clang vector
 * extensions, so the same source compiles to AVX2, AVX-512 or NEON code.
 *
 * Why: a decoding or verifying step multiplies every weight by a handful of rows and attends a
 * handful of queries per request. torch's CPU GEMMs are built for big matrices (on the default
 * pair, one AVX2 core, 5 rows cost 1.6x what 1 row costs) and its attention needs each
 * request's keys gathered into a dense tensor first. Here a weight is streamed from memory
 * once per call whatever the row count, and keys are read once, in place.
 *
 * Threads: each call takes its thread count from the caller (torch's); the OpenMP runtime is
 * the one torch already loaded (same soname), so both share one pool of workers.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))

INLINE v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
INLINE v8 load(const float *p) { return *(const v8 *)p; }
INLINE void store(float *p, v8 v) { *(v8 *)p = v; } /* v8 is 4-byte aligned: any float * */
INLINE v8 select_v(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }
INLINE float hsum(v8 v) {
  float s = 0;
  for (int i = 0; i < 8; i++) s += v[i];
  return s;
}
INLINE float hmax(v8 v) {
  float m = v[0];
  for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
  return m;
}

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
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
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

/* ---------------------------------------------------------------------------------------
 * Paged attention for the short queries of decoding and verification.
 *
 * q, out: [tokens, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads,
 * head_dim]; tables: [num_seqs, table_width] block ids. Request s has q_lens[s] queries at
 * rows q_starts[s].. of q and out; its query j sits at position ctx_lens[s] - q_lens[s] + j
 * and sees the request's keys at positions 0..that position (its new keys are in the cache).
 *
 * One task is (request, kv head, tile of up to QTILE query rows), a row being one query of
 * one of the kv head's query heads. Per cache block the task scores 8 keys at a time against
 * every row (8 independent FMA chains, summed across lanes by reduce8), then runs an online
 * softmax (running max m, running sum l) and accumulates p * v. Keys are read once per task,
 * where they are.
 */
#define QTILE 16
#define MAX_BLOCK 256

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
 * the result is exactly 0; inputs past 88 are taken as 88 (exp(88) ~ 1.7e38). */
INLINE v8 exp_v(v8 x) {
  const v8i dead = x < splat(-87.0f);
  x = (v8)((v8i)x & ~dead);
  x = select_v(x > splat(88.0f), splat(88.0f), x);
  const v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8 n = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
  n -= (v8)((v8i)splat(1.0f) & (n > fx)); /* floor */
  x = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  v8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.0f);
  const v8i scale = (__builtin_convertvector(n, v8i) + 127) << 23; /* 2^n */
  return (v8)((v8i)(y * (v8)scale) & ~dead);
}

/* Scores of one query row against 8 consecutive keys (stride between keys: ks floats). */
INLINE v8 score8(const int NV, const v8 *q, const float *k, int64_t ks) {
  v8 part[8];
  for (int u = 0; u < 8; u++) part[u] = (v8){0};
  for (int c = 0; c < NV; c++)
    for (int u = 0; u < 8; u++) part[u] += q[c] * load(k + u * ks + 8 * c);
  return reduce8(part);
}

INLINE void attend_tile(const int NV, const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *table, int64_t q_start, int64_t q_len, int64_t ctx,
                        int64_t kv_head, int64_t row0, int rows, int64_t heads,
                        int64_t kv_heads, int64_t block_size, float scale, float *out) {
  if (rows < 1) return;
  const int64_t D = 8 * NV, group = heads / kv_heads, ks = kv_heads * D;
  v8 qv[QTILE][NV], acc[QTILE][NV], sc[QTILE][MAX_BLOCK / 8];
  float m[QTILE], l[QTILE];
  int64_t pos[QTILE];
  for (int i = 0; i < rows; i++) {
    const int64_t j = (row0 + i) / group, h = kv_head * group + (row0 + i) % group;
    const float *qp = q + ((q_start + j) * heads + h) * D;
    for (int c = 0; c < NV; c++) {
      qv[i][c] = load(qp + 8 * c) * scale;
      acc[i][c] = (v8){0};
    }
    pos[i] = ctx - q_len + j;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  const int64_t last = pos[rows - 1]; /* rows are in query order: the furthest position */
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t b = 0; b * block_size <= last; b++) {
    const int64_t first = b * block_size;
    const float *kb = k_cache + (table[b] * block_size * kv_heads + kv_head) * D;
    const float *vb = v_cache + (table[b] * block_size * kv_heads + kv_head) * D;
    const int64_t n = last - first + 1 < block_size ? last - first + 1 : block_size;
    const int64_t full = n / 8, groups = (n + 7) / 8;
    for (int i = 0; i < rows; i++) {
      const v8i visible = (v8i){0} + (int32_t)(pos[i] - first); /* key t visible: t <= this */
      for (int64_t g = 0; g < full; g++) {
        const v8 s = score8(NV, qv[i], kb + g * 8 * ks, ks);
        sc[i][g] = select_v(lane + (int32_t)(g * 8) <= visible, s, splat(-INFINITY));
      }
      if (full < groups) { /* the last few keys of a partly used block */
        v8 s = splat(-INFINITY);
        for (int64_t t = full * 8; t < n && t <= pos[i] - first; t++) {
          v8 d = (v8){0};
          for (int c = 0; c < NV; c++) d += qv[i][c] * load(kb + t * ks + 8 * c);
          s[t - full * 8] = hsum(d);
        }
        sc[i][full] = s;
      }
      v8 mx8 = sc[i][0];
      for (int64_t g = 1; g < groups; g++) mx8 = select_v(mx8 > sc[i][g], mx8, sc[i][g]);
      const float mx = fmaxf(hmax(mx8), m[i]);
      if (mx == -INFINITY) continue; /* nothing visible to this row in this block */
      const float rescale = expf(m[i] - mx); /* 0 while nothing was seen */
      m[i] = mx;
      v8 sum = (v8){0};
      for (int64_t g = 0; g < groups; g++) {
        const v8 p = exp_v(sc[i][g] - splat(mx));
        sc[i][g] = p;
        sum += p;
      }
      l[i] = l[i] * rescale + hsum(sum);
      v8 a[NV];
      for (int c = 0; c < NV; c++) a[c] = acc[i][c] * rescale;
      const float *p = (const float *)sc[i];
      for (int64_t t = 0; t < n; t++) {
        const v8 pt = splat(p[t]);
        for (int c = 0; c < NV; c++) a[c] += pt * load(vb + t * ks + 8 * c);
      }
      for (int c = 0; c < NV; c++) acc[i][c] = a[c];
    }
  }
  for (int i = 0; i < rows; i++) {
    const int64_t j = (row0 + i) / group, h = kv_head * group + (row0 + i) % group;
    float *o = out + ((q_start + j) * heads + h) * D;
    const v8 inv = splat(1.0f / l[i]);
    for (int c = 0; c < NV; c++) store(o + 8 * c, acc[i][c] * inv);
  }
}

/* The head sizes compiled (each with its own unrolled tile): those of the common model
 * families. */
#define HEAD_DIMS(X) X(16) X(32) X(64) X(80) X(96) X(128) X(256)

/* The shapes tandem_paged_attention handles: a head size in HEAD_DIMS, blocks of at most
 * MAX_BLOCK tokens, query heads a multiple of kv heads. */
int tandem_attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t block_size) {
  int known = 0;
#define KNOWN(d) known |= head_dim == d;
  HEAD_DIMS(KNOWN)
#undef KNOWN
  return known && block_size >= 1 && block_size <= MAX_BLOCK && kv_heads >= 1 &&
         heads % kv_heads == 0;
}

/* Returns 0, or -1 for a shape tandem_attention_supports refuses (nothing is written). */
int tandem_paged_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t table_width, const int64_t *q_starts,
                           const int64_t *q_lens, const int64_t *ctx_lens, int64_t num_seqs,
                           float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int nthreads) {
  if (!tandem_attention_supports(heads, kv_heads, head_dim, block_size)) return -1;
  const int64_t group = heads / kv_heads;
  int64_t tiles = 1;
  for (int64_t s = 0; s < num_seqs; s++) {
    const int64_t t = (q_lens[s] * group + QTILE - 1) / QTILE;
    tiles = t > tiles ? t : tiles;
  }
  const int64_t tasks = num_seqs * kv_heads * tiles;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic) if (nthreads > 1)
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t s = task / (kv_heads * tiles), kv_head = task / tiles % kv_heads;
    const int64_t row0 = task % tiles * QTILE, rows = q_lens[s] * group;
    if (row0 >= rows) continue;
    const int n = rows - row0 < QTILE ? (int)(rows - row0) : QTILE;
    const int64_t *table = tables + s * table_width;
#define TILE(d)                                                                           \
  case d:                                                                                 \
    attend_tile(d / 8, q, k_cache, v_cache, table, q_starts[s], q_lens[s], ctx_lens[s],   \
                kv_head, row0, n, heads, kv_heads, block_size, scale, out);               \
    break;
    switch (head_dim) { HEAD_DIMS(TILE) }
#undef TILE
  }
  return 0;
}

/* ---------------------------------------------------------------------------------------
 * The small steps of a Llama-family layer, each one call instead of a chain of torch
 * operators (most of a small model's pass on the CPU is that chain's per-call cost).
 */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row of dim values (out may be x). */
void tandem_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float *o = out + r * dim;
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * weight[i];
  }
}

/* out[r] = silu(gu[r, :inter]) * gu[r, inter:] for the fused gate/up output gu[rows, 2 inter];
 * silu(g) = g / (1 + exp(-g)). */
void tandem_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * 2 * inter, *u = g + inter;
    float *o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const v8 gv = load(g + i);
      store(o + i, gv / (splat(1.0f) + exp_v(-gv)) * load(u + i));
    }
    for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* The attention inputs of a layer, from its fused q/k/v projection qkv[tokens, (heads +
 * 2 kv_heads) * head_dim]: q and k get the rotary embedding (rotate-half convention, cos/sin
 * tables [positions, head_dim] looked up at each token's position), q goes to q_out[tokens,
 * heads, head_dim], and k and v are written to their cache slots (caches viewed as [slots,
 * kv_heads, head_dim]). */
void tandem_rotary_cache(const float *qkv, const int64_t *positions, const int64_t *slots,
                         const float *cos_t, const float *sin_t, int64_t tokens, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, float *q_out, float *k_cache,
                         float *v_cache) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  for (int64_t t = 0; t < tokens; t++) {
    const float *row = qkv + t * width;
    const float *c = cos_t + positions[t] * head_dim, *s = sin_t + positions[t] * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
      const float *x = row + h * head_dim;
      float *o = h < heads ? q_out + (t * heads + h) * head_dim
                           : k_cache + (slots[t] * kv_heads + h - heads) * head_dim;
      for (int64_t i = 0; i < half; i++) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
    }
    memcpy(v_cache + slots[t] * kv_heads * head_dim, row + (heads + kv_heads) * head_dim,
           (size_t)(kv_heads * head_dim) * sizeof(float));
  }
}
