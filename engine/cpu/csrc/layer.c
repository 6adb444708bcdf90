#include "vec.h"

/* ---------------------------------------------------------------------------------------
 * The small steps of a Llama-family layer, each one call instead of a chain of torch
 * operators (most of a small model's pass on the CPU is that chain's per-call cost).
 */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row of dim values (out may be x).
 * The sum of squares runs in 32 lanes (one dependent add per 32 values, not per value),
 * because it runs on the calling thread while the other kernel threads wait. A row's result
 * depends only on that row. */
void tandem_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float *o = out + r * dim;
    v8 acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32)
      for (int u = 0; u < 4; u++) {
        const v8 v = load(xr + i + 8 * u);
        acc[u] += v * v;
      }
    for (; i + 8 <= dim; i += 8) {
      const v8 v = load(xr + i);
      acc[0] += v * v;
    }
    float ss = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    for (; i < dim; i++) ss += xr[i] * xr[i];
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

/* A token's K and V rows (kv_heads * D floats each) into slot `slot` of a KV_BF16P cache of
 * blocks of B tokens, in attention_pairs.c's layout, rounded to bfloat16 (nearest even). */
static void store_pairs(uint16_t *k_cache, uint16_t *v_cache, int64_t slot, int64_t B,
                        int64_t kv_heads, int64_t D, const float *k, const float *v) {
  const int64_t t = slot % B;
  for (int64_t h = 0; h < kv_heads; h++) {
    const int64_t region = (slot / B * kv_heads + h) * B * D;
    uint16_t *kp = k_cache + region + (t / 16) * 16 * D + (t % 16) * 2;
    uint16_t *vp = v_cache + region + (t / 2) * 2 * D + t % 2;
    for (int64_t d = 0; d < D; d++) {
      kp[(d / 2) * 32 + d % 2] = float_to_bf16(k[h * D + d]);
      vp[2 * d] = float_to_bf16(v[h * D + d]);
    }
  }
}

/* The attention inputs of a layer, from its fused q/k/v projection qkv[tokens, (heads +
 * 2 kv_heads) * head_dim]: q and k get the rotary embedding (rotate-half convention, cos/sin
 * tables [positions, head_dim] looked up at each token's position), q goes to q_out[tokens,
 * heads, head_dim], and k and v are written to their cache slots (caches viewed as [slots,
 * kv_heads, head_dim] of kv_type elements: vec.h's KV_F32, KV_F16 or KV_BF16, rounded to
 * nearest even as torch's .to() rounds; KV_BF16P: attention_pairs.c's layout of blocks of
 * block_size tokens). */
void tandem_rotary_cache(const float *qkv, const int64_t *positions, const int64_t *slots,
                         const float *cos_t, const float *sin_t, int64_t tokens, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, float *q_out, void *k_cache,
                         void *v_cache, int kv_type, int64_t block_size) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  float k_row[kv_heads * head_dim];
  for (int64_t t = 0; t < tokens; t++) {
    const float *row = qkv + t * width;
    const float *c = cos_t + positions[t] * head_dim, *s = sin_t + positions[t] * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
      const float *x = row + h * head_dim;
      const int to_cache = h >= heads;
      float *o = to_cache ? k_row + (h - heads) * head_dim : q_out + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < half; i++) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
    }
    const float *v_row = row + (heads + kv_heads) * head_dim;
    if (kv_type == KV_BF16P) {
      store_pairs(k_cache, v_cache, slots[t], block_size, kv_heads, head_dim, k_row, v_row);
      continue;
    }
    store_kv(kv_type, k_cache, slots[t] * kv_heads * head_dim, k_row, kv_heads * head_dim);
    store_kv(kv_type, v_cache, slots[t] * kv_heads * head_dim, v_row, kv_heads * head_dim);
  }
}

/* ---------------------------------------------------------------------------------------
 * Every layer of a Llama-family model in one call, for a batch whose every request the
 * attention kernel takes (decodes, verifications, short chunks): the same kernels, in the
 * same order, as the per-step calls of engine/model/native/llama.py, so the same numbers, without
 * a dozen trips through Python per layer (about a tenth of a 135M model's decoding step).
 */
void tandem_linear(const float *x, const float *panels, const float *bias, const float *residual,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads);
void tandem_linear_bf16(const float *x, const uint16_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads);
void tandem_linear_q8_0(const float *x, const uint8_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads);
void tandem_linear_q4_1(const float *x, const uint8_t *panels, const float *bias,
                        const float *residual, float *y, int64_t M, int64_t N, int64_t K,
                        int nthreads);
int tandem_attention_supports(int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t block_size);
int tandem_attention_pairs(int64_t head_dim, int64_t block_size);
int tandem_paged_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *tables, int64_t table_width, const int64_t *q_starts,
                           const int64_t *q_lens, const int64_t *ctx_lens,
                           const int64_t *tree, const int64_t *tree_base, int64_t num_seqs,
                           float *out, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           int kv_type, int nthreads);

