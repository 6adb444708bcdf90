"""Paged attention: the backend contract, reference, CPU and Triton backends."""
