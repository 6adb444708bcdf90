#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * gemm_quant.c's GGUF linears (Q4_1, Q8_0) on AVX-512 VNNI integer dot products, for the
 * vector kernel's calls (fewer than AMX_MIN_ROWS rows where AMX tiles run the rest; every call
 * where not).
 *
 * Why: a one-row pass (a decode step at concurrency 1) is the default model's commonest
 * call, and a verification pass of a few rows the next. gemm_quant.c widens each quant to
 * float32: per 16 weights a shift and a permute (Q4_1) or a widening load and a conversion
 * (Q8_0), then a multiply-add per row of x. VPDPBUSD multiplies 64 unsigned bytes by 64
 * signed bytes and adds the products four by four into 16 int32 lanes: per 64 weights a
 * permute and one or two bit operations, then three instructions per row of x.
 *
 * Exactness: per row of x and block of 32, x is scaled to integers of at most 23 bits plus
 * sign, X_k = round(x_k * L / max|x|) with L = 8355710 and s = max|x| / L, and X is split
 * into three signed bytes, X = X0 + 256 X1 + 65536 X2 (balanced base 256, exact). The
 * quants times each part sum exactly in int32 (S_j); then, per block,
 *   Q4_1 (q 0..15):   sum_k q_k x_k ~ s * (S0 + 256 (S1 + 256 S2)), one float32 rounding,
 *                     total += (d * s) * that + m * (sum_k x_k) (the row's float32 block sum);
 *   Q8_0 (q -128..127, taken as the unsigned q + 128, so S_j = the dot - 128 * sum_k X_jk):
 *                     sum_k q_k x_k ~ s * ((S0 + 256 S1) + 65536 S2), total += (d * s) * that.
 * The only rounding before the float32 sums is x_k to X_k * s: at most 2^-24 of the
 * block's largest |x|, the size of float32's own rounding of that element. So the sums are as
 * close to the exact ones as gemm_quant.c's (tests/test_cpu_kernels.py), in another order:
 * not the same bits. A row's result depends only on that row, so it is the same in every
 * call of any number of rows. A non-finite x makes its block's sums NaN, as float32 would.
 *
 * int8 (VNNI_INT8, `--cpu-activations int8`): the same with L = 127 and one part, X = X0, as
 * llama.cpp's Q8_1 activations: a third of the dot products, and 1 + 1 accumulators per row
 * and panel, so tiles hold more rows. Each x_k is then off by up to half of max|x| / 127 of
 * its block: the served model's numbers change (docs/CPU.md says by how much). A row's
 * rounding still depends on that row alone: this mode runs every call, AMX machines' included,
 * so a token's logits are the same in a decoding step and in a verification pass of any width.
 *
 * Layout: gemm_quant.c's panels unchanged. A byte permute gathers, for 4 consecutive k, each
 * column's 4 quants into that column's 32-bit lane: Q8_0 from a 64-byte load of 4 quant
 * rows (column c at byte c), then +128; Q4_1 from a load of 8 rows (column c's nibble at bit
 * 32 * (c % 2) + 4 * (c / 2) of row k's 8 bytes) the bytes holding the nibbles, then a
 * per-lane shift and a mask.
 *
 * The 24-bit mode is off by default: gemm_quant.c's float32 kernel is as fast at 1 row and
 * faster at the 2-5 rows of a verification pass on the machines measured (docs/BENCHMARKS.md).
 * `TANDEM_VNNI=1` in the environment turns it on.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdlib.h>

#define VPANEL 16
#define VBLOCK 32
#define Q4_BYTES (4 * VPANEL + VBLOCK * 8)      /* Q4_1: d[16], m[16] float16, 32 rows of 8 bytes */
#define Q8_BYTES (2 * VPANEL + VBLOCK * VPANEL) /* Q8_0: d[16] float16, 32 rows of 16 int8 */
#define VLIMIT 8355710.0f /* < 127 * (1 + 256 + 65536): three balanced bytes hold it */
#define VAHEAD 4 /* blocks ahead prefetched, into the outer caches (gemm_quant.c says why) */
/* A row of x prepared per block: 3 parts x 8 groups of 4 k (int32 of 4 signed bytes), the
 * block's scale s as the float32 bits, and each part's sum over the block (for Q8_0). */
#define VPREP (3 * 8 + 1 + 3)

static int vnni_state = -1;
static __m512i gather_idx[2], nibble_shift, q8_idx;

int tandem_vnni_active(void) {
  if (vnni_state < 0) {
    const char *env = getenv("TANDEM_VNNI");
    vnni_state = env && env[0] == '1' ? VNNI_EXACT : VNNI_OFF;
    uint8_t idx[2][64], q8[64];
    uint32_t shift[16];
    for (int c = 0; c < 16; c++) {
      shift[c] = (uint32_t)(4 * ((c / 2) & 1));
      for (int i = 0; i < 4; i++) {
        for (int g = 0; g < 2; g++) /* Q4_1: row 4g + i of the load; the byte with column c */
          idx[g][4 * c + i] = (uint8_t)(8 * (4 * g + i) + 4 * (c % 2) + c / 4);
        q8[4 * c + i] = (uint8_t)(16 * i + c); /* Q8_0: row i of the load, byte c */
      }
    }
    q8_idx = _mm512_loadu_si512(q8);
    gather_idx[0] = _mm512_loadu_si512(idx[0]);
    gather_idx[1] = _mm512_loadu_si512(idx[1]);
    nibble_shift = _mm512_loadu_si512(shift);
  }
  return vnni_state;
}

/* The mode: VNNI_OFF, VNNI_EXACT or VNNI_INT8 (vec.h); returns it, VNNI_OFF where the CPU
 * has no VNNI. Set once by the engine at start; tests and timings switch it in one process. */
int tandem_vnni_enable(int mode) {
  vnni_state = -1;
  tandem_vnni_active();
  vnni_state = mode == VNNI_EXACT || mode == VNNI_INT8 ? mode : VNNI_OFF;
  return vnni_state;
}

/* Row x (K floats) as prepared blocks (VPREP int32 each, see above; the parts' sums only for
 * Q8_0, q8). parts: 3 (x in 24-bit fixed point, split into three bytes) or 1 (x in int8). */
static void prepare_row(const int q8, const int parts, const float *x, int64_t K, int32_t *out) {
  const float limit = parts == 1 ? 127.0f : VLIMIT;
  for (int64_t b = 0; b < K / VBLOCK; b++, out += VPREP) {
    const __m512 lo = _mm512_loadu_ps(x + b * VBLOCK), hi = _mm512_loadu_ps(x + b * VBLOCK + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const int finite = !_mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q) && top <= 3.4028235e38f;
    const float inv = finite && top > 0.0f ? limit / top : 0.0f;
    const float s = finite ? top / limit : NAN;
    const __m512i half[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv))),
                             _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)))};
    int32_t sums[3] = {0, 0, 0};
    for (int h = 0; h < 2; h++) {
      __m512i rest = half[h];
      for (int j = 0; j < parts; j++) { /* the part: rest's low byte, sign-extended */
        const __m512i part = _mm512_srai_epi32(_mm512_slli_epi32(rest, 24), 24);
        _mm_storeu_si128((__m128i *)(out + 8 * j + 4 * h), _mm512_cvtepi32_epi8(part));
        if (q8) sums[j] += _mm512_reduce_add_epi32(part);
        rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, part), 8);
      }
    }
    memcpy(out + 3 * 8, &s, 4);
    memcpy(out + 3 * 8 + 1, sums, sizeof sums);
  }
}

