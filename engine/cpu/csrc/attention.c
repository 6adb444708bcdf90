#include "vec.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------------------------------
 * Paged attention for the short queries of decoding and verification.
 *
 * q, out: [tokens, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads,
 * head_dim] of float32, or of float16 / bfloat16 (--kv-cache-dtype: widened exactly as they
 * are loaded, so the arithmetic after the load is the float32 cache's, bit for bit);
 * tables: [num_seqs, table_width] block ids. Request s has q_lens[s] queries at
 * rows q_starts[s].. of q and out; its query j sits at position ctx_lens[s] - q_lens[s] + j
 * and sees the request's keys at positions 0..that position (its new keys are in the cache).
 *
 * Draft trees: with `tree` (or NULL), a query row whose tree[row] is not 0 sees every key
 * before tree_base[s] and, from there on, key tree_base[s] + i only when bit i of tree[row]
 * is set (its ancestors and itself); tree[row] = 0 keeps the causal rule.
 *
 * One task is (request, kv head, tile of up to QTILE query rows, span of keys), a row being
 * one query of one of the kv head's query heads and a span the keys at positions
 * [c * S, (c + 1) * S), S = SPLIT_KEYS (PAIRS_SPLIT_KEYS on a KV_BF16P cache) rounded down to
 * whole blocks (at least one block).
 * A task leaves each row's partial result (m, l, acc: below), and merge_tile folds a row's
 * spans in order into its output. The spans are fixed positions of the keys,
 * not shares of a request's context, so a row is split the same way in a decode and in a
 * verification. Every row of a kv head's tile reads the span's keys and values once: a
 * verification's 1 + K queries read them as a decode's one does (before, a request's rows were
 * split into smaller tiles to give each thread 4 tasks, each tile reading every key again).
 * The threads take contiguous runs of tasks of about equal work (keys times rows), so a
 * thread's next task is most often the next span of the same rows, whose first block it has
 * already asked for.
 * A group whose spans all fell to one thread is merged by it right after its last span; the
 * others after a barrier (none when no group is split). Splitting the keys lets a few long
 * requests use every thread (docs/BENCHMARKS.md, "Attention in spans of keys").
 *
 * Per cache block the task scores 8 keys at a time against every row (8 independent FMA
 * chains, summed across lanes by reduce8), then runs an online softmax (running max m,
 * running sum l) and accumulates p * v. Keys are read once per task,
 * where they are, with the next block prefetched. A row's arithmetic does not depend on the
 * other rows of its tile or batch, so a query gets the same bits in a verification and in a
 * decode at its position (tests/test_cpu_kernels.py).
 */
/* Query rows a task holds: every row of one kv head in a verification of up to 64 / group
 * tokens (21 at 3 query heads per kv head), so that a long prompt lookup's rows read each key
 * and value once, as a decode's one row does. */
#define QTILE 64
#define MAX_BLOCK 256
/* Keys a task attends at most (rounded down to whole blocks, at least one): small enough that
 * short contexts still split evenly between threads. */
#define SPLIT_KEYS 64
/* On a KV_BF16P cache: PAIRS_SPLIT_KEYS (vec.h). */
/* Partial results up to this size live on the caller's stack. */
#define STACK_BYTES 32768

/* Ask the outer caches (prefetcht2) for one kv head's keys (or values) of `tokens` cached
 * tokens of a block (rows of D elements, `ks` elements apart). A task's blocks are scattered
 * over the pool by its block table, so the hardware prefetcher does not run ahead of the next
 * one. attend_tile asks for the next block's keys when it starts a block, and for its values
 * a token at a time in the block's p * v loop (value_rows). Asked for both at once, the
 * misses filled the core's queue while its arithmetic waited behind them; spread out, they
 * arrive while it works. A tile of one or two rows has too little arithmetic a block to hide
 * them behind and asks for both at the block's start. One block ahead is enough; the outer
 * caches, not L1, because a block is more lines than L1 keeps in flight. */
INLINE void prefetch_rows(const int kv, const void *base, int64_t at, int64_t tokens,
                          int64_t ks, int64_t D) {
  const int64_t size = kv == KV_F32 ? 4 : 2; /* bytes an element */
  const char *p = (const char *)base + at * size;
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t c = 0; c < D * size; c += 64) __builtin_prefetch(p + t * ks * size + c, 0, 1);
    __builtin_prefetch(p + (t * ks + D) * size - 1, 0, 1); /* a row that starts within a line */
  }
}

