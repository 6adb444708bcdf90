#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * gemm_quant.c's GGUF linears (Q4_1, Q8_0) on AMX tiles, the matrix unit of recent Intel
 * CPUs, for calls of AMX_MIN_ROWS rows of x or more; the same panels.
 *
 * Why: gemm_quant.c widens every weight to float32 and spends a vector multiply-add per 16
 * weights and row of x. A pass of a few rows is bound by reading the weights, but from about
 * ten rows on (16 requests decoding, their drafts verified, a prompt) the multiply-adds are
 * the cost. One tile multiply does 16 rows x 16 columns x 32 products.
 *
 * Exactness: a block's weights are w = d * q (Q8_0) or d * q + m (Q4_1), q an integer of at
 * most 8 bits, exact in bfloat16. Each row of x is split into three bfloat16 parts,
 * x = x0 + x1 + x2 exactly (each part the nearest bfloat16 to what the ones before left:
 * 8 + 8 + 8 bits of float32's 24). Per block of 32 the tile unit sums the products q * x_j,
 * each exact, in float32, then
 *   sum_k w_k x_k = d * (sum_k q_k x_k) + m * (sum_k x_k)
 * with float32 multiply-adds: the quantity gemm_quant.c computes, rounded in another order
 * (closer to the exact sum in tests/test_cpu_kernels.py, but not the same bits). A row's
 * result depends only on that row, so it is the same in every call of AMX_MIN_ROWS rows or
 * more; a call of fewer rows runs gemm_quant.c's kernel. At concurrency 1 a step verifies
 * at most 1 + 4 tokens by default, so decoding and verifying take the same kernel there.
 *
 * Layout: per panel (16 output columns) and block, the quants become a B tile of 16 rows of
 * bfloat16 pairs (row r: for each column c, q[2r][c] and q[2r + 1][c]), unpacked with byte
 * and word permutes. Tiles A0..A2 hold a block's 32 k of the three parts of up to 16 rows;
 * C = A0 B + A1 B + A2 B.
 *
 * `TANDEM_AMX=0` in the environment keeps every call on gemm_quant.c's kernel.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AROWS 16  /* rows of x per tile pass */
#define APANELS 2 /* panels per pass, each with its own B and C tiles (A is shared) */
/* Blocks ahead whose quants are prefetched: the tile work per block leaves the hardware
 * prefetcher behind. */
#define PREFETCH 4
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The unpacking permutes' constants (see unpack_q4_1 and unpack_q8_0), made once. */
static __m512i lut[4];

static void make_tables(void) {
  uint8_t idx[64] = {0};
  uint16_t shift[32], table[32], pair[32];
  for (int w = 0; w < 32; w++) {
    const int c = w / 2, j = w % 2;
    idx[2 * w] = (uint8_t)(8 * j + 4 * (c % 2) + c / 4); /* the byte holding q[j][c] */
    shift[w] = (uint16_t)(4 * ((c / 2) & 1));             /* its nibble's place in it */
    pair[w] = (uint16_t)(c + 16 * j);                       /* 0, 16, 1, 17, ... */
    const float f = (float)(w % 16); /* bfloat16 of w % 16: the float's top half, exact */
    uint32_t u;
    memcpy(&u, &f, 4);
    table[w] = (uint16_t)(u >> 16);
  }
  lut[0] = _mm512_loadu_si512(idx);
  lut[1] = _mm512_loadu_si512(shift);
  lut[2] = _mm512_loadu_si512(table);
  lut[3] = _mm512_loadu_si512(pair);
}

static int amx_state = -1; /* -1: not asked yet, 0: off, 1: on */

/* Whether the GGUF linears run on AMX: asks Linux for the tile state once (a process must,
 * before its first tile instruction); `TANDEM_AMX=0` in the environment turns it off. */
int tandem_amx_active(void) {
  if (amx_state < 0) {
    const char *env = getenv("TANDEM_AMX");
    amx_state = !(env && env[0] == '0') &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    if (amx_state) make_tables();
  }
  return amx_state;
}

/* Turn the AMX path off (0) or back on (1, if the CPU and the OS allow it): for tests and
 * side-by-side timings in one process. Returns whether it is on. */
int tandem_amx_enable(int enable) {
  amx_state = -1;
  if (!enable) amx_state = 0;
  return tandem_amx_active();
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Tiles: 0..2 = A (the three parts of up to 16 rows of x), 3..4 = B (one per panel),
 * 5..6 = C (one per panel). */
static void configure(int rows) {
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 7; t++) {
    c.rows[t] = (uint8_t)(t == 3 || t == 4 ? 16 : rows);
    c.colsb[t] = 64;
  }
  /* GCC's _tile_loadconfig tells the compiler it reads 8 bytes: keep the other stores */
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

/* One Q4_1 block's quants (gemm_quant.c's layout: per k, 8 bytes, column c's nibble at bit
 * 32 * (c % 2) + 4 * (c / 2)) as tile B: row r = k 2r and 2r + 1, word 2c + j = q[2r + j][c]
 * as a bfloat16. A byte permute brings each nibble's byte under its word, a shift brings
 * the nibble down, and a word permute of a 32-entry table (entry i = i % 16, so the byte's
 * other nibble in bit 4 does not matter) makes it a bfloat16. */
static void unpack_q4_1(const uint8_t *quants, uint16_t *b) {
  for (int r = 0; r < 16; r++) {
    const __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(quants + 16 * r)));
    const __m512i bytes = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, lut[0], raw);
    const __m512i nib = _mm512_srlv_epi16(bytes, lut[1]);
    _mm512_store_si512(b + 32 * r, _mm512_permutexvar_epi16(nib, lut[2]));
  }
}