INLINE __m512 halves(const uint8_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* y[rows, the columns of np panels `pstride` bytes apart]; xp: the rows' prepared blocks,
 * xsum: their block sums (gemm_quant.c's block_sums; Q4_1), nb blocks a row. Q8_0 (q8):
 * the int8 quants become unsigned with +128, and each part's sum times 128 comes off. */
INLINE void vnni_tile(const int q8, const int parts, const int np, const int rows,
                      const int32_t *xp,
                      const float *xsum,
                      int64_t nb, const uint8_t *panel, int64_t pstride, const float *bias,
                      const float *res, float *y, int64_t N, int cols) {
  __m512 total[4][6];
  for (int p = 0; p < np; p++)
    for (int r = 0; r < rows; r++) total[p][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(-128);
  const int64_t bytes = q8 ? Q8_BYTES : Q4_BYTES, head = q8 ? 2 * VPANEL : 4 * VPANEL;
  for (int64_t b = 0; b < nb; b++) {
    prefetch_panels(panel, np, pstride, bytes, b, nb, VAHEAD); /* vec.h says what */
    __m512i acc[4][6][3];
    for (int p = 0; p < np; p++)
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < parts; j++) acc[p][r][j] = _mm512_setzero_si512();
    for (int h = 0; h < (q8 ? 8 : 4); h++) /* a 64-byte load: quant rows 4h.. (Q8_0), 8h.. */
      for (int p = 0; p < np; p++) {
        const __m512i raw = _mm512_loadu_si512(panel + p * pstride + b * bytes + head + 64 * h);
        for (int g = 0; g < (q8 ? 1 : 2); g++) {
          const __m512i q =
              q8 ? _mm512_xor_si512(_mm512_permutexvar_epi8(q8_idx, raw), flip)
                 : _mm512_and_si512(
                       _mm512_srlv_epi32(_mm512_permutexvar_epi8(gather_idx[g], raw), nibble_shift),
                       low4);
          for (int r = 0; r < rows; r++) {
            const int32_t *xj = xp + (r * nb + b) * VPREP + (q8 ? h : 2 * h + g);
            for (int j = 0; j < parts; j++)
              acc[p][r][j] = _mm512_dpbusd_epi32(acc[p][r][j], q, _mm512_set1_epi32(xj[8 * j]));
          }
        }
      }
    for (int p = 0; p < np; p++) {
      const uint8_t *blk = panel + p * pstride + b * bytes;
      const __m512 d = halves(blk);
      for (int r = 0; r < rows; r++) {
        const int32_t *prep = xp + (r * nb + b) * VPREP;
        float s;
        memcpy(&s, prep + 3 * 8, 4);
        __m512 sum;
        if (parts == 1) { /* |S0| <= 128 * 127 * 32 */
          const __m512i s0 = q8 ? _mm512_sub_epi32(acc[p][r][0], _mm512_set1_epi32(128 * prep[3 * 8 + 1]))
                                : acc[p][r][0];
          sum = _mm512_cvtepi32_ps(s0);
        } else if (q8) { /* S_j = acc_j - 128 sum_j, |S_j| <= 128 * 128 * 32; S0 + 256 S1 < 2^31 */
          __m512i part[3];
          for (int j = 0; j < 3; j++)
            part[j] = _mm512_sub_epi32(acc[p][r][j], _mm512_set1_epi32(128 * prep[3 * 8 + 1 + j]));
          const __m512i lower = _mm512_add_epi32(part[0], _mm512_slli_epi32(part[1], 8));
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[2]), _mm512_set1_ps(65536.0f),
                                _mm512_cvtepi32_ps(lower));
        } else { /* S1 + 256 S2 < 2^24 (|S_j| <= 128 * 15 * 32): exact as a float */
          const __m512i upper =
              _mm512_add_epi32(acc[p][r][1], _mm512_slli_epi32(acc[p][r][2], 8));
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(upper), _mm512_set1_ps(256.0f),
                                _mm512_cvtepi32_ps(acc[p][r][0]));
        }
        total[p][r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(s)), sum, total[p][r]);
        if (!q8)
          total[p][r] =
              _mm512_fmadd_ps(halves(blk + 2 * VPANEL), _mm512_set1_ps(xsum[r * nb + b]),
                              total[p][r]);
      }
    }
  }
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * VPANEL, VPANEL);
    for (int r = 0; r < rows; r++) {
      float row[VPANEL];
      _mm512_storeu_ps(row, total[p][r]);
      put_row(row, n, bias ? bias + p * VPANEL : 0, res ? res + r * N + p * VPANEL : 0,
              y + r * N + p * VPANEL);
    }
  }
}

