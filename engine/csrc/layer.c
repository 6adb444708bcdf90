#include "vec.h"

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
