#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * attention.c's tasks on a cache of bfloat16 pairs (KV_BF16P, `--cpu-attention bfloat16`):
 * scores and p * v as VDPBF16PS dot products, two bfloat16 products into each float32 lane.
 *
 * Why: a verified row of a long context spends most of its attention on multiply-adds whose
 * result is then summed across lanes (scores) or that stream values one token at a time. Laid
 * out for the dot-product instruction, 16 keys' scores come out in the 16 lanes of one
 * register with no reduction, and a value register holds two tokens of 16 dimensions: a
 * third of the float32 kernel's time a row (docs/CPU.md).
 *
 * Numbers: q * scale and the softmax numerators p are rounded to bfloat16 (nearest even),
 * as K and V are in the cache; products and sums are float32 (the instruction ignores
 * MXCSR and takes subnormal inputs as 0). l sums the rounded p, so the weights applied to the
 * values are exactly the ones normalized. This is FlashAttention's bfloat16 arithmetic on
 * GPUs; it changes the served model's numbers (docs/CPU.md says by how much).
 *
 * Layout (element offsets within the region of one block and kv head, B * D elements, region
 * (block * kv_heads + kv_head) * B * D of the cache): key t of the block, dimension d at
 * (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2 (16 keys' pair (d, d + 1) in one
 * 64-byte line); value t, d at (t / 2) * 2 * D + d * 2 + t % 2 (two tokens' dimension d
 * side by side). layer.c's tandem_rotary_cache writes it; engine/cpu/pairs.py views it.
 *
 * A task (attention.c: a tile of rows, a span of keys) runs in sub-tiles of up to 24 / (D /
 * 16) rows (their value sums in registers). Each row: its scores over the span, masked
 * (causal, draft tree, and every lane past the last key any row sees), one softmax over the
 * span, then p * v over the span's token pairs up to the last key any row of the sub-tile
 * sees (a pair past it loads its first token alone). A row's arithmetic does not depend on
 * the rows beside it: a key a row does not see adds p = 0 exactly, so a decode and a
 * verification give a query the same bits (tests/test_cpu_attention_pairs.py).
 */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

int tandem_attention_pairs(int64_t head_dim, int64_t block_size) {
  return head_dim % 32 == 0 && head_dim >= 32 && head_dim <= 128 && block_size % 16 == 0 &&
         block_size <= PAIRS_SPLIT_KEYS; /* a task's span: at most PAIRS_SPLIT_KEYS keys */
}

/* Visible lanes of 16 keys from position `at` for a row at `pos` with draft-tree bits
 * `bits` (0: causal) from `base` on. */
INLINE __mmask16 visible16(int64_t at, int64_t pos, uint64_t bits, int64_t base) {
  const int64_t upto = pos - at + 1; /* keys at .. pos */
  __mmask16 m = upto >= 16 ? 0xffff : upto <= 0 ? 0 : (__mmask16)((1u << upto) - 1);
  if (bits && at + 16 > base) {
    uint32_t tree; /* lane i: key at + i is before base, or an ancestor */
    if (at >= base) tree = at - base < 64 ? (uint32_t)(bits >> (at - base)) : 0;
    else {
      const int64_t before = base - at; /* 1..15 lanes before the tree */
      tree = (uint32_t)(bits << before) | ((1u << before) - 1);
    }
    m &= (__mmask16)tree;
  }
  return m;
}

/* R rows (of a task's tile: their bf16 q pairs qb, positions, tree bits) over blocks
 * b_lo..b_hi: writes each row's (m, l, acc) to part (rows D + 2 floats apart). */
INLINE void pairs_rows(const int NV, const int R, const uint32_t *qb, const int64_t *pos,
                       const uint64_t *bits, int64_t base, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *table, int64_t kv_head,
                       int64_t kv_heads, int64_t block_size, int64_t b_lo, int64_t b_hi,
                       float *part) {
  const int64_t D = 16 * NV, DP = D / 2, region = block_size * D;
  int64_t last = 0;
  for (int r = 0; r < R; r++) last = pos[r] > last ? pos[r] : last;
  const int64_t first = b_lo * block_size;
  /* Keys scored: whole groups of 16 up to the last one any row sees, within the span. */
  int64_t end = (b_hi * block_size < last + 1 ? b_hi * block_size : last + 1) - first;
  if (end <= 0) {
    for (int r = 0; r < R; r++) part[r * (D + 2)] = -INFINITY;
    return;
  }
  const int64_t chunks = (end + 15) / 16;
  _Alignas(64) float sc[6][PAIRS_SPLIT_KEYS];
  _Alignas(64) uint16_t pb[6][PAIRS_SPLIT_KEYS];
  const int64_t per_block = block_size / 16;
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t b = b_lo + c / per_block;
    const __m512i *k = (const __m512i *)(k_cache + (table[b] * kv_heads + kv_head) * region +
                                         (c % per_block) * 16 * D);
    __m512 s[6][2]; /* fixed sizes: registers once unrolled (a variable-length array stays in memory) */
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < DP; dp += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k + dp);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k + dp + 1);
      for (int r = 0; r < R; r++) {
        s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, (__m512bh)_mm512_set1_epi32(qb[r * DP + dp]));
        s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, (__m512bh)_mm512_set1_epi32(qb[r * DP + dp + 1]));
      }
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(sc[r] + 16 * c, _mm512_add_ps(s[r][0], s[r][1]));
  }
  /* Per row: mask, the span's softmax, p rounded to bfloat16 (l sums the rounded p). */
  float m[6], l[6];
  for (int r = 0; r < R; r++) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < chunks; c++) {
      const __mmask16 see = visible16(first + 16 * c, pos[r], bits[r], base);
      const __m512 v = _mm512_mask_blend_ps(see, _mm512_set1_ps(-INFINITY),
                                            _mm512_load_ps(sc[r] + 16 * c));
      _mm512_store_ps(sc[r] + 16 * c, v);
      mx = _mm512_max_ps(mx, v);
    }
    m[r] = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
      const __m512 e = m[r] == -INFINITY ? _mm512_setzero_ps()
                                          : (__m512)exp16((v16)_mm512_sub_ps(
                                                _mm512_load_ps(sc[r] + 16 * c), _mm512_set1_ps(m[r])));
      const __m256bh h = _mm512_cvtneps_pbh(e);
      _mm256_store_si256((__m256i *)(pb[r] + 16 * c), (__m256i)h);
      sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(h));
    }
    l[r] = _mm512_reduce_add_ps(sum);
  }
  /* p * v over the token pairs up to the last key any row sees. */
  __m512 acc[6][8];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = b_lo, t0 = 0; t0 < end; b++, t0 += block_size) {
    const uint16_t *vb = v_cache + (table[b] * kv_heads + kv_head) * region;
    const int64_t n = end - t0 < block_size ? end - t0 : block_size; /* its keys any row sees */
    for (int64_t t = 0; t < n; t += 2) {
      const __mmask32 take = t + 1 < n ? 0xffffffffu : 0x55555555u; /* a lone last token */
      __m512bh val[8];
      for (int v = 0; v < NV; v++)
        val[v] = (__m512bh)_mm512_maskz_loadu_epi16(take, vb + t * D + 32 * v);
      for (int r = 0; r < R; r++) {
        uint32_t pp;
        memcpy(&pp, pb[r] + t0 + t, 4);
        const __m512bh p = (__m512bh)_mm512_set1_epi32((int32_t)pp);
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], val[v], p);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    float *o = part + r * (D + 2);
    o[0] = m[r];
    o[1] = l[r];
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + 2 + 16 * v, acc[r][v]);
  }
}