/* Panels per tile of `rows` rows: `parts` accumulators and a float32 total per row and
 * panel, within 32 registers. */
INLINE int vnni_panels(int parts, int rows) {
  return parts == 1 ? (rows <= 3 ? 4 : 2) : (rows == 1 ? 4 : rows == 2 ? 2 : 1);
}

/* One work item: np panels, all M rows, in tiles of up to 4 rows. */
INLINE void vnni_group(const int q8, const int parts, const int np, const int32_t *xp,
                       const float *xsum, const uint8_t *panel, int64_t panel_bytes,
                       const float *bias, const float *residual, float *y, int64_t M, int64_t N,
                       int64_t nb, int cols) {
  /* Rows a tile: up to 4, or for int8 up to 6 (4 to 6 rows on 2 panels: each panel's quants,
   * unpacked once, feed more rows), as even as can be (7 rows: 4 + 3). */
  const int64_t most = parts == 1 ? 6 : 4, tiles = (M + most - 1) / most;
  for (int64_t r = 0, t = 0; r < M; r += M / tiles + (t < M % tiles), t++) {
    const int rows = (int)(M / tiles + (t < M % tiles)), tp = vnni_panels(parts, rows);
    const int32_t *xr = xp + r * nb * VPREP;
    const float *sr = xsum ? xsum + r * nb : 0, *rr = residual ? residual + r * N : 0;
    for (int p = 0; p < np;) { /* whole tiles, then a group's last panels one at a time */
      const int n = np - p >= tp ? tp : 1;
      const uint8_t *pp = panel + p * panel_bytes;
      const float *bp = bias ? bias + p * VPANEL : 0, *rp = rr ? rr + p * VPANEL : 0;
      float *yp = y + r * N + p * VPANEL;
      const int c = span(cols, p * VPANEL, n * VPANEL);
#define VTILE(g, m) vnni_tile(q8, parts, g, m, xr, sr, nb, pp, panel_bytes, bp, rp, yp, N, c)
      if (n == 1) {
        switch (rows) {
          case 1: VTILE(1, 1); break;
          case 2: VTILE(1, 2); break;
          case 3: VTILE(1, 3); break;
          case 4: VTILE(1, 4); break;
          case 5: VTILE(1, 5); break;
          default: VTILE(1, 6); break;
        }
      } else if (parts != 1) { /* tp > 1: 1 row on 4 panels or 2 rows on 2 */
        if (rows == 1) VTILE(4, 1);
        else VTILE(2, 2);
      } else {
        switch (rows) {
          case 1: VTILE(4, 1); break;
          case 2: VTILE(4, 2); break;
          case 3: VTILE(4, 3); break;
          case 4: VTILE(2, 4); break;
          case 5: VTILE(2, 5); break;
          default: VTILE(2, 6); break;
        }
      }
#undef VTILE
      p += n;
    }
  }
}

