"""Paged attention: the contract every backend implements and the reference backend on
PyTorch's SDPA (`paged`, which also plugs into transformers' AttentionInterface), backends by
name and the choice for a device (`backends`), Tandem's C kernel on the CPU (`cpu`) and the
Triton kernel on CUDA (`triton_kernel`)."""