/* One Q8_0 block's quants (per k, 16 int8, column c at byte c) as tile B. */
static void unpack_q8_0(const uint8_t *quants, uint16_t *b) {
  const __m512i vpair = lut[3];
  for (int r = 0; r < 16; r++) {
    const __m128i *src = (const __m128i *)(quants + 32 * r);
    const __m512 k0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
    const __m512 k1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(k1, k0); /* words: k0's 16, k1's 16 */
    _mm512_store_si512(b + 32 * r, _mm512_permutexvar_epi16(vpair, both));
  }
}

/* x [M, K] -> parts [3][M][K] bfloat16, x = part 0 + part 1 + part 2 exactly, and for
 * Q4_1 each row's block sums [M][K / 32] (float32, in a fixed order). */
static void split_rows(const float *x, int64_t M, int64_t K, uint16_t *parts, float *sums) {
  for (int64_t i = 0; i < M; i++) {
    const float *xr = x + i * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m512 rest = _mm512_loadu_ps(xr + k);
      for (int part = 0; part < 3; part++) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(rest);
        _mm256_storeu_si256((__m256i *)(parts + (part * M + i) * K + k), h);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        rest = _mm512_sub_ps(rest, back);
      }
    }
    if (sums)
      for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = xr + 32 * b;
        sums[i * (K / 32) + b] =
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)));
      }
  }
}

/* A buffer that lives as long as its thread and grows as needed (64-byte aligned). */
static void *scratch(void **buf, size_t *size, size_t need) {
  if (*size < need) {
    free(*buf);
    *size = (need + 4095) / 4096 * 4096;
    *buf = aligned_alloc(64, *size);
  }
  return *buf;
}

/* Rows r0 .. r0 + mc - 1 of x (`a`: part 0 of row r0; part j is j * M rows further) times
 * the panels p0 .. p0 + np - 1 (np <= APANELS): per block, each panel's quants are unpacked
 * into its B tile, C = A0 B + A1 B + A2 B, and C's sums scaled into the accumulators. */
