"""Speculation: the proposers that draft tokens (a draft model, prompt-lookup n-grams), the
choice of how many to draft per request and step (`draft_length`, on the measured pass costs
of `cost_model`), the verifier that scores drafts against the target's distributions, and the
speed-of-light gauge that compares accepted tokens per pass with their bound."""
