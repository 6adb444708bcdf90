"""Turning logits into tokens: the per-request logits processing (penalties, temperature,
top-k/top-p, min_tokens) and the draw by inverse CDF (`sampler`), and the lossless
accept/reject rule of speculative sampling (`rejection_sampler`)."""