static void amx_chunk(const int q4, const int np, const int mc, const uint16_t *a, int64_t M,
                      const float *sums, const uint8_t *panel, int64_t stride,
                      const float *bias, const float *res, float *y, int64_t N, int64_t K,
                      int cols) {
  const int64_t nb = K / 32, part = M * K, panel_bytes = nb * stride;
  uint16_t b[2][APANELS][512] __attribute__((aligned(64))); /* blocks k and k + 1 */
  float c[2][APANELS][AROWS * 16] __attribute__((aligned(64)));
  float acc[APANELS][AROWS * 16] __attribute__((aligned(64)));
  memset(acc, 0, sizeof acc);
#define UNPACK(k)                                                   \
  for (int p = 0; p < np; p++) {                                    \
    const uint8_t *q = panel + p * panel_bytes + (k) * stride;      \
    if (q4) unpack_q4_1(q + 64, b[(k) & 1][p]);                     \
    else unpack_q8_0(q + 32, b[(k) & 1][p]);                        \
  }
/* block k's sums, scaled into the accumulators */
#define POST(k)                                                                              \
  for (int p = 0; p < np; p++) {                                                             \
    const uint8_t *blk = panel + p * panel_bytes + (k) * stride;                             \
    const float *cp = c[(k) & 1][p];                                                         \
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));              \
    const __m512 m = q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))  \
                        : _mm512_setzero_ps();                                               \
    for (int i = 0; i < mc; i++) {                                                           \
      __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(cp + 16 * i), _mm512_load_ps(acc[p] + 16 * i)); \
      if (q4) v = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[i * nb + (k)]), v);                 \
      _mm512_store_ps(acc[p] + 16 * i, v);                                                   \
    }                                                                                        \
  }
  UNPACK(0)
  for (int64_t k = 0; k < nb; k++) {
    _tile_loadd(0, a + 32 * k, 2 * K);
    _tile_loadd(1, a + part + 32 * k, 2 * K);
    _tile_loadd(2, a + 2 * part + 32 * k, 2 * K);
/* (tile numbers are assembler operands: literal constants) */
#define PANEL_TILE(p, tb, tc)              \
  if (np > p) {                            \
    _tile_loadd(tb, b[k & 1][p], 64);      \
    _tile_zero(tc);                        \
    _tile_dpbf16ps(tc, 0, tb);             \
    _tile_dpbf16ps(tc, 1, tb);             \
    _tile_dpbf16ps(tc, 2, tb);             \
    _tile_stored(tc, c[k & 1][p], 64);     \
  }
    PANEL_TILE(0, 3, 5)
    PANEL_TILE(1, 4, 6)
#undef PANEL_TILE
    /* The next block's unpacking and the last block's sums overlap this one's tile work. */
    if (k + 1 < nb) UNPACK(k + 1)
    if (k + PREFETCH < nb)
      for (int p = 0; p < np; p++) {
        const char *ahead = (const char *)panel + p * panel_bytes + (k + PREFETCH) * stride;
        for (int line = 0; line < stride; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
    if (k > 0) POST(k - 1)
  }
  POST(nb - 1)
#undef POST
#undef UNPACK
  for (int p = 0; p < np; p++) {
    const int n = span(cols, p * 16, 16);
    for (int i = 0; i < mc; i++) {
      float *row = acc[p] + 16 * i;
      put_row(row, n, bias ? bias + p * 16 : 0, res ? res + i * N + p * 16 : 0,
              y + i * N + p * 16);
    }
  }
}

static __thread void *parts_buf, *sums_buf;
static __thread size_t parts_size, sums_size;

/* gemm_quant.c's quant_linear on AMX tiles; q4: Q4_1, else Q8_0, its panel blocks `stride`
 * bytes each (gemm_quant.c's block_bytes). Work items: APANELS panels x AROWS rows. */
void tandem_amx_linear(const int q4, const int64_t stride, const float *x,
                       const uint8_t *panels, const float *bias, const float *residual, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
  const int64_t num_panels = (N + 15) / 16, nb = K / 32, panel_bytes = nb * stride;
  uint16_t *parts = scratch(&parts_buf, &parts_size, (size_t)(M * 3 * K * 2));
  float *sums = q4 ? scratch(&sums_buf, &sums_size, (size_t)(M * nb) * sizeof(float)) : 0;
  split_rows(x, M, K, parts, sums);
  const int64_t num_groups = (num_panels + APANELS - 1) / APANELS;
  const int64_t chunks = (M + AROWS - 1) / AROWS;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    int configured = -1; /* this thread's tile configuration: the rows it was set for */
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t g = 0; g < num_groups; g++)
      for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t p0 = g * APANELS, r0 = ch * AROWS;
        const int np = span(num_panels, p0, APANELS), mc = span(M, r0, AROWS);
        if (configured != mc) {
          configure(mc);
          configured = mc;
        }
        amx_chunk(q4, np, mc, parts + r0 * K, M, sums ? sums + r0 * nb : 0,
                  panels + p0 * panel_bytes, stride, bias ? bias + p0 * 16 : 0,
                  residual ? residual + r0 * N + p0 * 16 : 0, y + r0 * N + p0 * 16, N, K,
                  span(N, p0 * 16, np * 16));
      }
    if (configured >= 0) _tile_release(); /* other code may use the tiles too */
  }
}

#else /* no AMX in this build */

int tandem_amx_active(void) { return 0; }
int tandem_amx_enable(int enable) { (void)enable; return 0; }
void tandem_amx_linear(const int q4, const int64_t stride, const float *x,
                       const uint8_t *panels, const float *bias, const float *residual, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
  (void)q4, (void)stride, (void)x, (void)panels, (void)bias, (void)residual, (void)y;
  (void)M, (void)N, (void)K, (void)nthreads;
}

#endif