/* Rows that share each key or value load: two where there are 32 vector registers (their 16
 * accumulators and the loads fit), else one. A row's arithmetic is the same either way (the
 * outputs are the same bits); pairs halve the loads when the cache is in L2. */
#ifdef __AVX512F__
#define PAIR 2
#else
#define PAIR 1
#endif

/* sc[r][g] = the scores of rows q[0..R) against the 8 keys from element `at` of k (stride
 * between keys: ks elements): per key 8 lanes summed over the head in order, then reduce8;
 * each key's load shared by the R rows. */
INLINE void score8_rows(const int KV, const int NV, const int R, v8 (*q)[NV], const void *k,
                        int64_t at, int64_t ks, v8 (*sc)[MAX_BLOCK / 8], int64_t g) {
  v8 part[2][8];
  for (int r = 0; r < R; r++)
    for (int u = 0; u < 8; u++) part[r][u] = (v8){0};
  for (int c = 0; c < NV; c++)
    for (int u = 0; u < 8; u++) {
      const v8 key = load_kv(KV, k, at + u * ks + 8 * c);
      for (int r = 0; r < R; r++) part[r][u] = madd(part[r][u], q[r][c], key);
    }
  for (int r = 0; r < R; r++) sc[r][g] = reduce8(part[r]);
}

/* acc[r] = acc[r] * rescale[r] + sum_t p[r][t] v_t over the block's n values from element
 * `at` of v (p: the rows' softmax numerators in sc), each value's load shared by the R rows.
 * With each of its first `ahead` values it asks for the next block's value at the same
 * position (that block's values start at element `next`). */
INLINE void value_rows(const int KV, const int NV, const int R, v8 (*acc)[NV],
                       v8 (*sc)[MAX_BLOCK / 8], const float *rescale, const void *v, int64_t at,
                       int64_t ks, int64_t n, int64_t next, int64_t ahead) {
  v8 a[2][NV];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NV; c++) a[r][c] = acc[r][c] * rescale[r];
  for (int64_t t = 0; t < n; t++) {
    if (t < ahead) prefetch_rows(KV, v, next + t * ks, 1, ks, 8 * NV);
    v8 pt[2];
    for (int r = 0; r < R; r++) pt[r] = splat(((const float *)sc[r])[t]);
    for (int c = 0; c < NV; c++) {
      const v8 value = load_kv(KV, v, at + t * ks + 8 * c);
      for (int r = 0; r < R; r++) a[r][c] = madd(a[r][c], pt[r], value);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NV; c++) acc[r][c] = a[r][c];
}