/* A packed linear: its panels (engine/cpu/kernels.py) in one of these formats. */
enum { W_FLOAT32 = 0, W_BFLOAT16 = 1, W_Q8_0 = 2, W_Q4_1 = 3 };

typedef struct {
  const void *panels;
  const float *bias; /* or NULL */
  int64_t format;
} tandem_weight;

typedef struct {
  tandem_weight qkv, o, gate_up, down;
  const float *input_norm, *post_norm;
  void *key_cache, *value_cache; /* [blocks, block_size, kv_heads, head_dim] of kv_type */
} tandem_layer;

/* The request layout every layer attends with (as tandem_paged_attention takes it). */
typedef struct {
  const int64_t *positions, *slots; /* [tokens] */
  const float *cos, *sin;           /* [positions, head_dim] */
  const int64_t *tables;            /* [num_seqs, width] */
  int64_t width;
  const int64_t *q_starts, *q_lens, *ctx_lens; /* [num_seqs] */
  int64_t num_seqs, block_size;
  const int64_t *tree;      /* [tokens] draft-tree visibility bits, or NULL (attention.c) */
  const int64_t *tree_base; /* [num_seqs] the slot of bit 0, with tree */
  int64_t kv_type;          /* the caches' elements: KV_F32, KV_F16, KV_BF16 or KV_BF16P (vec.h) */
} tandem_batch;

static void linear_any(const tandem_weight *w, const float *x, const float *residual, float *y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
  switch (w->format) {
    case W_BFLOAT16:
      tandem_linear_bf16(x, w->panels, w->bias, residual, y, M, N, K, nthreads);
      break;
    case W_Q8_0: tandem_linear_q8_0(x, w->panels, w->bias, residual, y, M, N, K, nthreads); break;
    case W_Q4_1: tandem_linear_q4_1(x, w->panels, w->bias, residual, y, M, N, K, nthreads); break;
    default: tandem_linear(x, w->panels, w->bias, residual, y, M, N, K, nthreads); break;
  }
}

/* hidden[tokens, dim] through num_layers layers, in place. scratch holds tokens x (dim +
 * (heads + 2 kv_heads) head_dim + 2 heads head_dim + 3 inter) floats. With `head` (else
 * NULL), the final norm (its weight final_norm, epsilon final_eps) and the LM head follow over
 * every row: logits[tokens, head_out], hidden left as the body's output. Returns 0, -1 when
 * the attention kernel refuses the shapes or the caches' kv_type (checked before anything is
 * written), or -2 when it cannot allocate its partial results (OUT_OF_MEMORY in kernels.py). */
int tandem_layers(const tandem_layer *layers, int64_t num_layers, const tandem_batch *batch,
                  float *hidden, int64_t tokens, int64_t dim, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t inter, float eps, float scale, float *scratch,
                  int nthreads, const tandem_weight *head, const float *final_norm,
                  float final_eps, int64_t head_out, float *logits) {
  if (!tandem_attention_supports(heads, kv_heads, head_dim, batch->block_size)) return -1;
  if (batch->kv_type == KV_BF16P ? !tandem_attention_pairs(head_dim, batch->block_size)
                                 : batch->kv_type < KV_F32 || batch->kv_type > KV_BF16)
    return -1;
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, q_width = heads * head_dim;
  float *x = scratch, *qkv = x + tokens * dim, *q = qkv + tokens * qkv_width;
  float *attn = q + tokens * q_width, *gate_up = attn + tokens * q_width;
  float *act = gate_up + tokens * 2 * inter;
  for (int64_t l = 0; l < num_layers; l++) {
    const tandem_layer *layer = layers + l;
    tandem_rms_norm(hidden, layer->input_norm, x, tokens, dim, eps);
    linear_any(&layer->qkv, x, 0, qkv, tokens, qkv_width, dim, nthreads);
    tandem_rotary_cache(qkv, batch->positions, batch->slots, batch->cos, batch->sin, tokens,
                        heads, kv_heads, head_dim, q, layer->key_cache, layer->value_cache,
                        (int)batch->kv_type, batch->block_size);
    const int status = tandem_paged_attention(
        q, layer->key_cache, layer->value_cache, batch->tables, batch->width, batch->q_starts,
        batch->q_lens, batch->ctx_lens, batch->tree, batch->tree_base, batch->num_seqs, attn,
        heads, kv_heads, head_dim, batch->block_size, scale, (int)batch->kv_type, nthreads);
    if (status != 0) return status; /* -2: out of memory (the shapes were checked above) */
    linear_any(&layer->o, attn, hidden, hidden, tokens, dim, q_width, nthreads);
    tandem_rms_norm(hidden, layer->post_norm, x, tokens, dim, eps);
    linear_any(&layer->gate_up, x, 0, gate_up, tokens, 2 * inter, dim, nthreads);
    tandem_silu_mul(gate_up, act, tokens, inter);
    linear_any(&layer->down, act, hidden, hidden, tokens, dim, inter, nthreads);
  }
  if (head) {
    tandem_rms_norm(hidden, final_norm, x, tokens, dim, final_eps);
    linear_any(head, x, 0, logits, tokens, head_out, dim, nthreads);
  }
  return 0;
}