/* The group kernels, each compiled for its type and parts (outside the OpenMP region, which
 * GCC outlines before inlining: a type passed into it would stay a run-time value). */
#define VGROUP_ARGS                                                                       \
  const int np, const int32_t *xp, const float *xsum, const uint8_t *panel,              \
      int64_t panel_bytes, const float *bias, const float *residual, float *y, int64_t M, \
      int64_t N, int64_t nb, int cols
#define VGROUP(name, q8, parts)                                                            \
  static void name(VGROUP_ARGS) {                                                          \
    vnni_group(q8, parts, np, xp, xsum, panel, panel_bytes, bias, residual, y, M, N, nb, cols); \
  }
VGROUP(group_q4_1, 0, 3)
VGROUP(group_q8_0, 1, 3)
VGROUP(group_q4_1_int8, 0, 1)
VGROUP(group_q8_0_int8, 1, 1)

/* gemm_quant.c's tandem_linear_q4_1 (q4) or tandem_linear_q8_0 on VNNI; xsum: x's block
 * sums [M][K / 32] (Q4_1). */
void tandem_vnni_linear(const int q4, const float *x, const float *xsum, const uint8_t *panels,
                        const float *bias, const float *residual, float *y, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
  static __thread int32_t *buf;
  static __thread int64_t size;
  const int64_t nb = K / VBLOCK;
  if (size < M * nb * VPREP) {
    free(buf);
    size = M * nb * VPREP;
    buf = malloc((size_t)size * sizeof(int32_t));
  }
  const int parts = tandem_vnni_active() == VNNI_INT8 ? 1 : 3;
  for (int64_t r = 0; r < M; r++) prepare_row(!q4, parts, x + r * K, K, buf + r * nb * VPREP);
  const int32_t *xp = buf;
  const int64_t num_panels = (N + VPANEL - 1) / VPANEL;
  const int64_t panel_bytes = nb * (q4 ? Q4_BYTES : Q8_BYTES);
  const int group = M == 1 || parts == 1 ? 4 : 2; /* panels per work item */
  const int64_t num_groups = (num_panels + group - 1) / group;
  void (*const run)(VGROUP_ARGS) = parts == 1 ? (q4 ? group_q4_1_int8 : group_q8_0_int8)
                                              : (q4 ? group_q4_1 : group_q8_0);
  /* Guided: a worker takes a run of consecutive work items, the first half of them, then a
   * quarter..., the last ones one at a time. So each reads the weights as one long stream
   * (the prefetcher keeps up, and the tile prefetches into its successor), and a worker the
   * OS preempts (the server's event loop shares these cores) is made up for at the end.
   * Handed out one at a time instead (dynamic), the workers' reads would interleave work
   * item by work item. */
#pragma omp parallel for num_threads(nthreads) schedule(guided, 1) if (nthreads > 1)
  for (int64_t g = 0; g < num_groups; g++) {
    const int64_t p0 = g * group;
    const int np = span(num_panels, p0, group);
    run(np, xp, xsum, panels + p0 * panel_bytes, panel_bytes, bias ? bias + p0 * VPANEL : 0,
        residual ? residual + p0 * VPANEL : 0, y + p0 * VPANEL, M, N, nb,
        span(N, p0 * VPANEL, np * VPANEL));
  }
}

#else /* no VNNI: gemm_quant.c's float32 kernel runs every call */

int tandem_vnni_active(void) { return 0; }
int tandem_vnni_enable(int mode) { (void)mode; return VNNI_OFF; }
void tandem_vnni_linear(const int q4, const float *x, const float *xsum, const uint8_t *panels,
                        const float *bias, const float *residual, float *y, int64_t M, int64_t N,
                        int64_t K, int nthreads) {
  (void)q4, (void)x, (void)xsum, (void)panels, (void)bias, (void)residual, (void)y;
  (void)M, (void)N, (void)K, (void)nthreads;
}

#endif