INLINE void attend_tile(const int KV, const int NV, const float *q, const void *k_cache,
                        const void *v_cache,
                        const int64_t *table, int64_t q_start, int64_t q_len, int64_t ctx,
                        const int64_t *tree, int64_t base, int64_t kv_head, int64_t row0,
                        int rows,
                        int64_t heads, int64_t kv_heads, int64_t block_size, float scale,
                        int64_t b_lo, int64_t b_hi, float *part) {
  if (rows < 1) return;
  const int64_t D = 8 * NV, group = heads / kv_heads, ks = kv_heads * D;
  v8 qv[QTILE][NV], acc[QTILE][NV], sc[QTILE][MAX_BLOCK / 8];
  float m[QTILE], l[QTILE];
  int64_t pos[QTILE];
  uint64_t bits[QTILE];
  int64_t last = 0; /* the furthest key any row sees */
  for (int i = 0; i < rows; i++) {
    const int64_t j = (row0 + i) / group, h = kv_head * group + (row0 + i) % group;
    const float *qp = q + ((q_start + j) * heads + h) * D;
    for (int c = 0; c < NV; c++) {
      qv[i][c] = load(qp + 8 * c) * scale;
      acc[i][c] = (v8){0};
    }
    bits[i] = tree ? (uint64_t)tree[q_start + j] : 0;
    pos[i] = bits[i] ? ctx - 1 : ctx - q_len + j; /* a tree row's keys are masked below */
    last = pos[i] > last ? pos[i] : last;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t b = b_lo; b < b_hi && b * block_size <= last; b++) {
    const int64_t first = b * block_size;
    const int64_t at = (table[b] * block_size * kv_heads + kv_head) * D; /* its first key */
    const int64_t n = last - first + 1 < block_size ? last - first + 1 : block_size;
    /* Groups of 8 keys scored by score8_rows: every one within the block's capacity, even
     * past the last key any row sees (those lanes read stale slots of the block and are
     * masked), so that a key's score is the same bits whichever rows share the tile: a
     * verification's earlier query and a decode at its position. Only the tail of a block
     * whose size is not a multiple of 8 is scored key by key. */
    const int64_t groups = (n + 7) / 8;
    const int64_t full = groups < block_size / 8 ? groups : block_size / 8;
    if (b == b_lo) {
      prefetch_rows(KV, k_cache, at, n, ks, D);
      prefetch_rows(KV, v_cache, at, n, ks, D);
    }
    /* The next block: where, and its tokens any row sees. At a span's last block that is the
     * next span's first, most often this thread's next task. */
    int64_t next = 0, ahead = 0;
    if (first + block_size <= last) {
      next = (table[b + 1] * block_size * kv_heads + kv_head) * D;
      ahead = last - first - block_size + 1 < block_size ? last - first - block_size + 1
                                                         : block_size;
      prefetch_rows(KV, k_cache, next, ahead, ks, D); /* its keys now, its values in p * v */
      if (rows <= PAIR) { /* too little arithmetic a block to hide them behind: now as well */
        prefetch_rows(KV, v_cache, next, ahead, ks, D);
        ahead = 0;
      }
    }
    /* Scores, masks and the softmax update, row by row (pairs of rows share each key load);
     * then p * v, pairs of live rows sharing each value load. */
    float rescale[QTILE];
    int live[QTILE];
    for (int i = 0; i < rows; i += PAIR) {
      const int r = rows - i < PAIR ? rows - i : PAIR;
      for (int64_t g = 0; g < full; g++) {
        if (r == 2) score8_rows(KV, NV, 2, qv + i, k_cache, at + g * 8 * ks, ks, sc + i, g);
        else score8_rows(KV, NV, 1, qv + i, k_cache, at + g * 8 * ks, ks, sc + i, g);
      }
    }
    for (int i = 0; i < rows; i++) {
      const v8i visible = (v8i){0} + (int32_t)(pos[i] - first); /* key t visible: t <= this */
      for (int64_t g = 0; g < full; g++)
        sc[i][g] = select_v(lane + (int32_t)(g * 8) <= visible, sc[i][g], splat(-INFINITY));
      if (full < groups) { /* the keys past a block's last multiple of 8 */
        v8 s = splat(-INFINITY);
        for (int64_t t = full * 8; t < n && t <= pos[i] - first; t++) {
          v8 d = (v8){0};
          for (int c = 0; c < NV; c++)
            d = madd(d, qv[i][c], load_kv(KV, k_cache, at + t * ks + 8 * c));
          s[t - full * 8] = hsum(d);
        }
        sc[i][full] = s;
      }
      if (bits[i]) { /* a draft-tree row: from the tree's base on, only its ancestors */
        float *row = (float *)sc[i];
        const int64_t lo = base > first ? base : first;
        for (int64_t t = lo; t < first + n; t++)
          if (!((bits[i] >> (t - base)) & 1)) row[t - first] = -INFINITY;
      }
      v8 mx8 = sc[i][0];
      for (int64_t g = 1; g < groups; g++) mx8 = select_v(mx8 > sc[i][g], mx8, sc[i][g]);
      const float mx = fmaxf(hmax(mx8), m[i]);
      live[i] = mx != -INFINITY; /* else nothing is visible to this row in this block */
      if (!live[i]) continue;
      rescale[i] = expf(m[i] - mx); /* 0 while nothing was seen */
      m[i] = mx;
      v8 sum = (v8){0};
      for (int64_t g = 0; g < groups; g++) {
        const v8 p = exp_v(sc[i][g] - splat(mx));
        sc[i][g] = p;
        sum += p;
      }
      l[i] = l[i] * rescale[i] + hsum(sum);
    }
    for (int i = 0; i < rows; i++) {
      if (!live[i]) continue;
      if (PAIR == 2 && i + 1 < rows && live[i + 1]) {
        value_rows(KV, NV, 2, acc + i, sc + i, rescale + i, v_cache, at, ks, n, next, ahead);
        i++;
      } else {
        value_rows(KV, NV, 1, acc + i, sc + i, rescale + i, v_cache, at, ks, n, next, ahead);
      }
      ahead = 0; /* the first live rows' loop asked for them */
    }
  }
  for (int i = 0; i < rows; i++) {
    float *o = part + i * (D + 2);
    o[0] = m[i];
    o[1] = l[i];
    for (int c = 0; c < NV; c++) store(o + 2 + 8 * c, acc[i][c]);
  }
}

