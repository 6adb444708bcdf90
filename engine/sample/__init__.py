"""Turning logits into tokens (`sampler`) and the lossless accept/reject rules of speculative
sampling (`rejection_sampler`, `tree_verifier`)."""