/* attention.c's attend_tile on a KV_BF16P cache: the tile's rows in sub-tiles. */
INLINE void attend_pairs(const int NV, const float *q, const void *k_cache,
                         const void *v_cache, const int64_t *table, int64_t q_start,
                         int64_t q_len, int64_t ctx, const int64_t *tree, int64_t base,
                         int64_t kv_head, int64_t row0, int rows, int64_t heads,
                         int64_t kv_heads, int64_t block_size, float scale, int64_t b_lo,
                         int64_t b_hi, float *part) {
  const int MOST = 24 / NV < 6 ? 24 / NV : 6; /* rows a sub-tile: their value sums fit */
  const int64_t D = 16 * NV, DP = D / 2, group = heads / kv_heads;
  uint32_t qb[64 * 64]; /* a tile's rows (attention.c's QTILE, 64) of up to 64 pairs */
  int64_t pos[64];
  uint64_t bits[64];
  for (int i = 0; i < rows; i++) {
    const int64_t j = (row0 + i) / group, h = kv_head * group + (row0 + i) % group;
    const float *qp = q + ((q_start + j) * heads + h) * D;
    for (int64_t c = 0; c < DP; c += 8) {
      const __m256bh x = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qp + 2 * c),
                                                          _mm512_set1_ps(scale)));
      _mm256_storeu_si256((__m256i *)(qb + i * DP + c), (__m256i)x);
    }
    bits[i] = tree ? (uint64_t)tree[q_start + j] : 0;
    pos[i] = bits[i] ? ctx - 1 : ctx - q_len + j;
  }
  const int tiles = (rows + MOST - 1) / MOST;
  for (int i = 0, t = 0; i < rows; t++) {
    const int n = rows / tiles + (t < rows % tiles);
#define ROWS(R)                                                                             \
  pairs_rows(NV, R, qb + i * DP, pos + i, bits + i, base, k_cache, v_cache, table, kv_head, \
             kv_heads, block_size, b_lo, b_hi, part + i * (D + 2))
    switch (n) {
      case 1: ROWS(1); break;
      case 2: ROWS(2); break;
      case 3: ROWS(3); break;
      case 4: if (MOST >= 4) ROWS(4); break;
      case 5: if (MOST >= 5) ROWS(5); break;
      default: if (MOST >= 6) ROWS(6); break;
    }
#undef ROWS
    i += n;
  }
}

#define PAIRS_FN(d)                                                                           \
  void tandem_attend_pairs_##d(PAIRS_PARAMS) {                                               \
    attend_pairs(d / 16, q, k_cache, v_cache, table, q_start, q_len, ctx, tree, base, kv_head, \
                 row0, rows, heads, kv_heads, block_size, scale, b_lo, b_hi, part);          \
  }
PAIRS_DIMS(PAIRS_FN)
#undef PAIRS_FN

#else /* no AVX-512 BF16: the layout is refused (tandem_attention_pairs), nothing runs here */

int tandem_attention_pairs(int64_t head_dim, int64_t block_size) {
  (void)head_dim, (void)block_size;
  return 0;
}
#define PAIRS_FN(d) \
  void tandem_attend_pairs_##d(PAIRS_PARAMS) {}
PAIRS_DIMS(PAIRS_FN)
#undef PAIRS_FN

#endif