/* The rows' outputs from their spans' partial results (m, l, acc), folded in span order: the
 * first span a row sees is taken as it is, each later one rescaled to the larger maximum;
 * then out = acc / l. A row that sees a single span gets acc * (1 / l) of that span: what
 * one pass over its blocks gives. */
INLINE void merge_tile(const int NV, const float *part, int64_t spans, int64_t stride,
                       int64_t q_start, int64_t kv_head, int64_t row0, int rows, int64_t heads,
                       int64_t kv_heads, float *out) {
  const int64_t D = 8 * NV, group = heads / kv_heads;
  for (int i = 0; i < rows; i++) {
    v8 acc[NV];
    float m = -INFINITY, l = 0.0f;
    for (int64_t c = 0; c < spans; c++) {
      const float *p = part + c * stride + i * (D + 2);
      if (p[0] == -INFINITY) continue; /* nothing visible to this row in this span */
      if (m == -INFINITY) {
        m = p[0];
        l = p[1];
        for (int v = 0; v < NV; v++) acc[v] = load(p + 2 + 8 * v);
        continue;
      }
      const float mx = fmaxf(m, p[0]), a = expf(m - mx), b = expf(p[0] - mx);
      for (int v = 0; v < NV; v++) acc[v] = madd(acc[v] * a, load(p + 2 + 8 * v), splat(b));
      l = fmaf(p[1], b, l * a);
      m = mx;
    }
    const int64_t j = (row0 + i) / group, h = kv_head * group + (row0 + i) % group;
    float *o = out + ((q_start + j) * heads + h) * D;
    const v8 inv = splat(1.0f / l);
    for (int v = 0; v < NV; v++) store(o + 8 * v, acc[v] * inv);
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

/* merge_tile for the head size d. */
static void merge_group(int64_t d, const float *part, int64_t spans, int64_t stride,
                        int64_t q_start, int64_t kv_head, int64_t row0, int rows, int64_t heads,
                        int64_t kv_heads, float *out) {
  switch (d) {
#define CASE(d)                                                                          \
  case d:                                                                                \
    merge_tile(d / 8, part, spans, stride, q_start, kv_head, row0, rows, heads, kv_heads, \
               out);                                                                     \
    break;
    HEAD_DIMS(CASE)
#undef CASE
  }
}

INLINE int omp_thread(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* Group g's rows (g = (request * kv_heads + kv head) * tiles + tile): its request, kv head
 * and first row; returns how many rows it has (0 when the request's are fewer than row0). */
INLINE int group_rows(int64_t g, int64_t tiles, int64_t tile, int64_t kv_heads, int64_t group,
                      const int64_t *q_lens, int64_t *s, int64_t *kv_head, int64_t *row0) {
  *s = g / (kv_heads * tiles);
  *kv_head = g / tiles % kv_heads;
  *row0 = g % tiles * tile;
  const int64_t left = q_lens[*s] * group - *row0;
  return left <= 0 ? 0 : left < tile ? (int)left : (int)tile;
}

/* attend_tile for each cache type and head size, each a function of its own: inlined all into
 * the dispatcher below, the compiler's time on it grew faster than their number (minutes
 * where vectors are narrower than v8, as in SSE2 or NEON builds). */
#define TILE_FN(kv, d)                                                                     \
  static __attribute__((noinline)) void attend_##kv##_##d(                               \
      const float *q, const void *k_cache, const void *v_cache, const int64_t *table,     \
      int64_t q_start, int64_t q_len, int64_t ctx, const int64_t *tree, int64_t base,     \
      int64_t kv_head, int64_t row0, int rows, int64_t heads, int64_t kv_heads,           \
      int64_t block_size, float scale, int64_t b_lo, int64_t b_hi, float *part) {         \
    attend_tile(kv, d / 8, q, k_cache, v_cache, table, q_start, q_len, ctx, tree, base,   \
                kv_head, row0, rows, heads, kv_heads, block_size, scale, b_lo, b_hi, part); \
  }
#define TILE_FNS(d) TILE_FN(KV_F32, d) TILE_FN(KV_F16, d) TILE_FN(KV_BF16, d)
HEAD_DIMS(TILE_FNS)
#undef TILE_FNS
#undef TILE_FN

/* attention_pairs.c: the tiles on a KV_BF16P cache, where this build has them. */
int tandem_attention_pairs(int64_t head_dim, int64_t block_size);
#define PAIRS_DECL(d) void tandem_attend_pairs_##d(PAIRS_PARAMS);
PAIRS_DIMS(PAIRS_DECL)
#undef PAIRS_DECL

/* Returns 0, -1 for a shape tandem_attention_supports refuses or an unknown kv_type, or -2
 * when the partial results cannot be allocated (nothing is written either way). The caches
 * hold kv_type elements (KV_F32, KV_F16, KV_BF16: vec.h), or KV_BF16P pairs where
 * tandem_attention_pairs takes the shape. */
int tandem_paged_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *tables, int64_t table_width, const int64_t *q_starts,
                           const int64_t *q_lens, const int64_t *ctx_lens,
                           const int64_t *tree, const int64_t *tree_base, int64_t num_seqs,
                           float *out, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           int kv_type, int nthreads) {
  if (!tandem_attention_supports(heads, kv_heads, head_dim, block_size)) return -1;
  if (kv_type == KV_BF16P ? !tandem_attention_pairs(head_dim, block_size)
                          : kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16)
    return -1;
  const int64_t group = heads / kv_heads;
  int64_t most = 1, longest = 1; /* query rows of the longest request; keys of the longest */
  for (int64_t s = 0; s < num_seqs; s++) {
    if (q_lens[s] * group > most) most = q_lens[s] * group;
    if (ctx_lens[s] > longest) longest = ctx_lens[s];
  }
  const int64_t tile = most < QTILE ? most : QTILE;
  const int64_t tiles = (most + tile - 1) / tile;
  const int64_t split_keys = kv_type == KV_BF16P ? PAIRS_SPLIT_KEYS : SPLIT_KEYS;
  const int64_t span_blocks = split_keys > block_size ? split_keys / block_size : 1;
  const int64_t span_keys = span_blocks * block_size;
  const int64_t spans = (longest + span_keys - 1) / span_keys;
  const int64_t groups = num_seqs * kv_heads * tiles, stride = tile * (head_dim + 2);
  const int64_t tasks = groups * spans;
  /* The partial results, each task's thread and whether a group's spans are on two threads:
   * on the stack when they are small (a decode or verification at c=1), else on the heap. */
  const size_t bytes = (size_t)(tasks * stride) * sizeof(float) + (size_t)tasks * sizeof(int32_t)
                       + (size_t)groups;
  _Alignas(64) char small[STACK_BYTES];
  char *buffer = bytes <= sizeof small ? small : malloc(bytes);
  if (!buffer) return -2;
  float *part = (float *)buffer;
  int32_t *owner = (int32_t *)(part + tasks * stride);
  uint8_t *split = (uint8_t *)(owner + tasks);
  /* Each task's work (its request's keys in its span times its rows), kept in owner[] until
   * the total is known; then thread t takes the tasks whose middle falls in the t-th of
   * nthreads equal shares of the work, in order: contiguous runs. */
  int64_t total = 0;
  for (int64_t task = 0; task < tasks; task++) {
    int64_t s, kv_head, row0;
    const int n = group_rows(task / spans, tiles, tile, kv_heads, group, q_lens, &s, &kv_head,
                             &row0);
    const int64_t keys = ctx_lens[s] - task % spans * span_keys;
    owner[task] = keys > 0 ? (int32_t)((keys < span_keys ? keys : span_keys) * n) : 0;
    total += owner[task];
  }
  const int64_t team = nthreads > 1 ? nthreads : 1;
  int any_split = 0;
  for (int64_t task = 0, done = 0; task < tasks; task++) {
    const int64_t work = owner[task];
    owner[task] = total > 0 ? (int32_t)((2 * done + work) * team / (2 * total + 1)) : 0;
    done += work;
    const int64_t g = task / spans;
    if (task % spans == 0) split[g] = 0;
    else if (owner[task] != owner[task - 1]) split[g] = 1, any_split = 1;
  }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
#ifdef _OPENMP
    const int32_t me = omp_get_num_threads() == team ? omp_get_thread_num() : -1;
#else
    const int32_t me = 0;
#endif
    /* A team of another size than asked for (OMP_THREAD_LIMIT, nesting) runs every task on
     * its first thread (me = -1 on all of them). */
    for (int64_t task = 0; task < tasks; task++) {
      if (me >= 0 ? owner[task] != me : omp_thread() != 0) continue;
      const int64_t g = task / spans, c = task % spans;
      int64_t s, kv_head, row0;
      const int n = group_rows(g, tiles, tile, kv_heads, group, q_lens, &s, &kv_head, &row0);
      if (n == 0) continue;
      float *out_part = part + task * stride;
      if (c * span_keys >= ctx_lens[s]) { /* past the request's keys: nothing seen */
        for (int i = 0; i < n; i++) out_part[i * (head_dim + 2)] = -INFINITY;
      } else {
        const int64_t *table = tables + s * table_width;
#define TILE(kv, d)                                                                        \
  attend_##kv##_##d(q, k_cache, v_cache, table, q_starts[s], q_lens[s], ctx_lens[s],       \
              tree, tree ? tree_base[s] : 0, kv_head, row0, n, heads, kv_heads, block_size, \
              scale, c * span_blocks, (c + 1) * span_blocks, out_part)
#define CASE(d)                                                         \
  case d:                                                               \
    if (kv_type == KV_F16) TILE(KV_F16, d);                             \
    else if (kv_type == KV_BF16) TILE(KV_BF16, d);                      \
    else TILE(KV_F32, d);                                               \
    break;
#define PAIRS(d)                                                                           \
  case d:                                                                                  \
    tandem_attend_pairs_##d(q, k_cache, v_cache, table, q_starts[s], q_lens[s], ctx_lens[s], \
                            tree, tree ? tree_base[s] : 0, kv_head, row0, n, heads, kv_heads, \
                            block_size, scale, c * span_blocks, (c + 1) * span_blocks,       \
                            out_part);                                                       \
    break;
        if (kv_type == KV_BF16P) {
          switch (head_dim) { PAIRS_DIMS(PAIRS) }
        } else {
          switch (head_dim) { HEAD_DIMS(CASE) }
        }
#undef PAIRS
#undef CASE
#undef TILE
      }
      if (c == spans - 1 && !split[g]) /* every span of the group was this thread's */
        merge_group(head_dim, part + g * spans * stride, spans, stride, q_starts[s], kv_head,
                    row0, n, heads, kv_heads, out);
    }
    if (any_split) {
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; g++) {
        int64_t s, kv_head, row0;
        const int n = group_rows(g, tiles, tile, kv_heads, group, q_lens, &s, &kv_head, &row0);
        if (!split[g] || n == 0) continue;
        merge_group(head_dim, part + g * spans * stride, spans, stride, q_starts[s], kv_head,
                    row0, n, heads, kv_heads, out);
      }
    }
  }
  if (buffer != small) free(buffer);
  return 0;
}
